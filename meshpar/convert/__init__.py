"""Offline checkpoint conversion, one tensor at a time: meshpar (DCP) <-> Hugging Face safetensors,
DCP <-> one ``torch.save`` file, DCP -> DCP re-chunked for another layout; checksummed
verification; ``describe`` for ``meshpar checkpoint info``; ``load_hf_weights`` to start
training from a Hugging Face folder.

    convert("ckpt/step_200", "out/llama-hf", to="hf", verify=True)    # + config.json, index
    convert("out/llama-hf", "ckpt0/step_0", to="dcp")                  # step 0, layout all 1s
    convert("ckpt/step_200", "ckpt8/step_200", to="dcp", layout={"dp_shard": 4, "tp": 2})
    convert("ckpt/step_200", "weights.pt", to="torch")                  # {fqn: tensor}
    print(describe("ckpt"))                                             # every step_*, newest complete

No process group and no GPU. A conversion is a *source* (a DCP folder, a Hugging Face folder
or a torch file) read one tensor at a time and a *sink* written one tensor at a time:
[Note: streaming conversion] (stream.py). Per-family names, transposes and ``config.json`` live in
``meshpar/models/<family>/convert.py``; the mixture-of-experts families (qwen3_moe, mixtral) stack
Hugging Face's one tensor per expert into meshpar's one per layer and projection, and back, still
one meshpar tensor at a time ([Note: stacked experts], spec.py).

Limits: DCP -> torch holds the whole output in memory (``torch.save`` writes one object);
every other direction streams. Non-tensor entries (LR schedule, data position, RNG, step)
are copied as DCP's serialized bytes and never unpickled.

The package, in reading order: ``stream.py`` (convert, verify, open_checkpoint), ``spec.py``
(a family's names, shapes and TP placements), ``layout.py`` (which chunk each rank holds),
``dcp.py`` / ``hf.py`` / ``torch_file.py`` (each format's source and sink), ``files.py``,
``progress.py``, ``info.py`` (describe) and ``load_hf.py``.
"""

from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: F401 - tests build chunk indexes from here

from meshpar.convert.dcp import DCPSink, DCPSource
from meshpar.convert.hf import SAFETENSORS_DTYPES, TORCH_DTYPES, HFSink, HFSource, _st_header  # noqa: F401 - tests
from meshpar.convert.info import describe
from meshpar.convert.layout import DIMS, boxes, index_lists, layout_chunks, parse_layout
from meshpar.convert.load_hf import load_hf_weights
from meshpar.convert.spec import ConvertError, ModelSpec, check_model_tensors, spec_from_info
from meshpar.convert.stream import TARGETS, Summary, convert, digest, open_checkpoint, verify
from meshpar.convert.torch_file import TorchSink, TorchSource

__all__ = [
    "DIMS", "SAFETENSORS_DTYPES", "TARGETS", "TORCH_DTYPES", "ConvertError", "DCPSink", "DCPSource",
    "HFSink", "HFSource", "ModelSpec", "Summary", "TorchSink", "TorchSource", "boxes", "check_model_tensors",
    "convert", "describe", "digest", "index_lists", "layout_chunks", "load_hf_weights", "open_checkpoint",
    "parse_layout", "spec_from_info", "verify",
]
