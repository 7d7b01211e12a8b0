"""Checkpoint storage faults: an unwritable or full folder, a save that fails midway, ``keep``
beside a resumed run, and checkpoints made to run code when loaded.

Every run is ``meshpar train`` on the small byte-level debug Llama (tests/helpers.py's SMALL):
one rank in this process (so tests can patch the file system calls), two spawned ranks where
the fault is one rank's.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshpar import checkpoint as ckpt
from meshpar.checkpoint import CheckpointError
from meshpar.checkpoint import checkpointer as checkpointer_module
from meshpar.checkpoint import publish as publish_module
from meshpar.convert import ConvertError
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import load_recipe, train_losses


def _recipe(out: Path, *extra: str):
    return load_recipe("llama_debug.toml", out, *extra)


def _logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def _steps(root: Path) -> list[int]:
    return [s for s, _, done in ckpt.list_checkpoints(root) if done]


# --- 1. the folder is probed before the first step ---------------------------------------------------------
def _refuse_probe(monkeypatch, how):
    """Make opening this run's probe file fail ``how`` ("denied": EACCES; "full": a file on which
    every write is ENOSPC, /dev/full); every other os.open is untouched."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if Path(path).name.startswith(".write_probe"):
            if how == "denied":
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("fault", ["not a folder", "read-only", "full"])
def test_unwritable_dir_is_an_error_before_the_first_step(fault, tmp_path, data_cache, monkeypatch):
    out, root = tmp_path / "run", tmp_path / "ckpts"
    reason = {"not a folder": "Not a directory", "read-only": "Permission denied",
              "full": "No space left on device"}[fault]
    if fault == "not a folder":
        (tmp_path / "file").write_text("a file, not a folder")
        root = tmp_path / "file" / "ckpts"
    elif fault == "read-only" and os.geteuid() != 0:
        root.mkdir()
        root.chmod(0o500)
    else:  # as root, chmod stops no write: make the probe's own open (or write) fail instead
        _refuse_probe(monkeypatch, "denied" if fault == "read-only" else "full")
    try:
        with pytest.raises(CheckpointError) as raised:
            train(_recipe(out, "--train.steps=2", "--checkpoint.every=1", f"--checkpoint.dir={root}"))
    finally:
        if root.exists():
            root.chmod(0o700)
    message = str(raised.value)
    assert f"checkpoint.dir {root} is not writable on rank 0: {reason}" in message, message
    assert "set checkpoint.dir to a writable folder" in message and "\n" not in message
    assert _logged_steps(out) == []  # refused before any step
    assert not (root.exists() and list(root.iterdir()))  # no probe file left behind


# --- 2. a save that fails midway -------------------------------------------------------------------------
def _disk_full_on_rank1_at_step_4(recipe):
    """Rank 1's writes of step 4 hit a full disk after some bytes: (the error, the folder after it)."""
    original = ckpt._Writer.write_data

    def write_data(self, plan, planner):
        if dist.get_rank() == 1 and ".step_4." in str(self.path):
            Path(self.path).mkdir(parents=True, exist_ok=True)
            Path(self.path, "__1_0.distcp").write_bytes(b"the first bytes")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(self.path, "__1_0.distcp")))
        return original(self, plan, planner)

    ckpt._Writer.write_data = write_data
    try:
        train(recipe)
    except CheckpointError as e:
        error = str(e)
    else:
        error = None
    root = Path(recipe.train.output_dir) / "checkpoints"
    return error, ckpt.list_checkpoints(root), sorted(p.name for p in root.iterdir())



def test_disk_full_mid_save_fails_every_rank_and_keeps_the_previous(tmp_path, data_cache):
    """2 FSDP ranks, saving every 2 steps; rank 1's disk fills while writing step 4: both ranks
    raise a CheckpointError naming the step, the folder and the cause; no step_4 and no
    .partial is left, step_2 stays the newest, and a run from it (on one rank, in this process:
    a second spawned job would double the test's time) trains steps 3 and 4 as the first did."""
    out = tmp_path / "run"
    recipe = _recipe(out, "--parallel.dp_shard=2", "--train.steps=4", "--checkpoint.every=2")
    results = run_distributed(_disk_full_on_rank1_at_step_4, 2, recipe, timeout=120, init_process_group=False)
    root = out / "checkpoints"
    for rank, (error, _, _) in enumerate(results):
        assert error is not None, f"rank {rank}: the failed save raised no CheckpointError"
        assert f"saving step 4 into {root} failed (rank 1: OSError: [Errno 28] No space left on device" in error
        assert f"the newest complete checkpoint, {root / 'step_2'}, is untouched" in error
    _, found, names = results[0]  # as rank 0 left the folder
    assert [(s, done) for s, _, done in found] == [(2, True)]
    assert names == ["step_2"], names  # the failed save's .partial is gone
    crashed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    resumed = train(_recipe(out, "--train.steps=4", "--checkpoint.every=2")).records
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4]  # resumed from step_2...
    logged = {r["step"]: r["loss"] for r in crashed if "loss" in r}
    # ...with its state: float32, 2 ranks then 1, so the same sums in another order, ~1e-7
    # relative on a loss (tests/test_checkpoint.py's dp4 -> dp2 derives it); rtol 1e-5 leaves
    # 100x, while a fresh start (5.53 at step 1 against 4.16 at step 3) misses by far
    torch.testing.assert_close(train_losses(resumed), [logged[3], logged[4]], rtol=1e-5, atol=0)
    assert _steps(root) == [2, 4]


class _FullDiskWriter(ckpt._Writer):
    """Every write of step 2 finds the disk full. A class of its own, put in place of ``_Writer``: DCP's
    writer process imports it by name ([Note: a save in another process] in meshpar/checkpoint/background.py)."""

    def write_data(self, plan, planner):
        if ".step_2." in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write_data(plan, planner)


@pytest.mark.parametrize("where", ["sync, writing meshpar.json", "thread, writing a shard",
                                   "process, writing a shard"])
def test_failed_save_leaves_the_previous_checkpoint_latest(where, tmp_path, data_cache, monkeypatch):
    """One rank, saving every step; the save of step 2 fails with a full disk (its marker under
    a synchronous save, its shard file under an async one, on a thread or in the writer process).
    The run stops with a CheckpointError naming step 2 (the async one at its next wait), step_1
    stays the newest and loads."""
    out = tmp_path / "run"
    mode = where.split(",")[0]
    extra = ["--train.steps=3", "--checkpoint.every=1"] + ([f"--checkpoint.async={mode}"] if mode != "sync" else [])
    if mode == "sync":
        original_write = publish_module.write_atomic

        def write_atomic(path, data):
            if ".step_2." in str(path) and path.name == ckpt.MARKER:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return original_write(path, data)

        monkeypatch.setattr(publish_module, "write_atomic", write_atomic)
    else:
        monkeypatch.setattr(checkpointer_module, "_Writer", _FullDiskWriter)
    with pytest.raises(CheckpointError, match=rf"saving step 2 into {out / 'checkpoints'} failed \(rank 0: OSError: "
                                              rf"\[Errno 28\] No space left on device\).*step_1, is untouched"):
        train(_recipe(out, *extra))
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert ckpt.latest(root) == root / "step_1"
    monkeypatch.undo()
    again = extra[:2]  # only the load is checked: saved synchronously (a second writer process costs seconds)
    resumed = train(_recipe(tmp_path / "again", *again, f"--checkpoint.load_from={root}")).records
    assert [r["step"] for r in resumed if "loss" in r] == [2, 3]


# --- 3. keep never deletes what the run would resume from -------------------------------------------------
def test_keep_never_deletes_the_checkpoint_the_run_resumes_from(tmp_path, data_cache):
    """A 6-step run leaves step_2, 4, 6; a second run in the same folder starts from
    load_from = step_2 and saves steps 3-5 with keep = 2. step_2 stays (a restart would load it
    again), step_3 goes (older than the newest 2 up to 5), step_6, the first run's, stays."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    train(_recipe(out, "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=3"))
    assert _steps(root) == [2, 4, 6]
    records = train(_recipe(out, "--train.steps=5", "--checkpoint.every=1", "--checkpoint.keep=2",
                            f"--checkpoint.load_from={root / 'step_2'}")).records
    assert [r["step"] for r in records if "loss" in r] == [3, 4, 5]
    assert _steps(root) == [2, 4, 5, 6]
    assert json.loads((root / "step_4" / ckpt.MARKER).read_text())["step"] == 4


# --- 4. loading never runs code from the file --------------------------------------------------------------
class _Opens:
    """Pickles as ``open(path, "w")``: unpickling it creates ``path``, the stand-in for any code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_code_in_a_checkpoint_never_runs(tmp_path, data_cache, monkeypatch):
    """A checkpoint whose .metadata pickle, or whose pickled LR-schedule entry, would create a
    file as it loads: training, `meshpar checkpoint info` and `meshpar convert` refuse it with an
    error naming the file or the entry, and the file is never created."""
    from meshpar.convert import convert, describe

    marker = tmp_path / "code-ran"
    state_dict = ckpt.Checkpointer.state_dict

    def with_code(self, run, step):
        state = state_dict(self, run, step)
        state["lr_schedule"]["base_lrs"] = _Opens(marker)
        return state

    monkeypatch.setattr(ckpt.Checkpointer, "state_dict", with_code)
    train(_recipe(tmp_path / "made", "--train.steps=1", "--checkpoint.every=1"))
    monkeypatch.undo()
    in_entry = tmp_path / "made" / "checkpoints" / "step_1"
    in_metadata = tmp_path / "step_1"
    shutil.copytree(in_entry, in_metadata)
    with open(in_metadata / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # ours, written just now: trusted
    metadata.planner_data["x"] = _Opens(marker)
    with open(in_metadata / ".metadata", "wb") as f:
        pickle.dump(metadata, f)

    loads = {
        "train": lambda path: train(_recipe(tmp_path / "load", "--train.steps=2", f"--checkpoint.load_from={path}")),
        "info": describe,
        "convert": lambda path: convert(path, tmp_path / "hf", "hf", progress=False),
    }
    for name, load in loads.items():
        with pytest.raises((CheckpointError, ConvertError), match=r"\.metadata is not DCP metadata \(it names "
                                                                  r"io\.open, which DCP's metadata never holds\)"):
            load(in_metadata)
        assert not marker.exists(), f"{name}: loading .metadata ran code"
    with pytest.raises(CheckpointError, match=r"entry lr_schedule\.base_lrs is not plain data \(it names io\.open\)"):
        loads["train"](in_entry)
    assert not marker.exists(), "loading a pickled entry ran code"
