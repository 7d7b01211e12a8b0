"""Checkpoint conversion (meshpar/convert/): round trips on tiny random weights for every
family, layout re-chunking, verification, errors that name the tensor, ``describe``, logits
against transformers (when installed), peak memory while streaming, and ``load_hf_weights``
into sharded DTensors on 2 gloo ranks.

Test checkpoints are written the way meshpar/checkpoint/checkpointer.py writes them: a nested state dict
``{"model": {fqn: t}, "optim": {fqn: {"exp_avg", "exp_avg_sq", "step"}}, "train": ..., ...}``
saved by ``dcp.save(no_dist=True)``, plus meshpar.json.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from meshpar import convert as cv
from meshpar.models import get_family
from meshpar.models.llama.args import RopeScaling
from meshpar.models.llama.convert import half_to_interleaved, interleaved_to_half
from meshpar.models.llama.model import apply_rope, rope_frequencies
from tests.distributed import run_distributed

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
ONE = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save(no_dist=True) says so


def model_args(family: str):
    args = dataclasses.replace(get_family(family).sizes["debug"], n_layers=2)
    if family == "llama":  # Llama 3.1 scaling that matters at short positions: checks the rope_scaling keys
        args = dataclasses.replace(args, max_seq_len=256, rope_scaling=RopeScaling(original_max_seq_len=64))
    return args


def random_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The debug model with 2 blocks and random weights, norms and biases included."""
    torch.manual_seed(seed)
    model = get_family(family).model_cls(model_args(family))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.05 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    return model


def save_checkpoint(path: Path, family: str, *, drop: str = "", reshape: str = "", step: int = 3) -> dict:
    """A meshpar checkpoint of ``random_model(family)`` with optimizer state and non-tensor entries."""
    model = random_model(family)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}  # tied names: equal values
    optim = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v), "step": torch.tensor(float(step))}
             for k, v in sd.items()}
    if drop:
        del sd[drop]
    if reshape:
        sd[reshape] = torch.zeros(7, 3)
    state = {"model": sd, "optim": optim, "train": {"step": step}, "lr_schedule": {"last_epoch": step},
             "data": {"consumed": 96}, "rng": {"cpu": torch.get_rng_state()}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    (path / "meshpar.json").write_text(json.dumps({
        "format": 1, "step": step, "family": family, "size": "debug", "layout": ONE, "world_size": 1,
        "model_args": dataclasses.asdict(model_args(family)), "saved_at": "2026-11-23T12:00:00Z"}))
    (path / "recipe.toml").write_text("[model]\n")
    return state


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: (root / f / "step_3", save_checkpoint(root / f / "step_3", f)) for f in FAMILIES}


def flat(state: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under DCP's flattened keys."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update({f"optim.{k}.{s}": v for k, d in state["optim"].items() for s, v in d.items()})
    out["rng.cpu"] = state["rng"]["cpu"]
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    source = cv.open_checkpoint(path)
    return {k: source.read(k) for k in source.tensors}


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want) and want, sorted(got)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k  # bit-identical


@pytest.mark.parametrize("family", FAMILIES)
def test_dcp_to_hf_to_dcp_is_bit_identical(ckpts, tmp_path, family):
    src, state = ckpts[family]
    cv.convert(src, tmp_path / "hf", "hf", verify=True, progress=False, shard_size=1_500_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1 and files[0].endswith("-of-" + files[-1][-17:])  # sharded: model-0000i-of-0000n
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    hf = {k: v for f in files for k, v in load_file(tmp_path / "hf" / f).items()}  # safetensors reads our files
    assert sorted(index["weight_map"]) == sorted(hf)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in hf.values())
    assert ("lm_head.weight" in hf) == (family == "llama")  # omitted when tied
    cv.convert(tmp_path / "hf", tmp_path / "back" / "step_0", "dcp", verify=True, progress=False)
    info = json.loads((tmp_path / "back" / "step_0" / "meshpar.json").read_text())
    assert info["model_args"] == dataclasses.asdict(model_args(family)) and info["family"] == family
    assert (info["step"], info["layout"], info["world_size"]) == (0, ONE, 1)
    model = {k: v for k, v in flat(state).items() if k.startswith("model.")}
    assert_identical(read_all(tmp_path / "back" / "step_0"), model)


@pytest.mark.parametrize("family", FAMILIES)
def test_dcp_to_torch_to_dcp_is_bit_identical(ckpts, tmp_path, family):
    src, state = ckpts[family]
    cv.convert(src, tmp_path / "w.pt", "torch", verify=True, progress=False)
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    get_family(family).model_cls(model_args(family)).load_state_dict(weights)  # {fqn: tensor}, strict
    cv.convert(tmp_path / "w.pt", tmp_path / "back", "dcp", verify=True, progress=False)
    assert_identical(read_all(tmp_path / "back"), {k: v for k, v in flat(state).items() if k.startswith("model.")})
    # --all: every entry, optimizer state and non-tensor entries (as DCP's bytes) included
    cv.convert(src, tmp_path / "all.pt", "torch", model_only=False, progress=False)
    cv.convert(tmp_path / "all.pt", tmp_path / "all", "dcp", verify=True, progress=False)
    assert_identical(read_all(tmp_path / "all"), flat(state))
    assert cv.verify(src, tmp_path / "all") == len(flat(state))  # non-tensor entries compared too


@pytest.mark.parametrize("family", FAMILIES)
def test_rechunk_for_a_layout_then_hf_is_identical(ckpts, tmp_path, family):
    src, state = ckpts[family]
    layout = {"dp_shard": 2, "tp": 2}
    cv.convert(src, tmp_path / "re", "dcp", layout=layout, verify=True, progress=False)
    out = cv.open_checkpoint(tmp_path / "re")
    assert out.info["layout"] == {**ONE, **layout} and out.info["world_size"] == 4
    assert (tmp_path / "re" / "recipe.toml").read_text() == (src / "recipe.toml").read_text()
    assert sorted(p.name for p in (tmp_path / "re").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert_identical(read_all(tmp_path / "re"), flat(state))
    assert sorted(out.byte_keys) == ["data.consumed", "lr_schedule.last_epoch", "train.step"]
    spec = cv.ModelSpec(family, model_args(family))
    assert any(k.startswith("model.") for k in out.tensors), sorted(out.tensors)
    for key, chunks in ((k, out.chunks(k)) for k in out.tensors if k.startswith("model.")):
        placement = spec.tp_placement(key[6:])
        # dp 2 x tp 2 boxes; GPT-2's fused q|k|v: rank t's [q_t | k_t | v_t], halved by dp, is 2 runs each
        n = {Replicate(): 2}.get(placement, 4) if placement != _StridedShard(0, split_factor=3) else 8
        assert len(chunks) == (1 if out.tensors[key][0].numel() == 1 else n), (key, placement)
    # rank (dp d, tp t) = 2 d + t holds row block t of a column-wise weight, then its half d
    name = "model.layers.0." + ("mlp.c_fc.weight" if family == "gpt2" else "feed_forward.w1.weight")
    rows = out.tensors[name][0][0]
    for c in out.chunks(name):
        rank = 2 * (c.offsets[0] % (rows // 2) // (rows // 4)) + c.offsets[0] // (rows // 2)
        assert out.metadata.storage_data[cv.MetadataIndex(name, c.offsets)].relative_path == f"__{rank}_0.distcp"
    cv.convert(tmp_path / "re", tmp_path / "hf2", "hf", progress=False)
    cv.convert(src, tmp_path / "hf1", "hf", progress=False)
    files = sorted((tmp_path / "hf1").glob("*.safetensors"))
    assert files and [f.name for f in files] == sorted(f.name for f in (tmp_path / "hf2").glob("*.safetensors"))
    for f in files:
        assert f.read_bytes() == (tmp_path / "hf2" / f.name).read_bytes()  # the same files, byte for byte


def test_layout_chunks_match_dtensor_placements():
    """Our chunking equals DTensor's own (torch's local shape and offset), uneven dp chunks included:
    FSDP over a column-wise TP weight is _StridedShard(0, tp) on dp then Shard(0) on tp. tp divides
    the dim it shards, as meshpar checks before launch (uneven TP chunks are not nested chunks)."""
    for shape, tp_pl in (((12, 6), Shard(0)), ((7, 8), Shard(1)), ((9,), Replicate()), ((20, 4), Shard(0))):
        for tp, dp in ((2, 2), (2, 3), (4, 1), (1, 4)):
            got = cv.layout_chunks(shape, {**ONE, "dp_shard": dp, "tp": tp}, tp_pl, stage=0)
            dp_pl = _StridedShard(0, split_factor=tp) if tp_pl == Shard(0) else Shard(0)
            for d in range(dp):
                for t in range(tp):
                    size, off = _compute_local_shape_and_global_offset(shape, (dp, tp), [d, t], [dp_pl, tp_pl])
                    if all(size):
                        assert d * tp + t in got[(tuple(off), tuple(size))], (shape, tp_pl, tp, dp, d, t)
    # GPT-2's fused q|k|v on tp 2: rank t holds rows t of each third, three chunks
    idx = cv.index_lists((12, 2), (2,), (1,), (_StridedShard(0, split_factor=3),))
    assert [off for off, _, _ in cv.boxes(idx)] == [(2, 0), (6, 0), (10, 0)]


def _placement_mismatches() -> tuple[dict[tuple[str, str], tuple[str, str]], set]:
    """Every family's debug model (but hf's, whose plan transformers' model makes) on meta under its
    tensor-parallel plan on a 2-rank tp mesh of a fake process group (no peers): {(family, state-dict
    name): (converter's placement, the tensor's)} where ``ModelSpec.tp_placement`` differs from the
    placement the tensor gets (Replicate: a plain tensor the plan leaves alone); and every (family,
    placement) seen."""
    from meshpar.distributed._torch import FakeStore
    from meshpar.models import FAMILIES as REGISTRY
    from meshpar.parallel.tensor_parallel.plan import apply_tp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        mismatches, seen = {}, set()
        for name, family in REGISTRY.items():
            if name == "hf":
                continue
            args = family.sizes["debug"]
            with torch.device("meta"):
                model = family.model_cls(args)
            apply_tp(model, mesh, family.tp_plan.with_loss_parallel(True))
            spec = cv.ModelSpec(name, args)
            for fqn, value in model.state_dict().items():
                actual = value.placements[0] if isinstance(value, torch.distributed.tensor.DTensor) else Replicate()
                seen.add((name, actual))
                if spec.tp_placement(fqn) != actual:
                    mismatches[name, fqn] = (repr(spec.tp_placement(fqn)), repr(actual))
        return mismatches, seen
    finally:
        dist.destroy_process_group()


def test_tp_placements_are_those_the_plans_give():
    """For every family (but hf) and every state-dict tensor of its debug model, the placement the converter
    lays a tp > 1 checkpoint out with (``ModelSpec.tp_placement``) is the one the family's plan gives the
    tensor in training: a DCP checkpoint converted for tp = 2 loads as training saves it. Among them:
    gpt-oss's sinks Shard(0) (``ShardedByHead``), GPT-2's fused q|k|v _StridedShard(0, 3)."""
    (mismatches, seen), = run_distributed(_placement_mismatches, 1, timeout=120, init_process_group=False)
    assert mismatches == {}
    assert {("gpt_oss", Shard(0)), ("gpt2", _StridedShard(0, split_factor=3)), ("llama", Shard(1)),
            ("llama", Replicate())} <= seen
    assert cv.ModelSpec("gpt_oss", get_family("gpt_oss").sizes["debug"]).tp_placement(
        "layers.0.attention.sinks.weight") == Shard(0)


def test_pipeline_layout_puts_each_tensor_in_its_stage_files(ckpts, tmp_path):
    src, state = ckpts["llama"]
    cv.convert(src, tmp_path / "pp", "dcp", layout={"pp": 2, "dp_shard": 2}, progress=False)
    out = cv.open_checkpoint(tmp_path / "pp")
    files = {k: set(out.where(k).split(", ")) for k in out.tensors}
    stage0, stage1 = {"__0_0.distcp", "__1_0.distcp"}, {"__2_0.distcp", "__3_0.distcp"}
    assert files["model.tok_embeddings.weight"] == files["model.layers.0.attention.wq.weight"] == stage0
    assert files["model.output.weight"] == files["optim.layers.1.feed_forward.w2.weight.exp_avg"] == stage1
    assert_identical(read_all(tmp_path / "pp"), flat(state))


def test_gpt2_reads_openai_names_and_skips_mask_buffers(ckpts, tmp_path):
    """OpenAI's original GPT-2 upload has no "transformer." prefix and saves the attention mask."""
    from safetensors.torch import save_file

    src, state = ckpts["gpt2"]
    cv.convert(src, tmp_path / "hf", "hf", progress=False)
    tensors = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 8, 8) for i in range(2)})
    (tmp_path / "openai").mkdir()
    save_file(tensors, tmp_path / "openai" / "model.safetensors")
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "openai")
    cv.convert(tmp_path / "openai", tmp_path / "dcp", "dcp", progress=False)
    assert_identical(read_all(tmp_path / "dcp"), {k: v for k, v in flat(state).items() if k.startswith("model.")})


def test_verify_names_a_corrupted_tensor(ckpts, tmp_path):
    src, _ = ckpts["gpt2"]
    cv.convert(src, tmp_path / "hf", "hf", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    file = tmp_path / "hf" / index["weight_map"]["transformer.h.1.mlp.c_fc.weight"]
    header, start = cv._st_header(file)
    begin, _ = header["transformer.h.1.mlp.c_fc.weight"]["data_offsets"]
    data = bytearray(file.read_bytes())
    data[start + begin + 100] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(cv.ConvertError, match=r"'model\.layers\.1\.mlp\.c_fc\.weight' differs .*model-000"):
        cv.verify(src, tmp_path / "hf")
    cv.convert(src, tmp_path / "re", "dcp", layout={"tp": 2}, progress=False)
    out = cv.open_checkpoint(tmp_path / "re")
    store = out.metadata.storage_data[cv.MetadataIndex("optim.wpe.weight.exp_avg", (0, 0))]
    with open(tmp_path / "re" / store.relative_path, "r+b") as f:
        f.seek(store.offset + store.length - 2000)  # inside the tensor's bytes
        f.write(b"\x00" * 8)
    with pytest.raises(cv.ConvertError, match=r"'optim\.wpe\.weight\.exp_avg'"):
        cv.verify(src, tmp_path / "re")


def test_errors_name_the_problem_and_the_fix(tmp_path):
    save_checkpoint(tmp_path / "miss" / "step_1", "qwen3", drop="layers.1.attention.k_norm.weight")
    with pytest.raises(cv.ConvertError, match=r"'model\.layers\.1\.attention\.k_norm\.weight' is missing"):
        cv.convert(tmp_path / "miss" / "step_1", tmp_path / "o1", "hf", progress=False)
    save_checkpoint(tmp_path / "shape", "llama", reshape="norm.weight")
    with pytest.raises(cv.ConvertError, match=r"'model\.norm\.weight' has shape \[7, 3\].* needs \[256\]"):
        cv.convert(tmp_path / "shape", tmp_path / "o2", "dcp", progress=False)
    with pytest.raises(cv.ConvertError, match="a folder of checkpoints; pass one of them"):
        cv.convert(tmp_path / "miss", tmp_path / "o3", "hf", progress=False)
    with pytest.raises(cv.ConvertError, match="no such file or folder"):
        cv.convert(tmp_path / "nowhere", tmp_path / "o4", "hf", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(cv.ConvertError, match="not a checkpoint"):
        cv.convert(tmp_path / "empty", tmp_path / "o5", "hf", progress=False)
    (tmp_path / "miss" / "step_1" / "meshpar.json").rename(tmp_path / "m.json")
    with pytest.raises(cv.ConvertError, match="meshpar.json is missing, so the checkpoint is incomplete"):
        cv.convert(tmp_path / "miss" / "step_1", tmp_path / "o6", "hf", progress=False)
    save_checkpoint(tmp_path / "ok", "qwen2")
    cv.convert(tmp_path / "ok", tmp_path / "hf", "hf", progress=False)
    with pytest.raises(cv.ConvertError, match="already exists"):
        cv.convert(tmp_path / "ok", tmp_path / "hf", "hf", progress=False)
    with pytest.raises(cv.ConvertError, match="layout: unknown dimension 'ep'"):
        cv.convert(tmp_path / "ok", tmp_path / "o7", "dcp", layout={"ep": 2}, progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(cv.ConvertError, match="model_type 'mistral' is not a family meshpar converts"):
        cv.convert(tmp_path / "hf", tmp_path / "o8", "dcp", progress=False)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(cv.ConvertError, match=r"'model\.layers\.2\.input_layernorm\.weight' \(meshpar "):
        cv.convert(tmp_path / "hf", tmp_path / "o9", "dcp", progress=False)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    with pytest.raises(cv.ConvertError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' .* has shape \[768, 256\]"):
        cv.convert(tmp_path / "hf", tmp_path / "o10", "dcp", progress=False)


def test_describe_lists_steps_and_the_newest_complete(ckpts, tmp_path):
    src, _ = ckpts["llama"]
    cv.convert(src, tmp_path / "step_10", "dcp", layout={"dp_shard": 4}, progress=False)
    shutil.copytree(src, tmp_path / "step_20")
    (tmp_path / "step_20" / "meshpar.json").unlink()  # a save that did not finish
    text = cv.describe(tmp_path)
    assert "step_10        complete" in text and "step_20        INCOMPLETE" in text
    assert f"checkpoint {tmp_path / 'step_10'}: complete" in text
    assert "step 3 | llama debug | saved from dp_shard 4 (world size 4)" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("model.layers.0.feed_forward.w1.weight"))
    assert line.split()[1:] == ["[768,", "256]", "float32", "786.43", "KB", "4"]
    assert "non-tensor entries (3): train.step, lr_schedule.last_epoch, data.consumed" in text
    assert "total: 85 tensors, 31.48 MB [model 21 (10.49 MB), optim 63 (20.98 MB), rng 1 (5.06 KB)]" in text
    assert "INCOMPLETE (meshpar.json missing" in cv.describe(tmp_path / "step_20")


def test_cli_convert_and_checkpoint_info(ckpts, tmp_path, capsys):
    from meshpar.cli import main
    from tools.convert import main as tool_main

    src, _ = ckpts["qwen2"]
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "re"), "--to", "dcp", "--layout", "dp_shard=2,tp=2", "--verify"])
    assert e.value.code == 0 and "verified" in capsys.readouterr().out
    assert tool_main([str(tmp_path / "re"), str(tmp_path / "hf"), "--to", "hf", "--shard-size", "2MB"]) == 0
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    with pytest.raises(SystemExit) as e:
        main(["checkpoint", "info", str(tmp_path / "re")])
    assert e.value.code == 0 and "saved from dp_shard 2 x tp 2 (world size 4)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "hf"])
    assert e.value.code == 1 and "no such file or folder" in capsys.readouterr().err


def test_rope_permutation_to_and_from_meta_layout():
    """Meta's adjacent-pair RoPE on wq equals meshpar's half-split RoPE on the permuted wq,
    up to the same permutation of each head's output ([Note: RoPE layout and conversion])."""
    n_heads, dh, dim, seq = 2, 8, 12, 5
    w = torch.randn(n_heads * dh, dim, dtype=torch.float64)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, n_heads), n_heads), w)
    x = torch.randn(seq, dim, dtype=torch.float64)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), rope_frequencies(dh, 10000.0))  # [T, Dh/2]
    q = (x @ w.T).view(seq, n_heads, dh // 2, 2)  # Meta: pairs (2j, 2j + 1)
    meta = torch.view_as_real(torch.view_as_complex(q.contiguous()) * torch.polar(torch.ones_like(angles),
                                                                                  angles)[:, None])
    ours = apply_rope((x @ interleaved_to_half(w, n_heads).T).view(seq, n_heads, dh).transpose(0, 1),
                      angles.cos(), angles.sin()).transpose(0, 1)
    assert torch.allclose(interleaved_to_half(meta.reshape(seq, -1).T, n_heads).T.reshape(seq, n_heads, dh), ours)


@pytest.mark.parity
@pytest.mark.slow  # imports transformers (seconds); the inner loop checks the export's tensors bit for bit instead
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_gives_the_same_logits_in_transformers(ckpts, tmp_path, family):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only extra: "
                                       "pip install transformers to check logits against it")
    src, _ = ckpts[family]
    cv.convert(src, tmp_path / "hf", "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()  # config.json: float32
    assert hf.dtype == torch.float32
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}[family]
    tokens = torch.randint(0, model_args(family).vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # both in float64, so summation order adds ~1e-15 (tests/parity.py)
        ours, theirs = random_model(family).double()(tokens), hf.double()(tokens).logits
    assert ours.abs().max() > 1.0  # not a vacuous comparison
    # GPT-2 (learned positions) agrees to ~1e-14. transformers computes RoPE's angles in float32
    # whatever the model's dtype: at 48 positions an angle is off by up to 48 * 2^-24 = 3e-6 rad,
    # moving rotated queries and keys by ~3e-6 relative; measured 1.7e-6 on logits of ~4 on
    # every kernel path, so 1e-5 bounds the RoPE families with ~5x margin.
    tol = 1e-9 if family == "gpt2" else 1e-5
    assert (ours - theirs).abs().max().item() <= tol


MEMORY_SCRIPT = """
import dataclasses, json, sys, warnings
import torch, torch.distributed.checkpoint as dcp
from meshpar import convert as cv
from meshpar.models.llama.args import ModelArgs
warnings.filterwarnings("ignore")
root = sys.argv[1]
args = ModelArgs(dim=1024, n_layers=5, n_heads=8, n_kv_heads=8, ffn_dim=2816, vocab_size=8192)  # 322 MB of fp32
state = {"model": {k: torch.randn(shape) for k, shape in cv.ModelSpec("llama", args).shapes.items()}}
largest = max(t.nbytes for t in state["model"].values())
dcp.save(state, checkpoint_id=root + "/ck", no_dist=True)
del state
info = {"format": 1, "step": 1, "family": "llama", "size": "custom", "model_args": dataclasses.asdict(args),
        "layout": {}, "world_size": 1, "saved_at": ""}
open(root + "/ck/meshpar.json", "w").write(json.dumps(info))
a = cv.convert(root + "/ck", root + "/hf", "hf", progress=False)
b = cv.convert(root + "/hf", root + "/back", "dcp", progress=False)
print(json.dumps({"largest": largest, "total": a.bytes, "to_hf": a.peak_bytes, "to_dcp": b.peak_bytes,
                  "method": a.peak_method}))
"""


def test_conversion_streams_with_peak_memory_near_the_largest_tensor(tmp_path):
    """~320 MB of weights, largest tensor 33.5 MB: each direction's RSS peak (VmHWM above the
    start, measured in a fresh process) stays within 2.5x the largest tensor + 64 MB."""
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    bound = 2.5 * r["largest"] + 64e6
    assert r["total"] > 1.5 * bound  # holding the model would break the bound
    if r["method"] != "VmHWM":
        pytest.skip(f"no /proc/self/clear_refs here (method {r['method']}): cannot measure a conversion's own peak")
    assert r["to_hf"] <= bound and r["to_dcp"] <= bound, r


def test_load_hf_weights_into_plain_tensors(ckpts, tmp_path):
    src, state = ckpts["qwen3"]
    cv.convert(src, tmp_path / "hf", "hf", progress=False)
    model = get_family("qwen3").model_cls(model_args("qwen3"))
    cv.load_hf_weights(model.state_dict(), tmp_path / "hf", "qwen3", model_args("qwen3"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state["model"][k]), k
    wrong = dataclasses.replace(model_args("qwen3"), n_heads=4, n_kv_heads=2, head_dim=128)
    with pytest.raises(cv.ConvertError, match="n_heads 8 vs 4"):
        cv.load_hf_weights(model.state_dict(), tmp_path / "hf", "qwen3", wrong)


def _load_sharded_job(hf_dirs: dict[str, str]) -> dict:
    """Every sub-case on one 2-rank world: FSDP (Shard(0)), tensor parallel (Shard(0), Shard(1),
    Replicate, GPT-2's _StridedShard(0, 3)); each loads and gathers back, and is compared."""
    from meshpar.fsdp import fully_shard
    from meshpar.parallel.tensor_parallel.plan import apply_tp

    errors, seen = {}, set()
    for family, hf_dir in hf_dirs.items():
        args, cls = model_args(family), get_family(family).model_cls
        want = random_model(family).state_dict()
        for how in ("fsdp", "tp"):
            with torch.device("meta"):
                model = cls(args)
            mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(how,))
            if how == "tp":
                apply_tp(model, mesh, get_family(family).tp_plan.with_loss_parallel(True))
            else:
                for block in model.layers.values():
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            cv.load_hf_weights(model.state_dict(), hf_dir, family, args)
            for name, p in model.state_dict().items():
                seen.add(str(p.placements))
                if not torch.equal(p.full_tensor(), want[name]):
                    errors[family, how, name] = str(p.placements)
    return errors, sorted(seen)


def test_load_hf_weights_into_sharded_dtensors(ckpts, tmp_path):
    hf_dirs = {}
    for family in ("llama", "gpt2"):
        cv.convert(ckpts[family][0], tmp_path / family, "hf", progress=False)
        hf_dirs[family] = str(tmp_path / family)
    (errors, seen), _ = run_distributed(_load_sharded_job, 2, hf_dirs, timeout=120)
    assert errors == {}
    assert seen == ["(Replicate(),)", "(Shard(dim=0),)", "(Shard(dim=1),)", "(_StridedShard(dim=0, sf=3),)"]


def test_converted_checkpoint_has_per_chunk_crcs_that_loads_check(ckpts, tmp_path):
    """``meshpar convert`` writes crc/<rank>.json as training's saver does: one CRC-32 per chunk,
    equal to the bytes on disk, so a flipped byte in a converted checkpoint fails its load."""
    from meshpar.checkpoint.checkpointer import _find_checkpoint_error
    from meshpar.checkpoint.format import CheckpointError, _CheckedLoadPlanner, crc_key, crc_of_range

    src, _ = ckpts["llama"]
    out = tmp_path / "re"
    cv.convert(src, out, "dcp", layout={"dp_shard": 2}, progress=False)
    crcs: dict[str, int] = {}
    for f in sorted((out / "crc").glob("*.json")):
        crcs.update(json.loads(f.read_text()))
    items = dcp.FileSystemReader(out).read_metadata().storage_data.values()
    assert sorted(crcs) == sorted(crc_key(i.relative_path, i.offset, i.length) for i in items)
    assert {f.name for f in (out / "crc").iterdir()} == {"0.json", "1.json"}
    assert crcs, "no checksums written"
    for i in items:
        assert crcs[crc_key(i.relative_path, i.offset, i.length)] == crc_of_range(out / i.relative_path, i.offset,
                                                                                   i.length)
    fqn = "model.layers.0.attention.wq.weight"
    info = next(v for k, v in dcp.FileSystemReader(out).read_metadata().storage_data.items() if k.fqn == fqn)
    data = bytearray((out / info.relative_path).read_bytes())
    data[info.offset + info.length // 2] ^= 0x40
    (out / info.relative_path).write_bytes(bytes(data))
    state = {"model": {k[6:]: torch.empty(s) for k, (s, _) in cv.open_checkpoint(src).tensors.items()
                       if k.startswith("model.")}}
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load(state, checkpoint_id=out, planner=_CheckedLoadPlanner(out), no_dist=True)
    error = _find_checkpoint_error(e.value.failures)
    assert isinstance(error, CheckpointError) and f"file {info.relative_path} (tensor {fqn}) is corrupted" in str(error)
