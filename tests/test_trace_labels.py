"""Trace labels for tensor-parallel collectives (meshpar/profiling/labels.py), on 2 gloo ranks.

A 2-layer Llama under TP (loss parallel) runs forward and backward three times: with the
profiler off, on, and off again. Checked: every collective DTensor issues on the main thread
lies inside a ``meshpar::tp.*`` label, forward and backward; the backward ranges hold the
transposed collectives; gradients are bit-identical with and without the profiler; and with
the profiler off the labels add no autograd node. Pipeline labels are checked on real
traces in tests/test_profile_report.py.
"""

import dataclasses
import json
import re

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.models.llama.parallelize import llama_tp_plan
from meshpar.parallel.tensor_parallel.plan import apply_tp, loss_parallel_context
from meshpar.training.loss import cross_entropy
from tests.distributed import run_distributed

ARGS = dataclasses.replace(LLAMA_SIZES["debug"], n_layers=2)
_ISSUES = re.compile(r"_c10d_functional::(?!wait_tensor|_wrap_tensor_autograd).*")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _step(model, tokens) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with loss_parallel_context(True):
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return _grads(model)


def _job(trace_path: str) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_tp(model, mesh["tp"], llama_tp_plan(loss_parallel=True))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    off = _step(model, tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        on = _step(model, tokens)
    if dist.get_rank() == 0:
        prof.export_chrome_trace(trace_path)
    again = _step(model, tokens)
    return {"same": all(torch.equal(off[n], on[n]) and torch.equal(off[n], again[n]) for n in off)}


def test_tensor_parallel_collectives_are_labelled(tmp_path):
    path = tmp_path / "trace.json"
    result = run_distributed(_job, 2, str(path), timeout=180)[0]
    assert result["same"]  # labelling changes no gradient bit

    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    main = next(e["tid"] for e in events if e["name"].startswith("meshpar::tp.input["))
    on_main = [e for e in events if e["tid"] == main]
    labels = [e for e in on_main if e["name"].startswith("meshpar::tp.")]
    issues = [e for e in on_main if _ISSUES.fullmatch(e["name"])]

    def inside(e: dict, pred) -> bool:
        return any(pred(lab["name"]) and lab["ts"] <= e["ts"] and e["ts"] + e["dur"] <= lab["ts"] + lab["dur"]
                   for lab in labels)

    assert len(issues) > 20
    unlabelled = [e["name"] for e in issues if not inside(e, lambda n: True)]
    assert unlabelled == []
    names = {re.sub(r"\[.*\]", "[]", lab["name"]) for lab in labels}
    assert names == {"meshpar::tp.input[]", "meshpar::tp.output[]", "meshpar::tp.input_grad[]",
                     "meshpar::tp.output_grad[]", "meshpar::tp.loss_parallel[]", "meshpar::tp.loss_parallel_grad[]"}
    # the paths name the modules of the plan
    assert any(lab["name"] == "meshpar::tp.input[layers.0.attention.wq]" for lab in labels)
    assert any(lab["name"] == "meshpar::tp.output[embedding]" for lab in labels)
    # backward collectives (the transposes of the forward redistributions) sit in *_grad ranges
    in_backward = [e for e in issues if inside(e, lambda n: "_grad[" in n)]
    assert len(in_backward) >= 2 * ARGS.n_layers
    # ranges nest: no backward range overlaps another partially
    grads = sorted((lab["ts"], lab["ts"] + lab["dur"]) for lab in labels if "_grad[" in lab["name"])
    assert len(grads) >= 2, grads
    for (_, a1), (b0, b1) in zip(grads, grads[1:], strict=False):
        assert b0 >= a1 or b1 <= a1
