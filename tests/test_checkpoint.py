"""Sharded checkpoints: exact resume, reshard on load across layouts, atomic saves, checked files.

Every run is ``meshpar train`` on the small byte-level debug Llama (tests/helpers.py's SMALL),
with the checkpoint section set from the command line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from meshpar import checkpoint as ckpt
from meshpar.checkpoint import CheckpointError
from meshpar.checkpoint import checkpointer as checkpointer_module
from meshpar.config import recipe as recipelib
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import load_recipe, merged_state, train_losses

LAYOUTS = {
    "1 rank": (1, []),
    "dp4": (4, ["--parallel.dp_shard=4"]),
    "dp2xtp2": (4, ["--parallel.dp_shard=2", "--parallel.tp=2"]),
    "hybrid2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]),
    "pp2xdp2xtp2": (8, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2", "--train.micro_batch=1"]),
    "dp2": (2, ["--parallel.dp_shard=2"]),
    "rep2xtp2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.tp=2"]),
    "cp2xdp2": (4, ["--parallel.dp_shard=2", "--parallel.cp=2"]),
}


def _on_rank(recipe: recipelib.Recipe):
    result = train(recipe, return_state=True)
    assert not multiprocessing.active_children(), "a process of the run outlived it (an async save's writer?)"
    return result.records, {**result.state_dict, **{f"optim.{k}": v for k, v in result.optim_state.items()}}


def _run(layout: str, out: Path, *extra: str, timeout: float = 300, recipe: str = "llama_debug.toml"):
    """Train ``layout`` with ``extra`` overrides: (records of rank 0, the whole gathered state)."""
    world, args = LAYOUTS[layout]
    recipe = load_recipe(recipe, out, *args, *extra)
    if world == 1:
        return _on_rank(recipe)
    results = run_distributed(_on_rank, world, recipe, timeout=timeout, init_process_group=False)
    return results[0][0], merged_state(results)


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    assert want, "no state to compare"
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs after the round trip"


# --- 1. exact resume --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_resume_is_bit_identical_to_a_straight_run(mode, tmp_path, data_cache):
    """2 ranks, FSDP: 6 straight steps (saving asynchronously, on a thread or from a writer process,
    at 3 and 6, keeping 2) vs resuming the step-3 checkpoint for steps 4-6: identical losses,
    parameters and AdamW state."""
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    records, state = _run("dp2", straight_dir, "--train.steps=6", "--checkpoint.every=3",
                          f"--checkpoint.async={mode}", "--checkpoint.keep=2")
    saved = ckpt.list_checkpoints(straight_dir / "checkpoints")
    assert [(step, done) for step, _, done in saved] == [(3, True), (6, True)]
    info = json.loads((straight_dir / "checkpoints" / "step_3" / "meshpar.json").read_text())
    assert (info["step"], info["world_size"], info["layout"]["dp_shard"], info["family"]) == (3, 2, 2, "llama")
    assert recipelib.load(straight_dir / "checkpoints" / "step_3" / "recipe.toml").checkpoint.every == 3

    resumed, resumed_state = _run("dp2", resumed_dir, "--train.steps=6",
                                  f"--checkpoint.load_from={straight_dir / 'checkpoints' / 'step_3'}")
    assert [r["step"] for r in resumed if "loss" in r] == [4, 5, 6]
    assert train_losses(resumed) == train_losses(records)[3:]  # bit for bit
    assert [r["lr"] for r in resumed if "lr" in r] == [r["lr"] for r in records if "lr" in r][3:]
    _assert_same_state(resumed_state, state)


def test_keep_and_automatic_resume(tmp_path, data_cache, capfd):
    out = tmp_path / "run"
    first, _ = _run("1 rank", out, "--train.steps=4", "--checkpoint.every=1", "--checkpoint.keep=2")
    assert [s for s, _, done in ckpt.list_checkpoints(out / "checkpoints") if done] == [3, 4]
    # the same run again with more steps: resumes from the newest and says so
    again, _ = _run("1 rank", out, "--train.steps=6", "--checkpoint.every=1", "--checkpoint.keep=2")
    assert f"checkpoint: resumed from {out / 'checkpoints' / 'step_4'} at step 4" in capfd.readouterr().out
    assert [r["step"] for r in again if "loss" in r] == [5, 6]
    assert [s for s, _, done in ckpt.list_checkpoints(out / "checkpoints") if done] == [5, 6]


# --- 2. reshard on load -------------------------------------------------------------------------------
@pytest.mark.parametrize(("source", "target", "recipe"), [
    ("dp4", "dp2xtp2", "llama_debug.toml"),
    ("pp2xdp2xtp2", "1 rank", "llama_debug.toml"),
    ("hybrid2x2", "pp2xdp2xtp2", "llama_debug.toml"),
    ("1 rank", "hybrid2x2", "llama_debug.toml"),
    ("dp2", "1 rank", "gpt2_debug.toml"),  # tied wte / lm_head: one tensor under two names
    ("rep2xtp2", "dp2", "gpt2_debug.toml"),  # fused q|k|v: three blocks per tp rank ([Note: strided ...])
    ("1 rank", "rep2xtp2", "gpt2_debug.toml"),
], ids=["dp4-to-dp2xtp2", "3d-to-1rank", "hybrid-to-3d", "1rank-to-hybrid", "gpt2-dp2-to-1rank",
        "gpt2-rep2xtp2-to-dp2", "gpt2-1rank-to-rep2xtp2"])
def test_reshard_on_load(source, target, recipe, tmp_path, data_cache):
    """A checkpoint saved on ``source`` loads on ``target``: every parameter and every AdamW
    tensor, gathered to full size, is bit-identical to what ``source`` held when it saved."""
    _, saved = _run(source, tmp_path / "src", "--train.steps=2", "--checkpoint.every=2", recipe=recipe)
    path = tmp_path / "src" / "checkpoints" / "step_2"
    records, loaded = _run(target, tmp_path / "dst", "--train.steps=2", f"--checkpoint.load_from={path}",
                           recipe=recipe)
    assert train_losses(records) == []  # loaded at step 2 of 2: nothing left to train
    _assert_same_state(loaded, saved)


@pytest.mark.parametrize(("target", "layout"), [("dp2xtp2", {"dp_shard": 2, "tp": 2}),
                                               ("cp2xdp2", {"dp_shard": 2, "cp": 2})])
def test_rechunked_by_convert_loads_on_its_layout(target, layout, tmp_path, data_cache):
    """One rank's checkpoint re-chunked offline for ``layout`` (meshpar convert --to dcp --layout)
    loads on that layout bit-identically, optimizer state included. Under cp (FSDP over dp_shard x
    cp) its chunks are also the ones a run at that layout saves, each in the same rank's file."""
    from meshpar.convert import MetadataIndex, convert, open_checkpoint

    _, saved = _run("1 rank", tmp_path / "src", "--train.steps=2", "--checkpoint.every=2")
    convert(tmp_path / "src" / "checkpoints" / "step_2", tmp_path / "rechunked", "dcp",
            layout=layout, progress=False, model_only=False)
    assert sorted(p.name for p in (tmp_path / "rechunked").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    records, loaded = _run(target, tmp_path / "dst", "--train.steps=2",
                           f"--checkpoint.load_from={tmp_path / 'rechunked'}")
    assert train_losses(records) == []
    _assert_same_state(loaded, saved)
    if "cp" in layout:
        _run(target, tmp_path / "native", "--train.steps=2", "--checkpoint.every=2")

        def files(path):  # {(tensor, chunk offsets, sizes): the rank whose file __<rank>_<i>.distcp holds it}
            ck = open_checkpoint(path)
            where = ck.metadata.storage_data
            return {(k, c.offsets, c.sizes): where[MetadataIndex(k, c.offsets)].relative_path.split("_")[2]
                    for k in ck.tensors if k.startswith(("model.", "optim.")) and ck.tensors[k][0].numel() > 1
                    for c in ck.chunks(k)}

        native = files(tmp_path / "native" / "checkpoints" / "step_2")
        assert len(native) > 100 and files(tmp_path / "rechunked") == native


@pytest.mark.parity
def test_data_position_reshards_from_dp4_to_dp2(tmp_path, data_cache):
    """Steps 3-4 resumed on 2 ranks from a 4-rank checkpoint see the same samples as the 4-rank run
    did: the same losses (to the cross-layout parity tolerance), so none skipped or repeated."""
    straight, _ = _run("dp4", tmp_path / "dp4", "--train.steps=4", "--checkpoint.every=2")
    path = tmp_path / "dp4" / "checkpoints" / "step_2"
    resumed, _ = _run("dp2", tmp_path / "dp2", "--train.steps=4", f"--checkpoint.load_from={path}")
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4]
    # float32 (meshpar train's checkpoints), so derived: both runs start step 3 from the same
    # bits, and dp4 and dp2 add the same fp32 terms in other orders, ~1e-7 relative on a loss;
    # step 4 follows one AdamW update, whose noise reaches ~lr only on elements with near-zero
    # gradient, which hardly move the loss. rtol 1e-5 is 100x the summation noise, while a
    # skipped or repeated sample changes the loss by >1e-3 (asserted below).
    torch.testing.assert_close(train_losses(resumed), train_losses(straight)[2:], rtol=1e-5, atol=0)
    # and a different data order would not be close: the first two losses of a fresh run differ
    assert abs(train_losses(straight)[0] - train_losses(resumed)[0]) > 1e-3


# --- 3. a crash mid-save leaves the previous checkpoint --------------------------------------------------
class _DyingWriter(ckpt._Writer):
    """Rank 1's writer of step 4 leaves half a file and is killed: the trainer itself under
    ``async = "thread"``, the writer process under ``"process"`` (which imports this class by name:
    [Note: a save in another process] in meshpar/checkpoint/background.py)."""

    def write_data(self, plan, planner):
        if self.rank == 1 and ".step_4." in str(self.path):
            Path(self.path, "__1_0.distcp").write_bytes(b"half a file")  # some bytes reach the disk...
            os._exit(9)  # ...and the process is killed
        return super().write_data(plan, planner)


def _crash_rank1_while_writing_step_4(recipe: recipelib.Recipe):
    checkpointer_module._Writer = _DyingWriter
    return train(recipe).records


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_kill_during_async_save_resumes_from_the_previous_checkpoint(mode, tmp_path, data_cache):
    out = tmp_path / "run"
    recipe = load_recipe("llama_debug.toml", out, *LAYOUTS["dp2"][1], "--train.steps=6", "--checkpoint.every=2",
                         f"--checkpoint.async={mode}")
    # thread: rank 1 dies, rank 0 fails or is stopped; process: both ranks' next wait() raises
    with pytest.raises(AssertionError, match="ranks failed|never reported"):
        run_distributed(_crash_rank1_while_writing_step_4, 2, recipe, timeout=120, init_process_group=False)
    root = out / "checkpoints"
    assert [(s, done) for s, _, done in ckpt.list_checkpoints(root)] == [(2, True)]
    assert ckpt.latest(root) == root / "step_2"
    crashed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    resumed = run_distributed(_on_rank, 2, recipe, timeout=300, init_process_group=False)[0][0]
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4, 5, 6]
    logged = {r["step"]: r["loss"] for r in crashed if "loss" in r}
    assert [r["loss"] for r in resumed if r["step"] in (3, 4)] == [logged[3], logged[4]]
    assert not list(root.glob(".step_*.partial"))  # the crashed save's folder was cleared
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5, 6]  # one run's log, nothing twice
    assert [s for s, _, done in ckpt.list_checkpoints(root) if done] == [2, 4, 6]


# --- 4. damaged and mismatched checkpoints ---------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_one_rank(tmp_path_factory, data_cache) -> Path:
    out = tmp_path_factory.mktemp("one-rank")
    _run("1 rank", out, "--train.steps=2", "--checkpoint.every=2")
    return out / "checkpoints" / "step_2"


def _copy(path: Path, dest: Path) -> Path:
    shutil.copytree(path, dest)
    return dest


def _load_into(path: Path, out: Path, *extra: str):
    return _run("1 rank", out, "--train.steps=2", f"--checkpoint.load_from={path}", *extra)


def _chunk_of(path: Path, fqn: str) -> tuple[str, int, int]:
    """(file, offset, length) of ``fqn``'s chunk in a one-rank checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return info.relative_path, info.offset, info.length
    raise AssertionError(f"no chunk of {fqn}")


def test_corrupted_byte_names_file_and_tensor(saved_one_rank, tmp_path):
    path = _copy(saved_one_rank, tmp_path / "step_2")
    fqn = "model.layers.0.attention.wq.weight"
    file, offset, length = _chunk_of(path, fqn)
    data = bytearray((path / file).read_bytes())
    data[offset + length // 2] ^= 0x40
    (path / file).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"file {re.escape(file)} \(tensor {re.escape(fqn)}\) is corrupted"):
        _load_into(path, tmp_path / "out")


def test_truncated_file_names_file(saved_one_rank, tmp_path):
    path = _copy(saved_one_rank, tmp_path / "step_2")
    name, _, _ = _chunk_of(path, "model.layers.0.attention.wq.weight")
    file = path / name
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"file {re.escape(name)} \(tensor .*\) is truncated: it has "
                                              rf"{size // 2} bytes"):
        _load_into(path, tmp_path / "out")


def test_another_model_is_refused(saved_one_rank, tmp_path):
    with pytest.raises(CheckpointError, match=r"is of another model \(model_args: n_layers = 2 there, 3 here\)"):
        _load_into(saved_one_rank, tmp_path / "out", "--model.n_layers=3")
    # a record that claims the new shape: the tensor check still names what is missing
    path = _copy(saved_one_rank, tmp_path / "step_2")
    info = json.loads((path / "meshpar.json").read_text())
    info["model_args"]["n_layers"] = 3
    (path / "meshpar.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match=r"has no tensor model\.layers\.2\.\S+; it is from another model"):
        _load_into(path, tmp_path / "out2", "--model.n_layers=3")


def test_incomplete_checkpoint_is_never_picked(saved_one_rank, tmp_path):
    root = tmp_path / "checkpoints"
    _copy(saved_one_rank, root / "step_2")
    partial = _copy(saved_one_rank, root / "step_4")
    (partial / "meshpar.json").unlink()  # its save never finished
    assert ckpt.latest(root) == root / "step_2"
    with pytest.raises(CheckpointError, match=r"step_4 is incomplete \(no meshpar\.json\)"):
        ckpt.read_info(partial)


# --- 5. starting from Hugging Face weights ------------------------------------------------------------
@pytest.mark.parity
def test_training_starts_from_a_hugging_face_folder(tmp_path, data_cache, capfd):
    """Train 10 steps, export the checkpoint to Hugging Face safetensors, start new runs from the
    folder (checkpoint.hf_weights) on one rank and on 2 FSDP ranks: both begin from the trained
    weights (their first loss is far below a fresh model's) and agree with each other."""
    from meshpar.convert import convert

    first, _ = _run("1 rank", tmp_path / "a", "--train.steps=10", "--checkpoint.every=10")
    convert(tmp_path / "a" / "checkpoints" / "step_10", tmp_path / "hf", "hf", progress=False)
    one, _ = _run("1 rank", tmp_path / "b", "--train.steps=1", f"--checkpoint.hf_weights={tmp_path / 'hf'}")
    assert f"initialized from Hugging Face weights in {tmp_path / 'hf'}" in capfd.readouterr().out
    two, _ = _run("dp2", tmp_path / "c", "--train.steps=1", f"--checkpoint.hf_weights={tmp_path / 'hf'}")
    assert train_losses(one)[0] < train_losses(first)[0] - 0.5, (train_losses(one), train_losses(first))
    # one forward from the same float32 weights on 1 and 2 ranks: only summation order differs,
    # ~1e-7 relative on the mean loss, so rtol 1e-5 leaves 100x
    torch.testing.assert_close(train_losses(two), train_losses(one), rtol=1e-5, atol=0)


def test_exclude_leaves_state_unloaded(saved_one_rank, tmp_path, capfd):
    """checkpoint.exclude: the weights load, the excluded optimizer state does not (AdamW
    starts afresh), and the run says what it did not load."""
    _, full = _load_into(saved_one_rank, tmp_path / "all")
    records, partial = _load_into(saved_one_rank, tmp_path / "some", '--checkpoint.exclude=["optimizer", "data"]')
    assert "not loaded: data, optimizer" in capfd.readouterr().out
    assert train_losses(records) == []
    assert not [k for k in partial if k.startswith("optim.")]  # no AdamW state: nothing loaded into it
    _assert_same_state(partial, {k: v for k, v in full.items() if not k.startswith("optim.")})
