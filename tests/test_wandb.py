"""``metrics.wandb``: the Weights & Biases sink (meshpar/training/wandb_sink.py), offline, read back
from the run's own file; and its absence refused before launch, naming the extra."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from meshpar.config.recipe import RecipeError
from meshpar.train import train
from tests.helpers import load_recipe, train_losses

OFFLINE = ["--metrics.wandb=true", '--metrics.wandb_mode="offline"', '--metrics.wandb_project="meshpar-test"']


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (W&B's own format: a 7-byte header, then LevelDB's
    log format, 32 KiB blocks of records each with a 7-byte header: CRC, length, type full / first /
    middle / last), parsed with W&B's own message classes."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if len(chunk) < length:  # the record the writer is still writing
            return
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind in (3, 4):  # middle, last
            pending += chunk
        else:
            continue
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_run(path: Path, wait_s: float = 60) -> tuple[dict[int, dict], dict, object]:
    """(history by step, config, the run record) of an offline run's ``.wandb`` file, once it is whole.

    ``run.finish()`` returns when W&B's service process has taken the run's last record, not when
    that process has written its file: under load the test can read the file first. So this reads
    until the file ends with the run's ``exit`` record, waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        records = list(wandb_records(path))
        kinds = [r.WhichOneof("record_type") for r in records]
        if kinds and kinds[-1] == "exit":
            break
        assert time.monotonic() < deadline, f"{path} holds no exit record after {wait_s} s: {kinds}"
        time.sleep(0.2)
    history, config, run = {}, {}, None
    for r, kind in zip(records, kinds, strict=True):
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
        elif kind in ("config", "run"):  # the run's record carries the config given to wandb.init
            updates = r.config.update if kind == "config" else r.run.config.update
            config.update({i.key: json.loads(i.value_json) for i in updates})
            run = r.run if kind == "run" else run
    assert run is not None, f"{path} holds no run record: {kinds}"
    return history, config, run


@pytest.mark.multirank  # wandb starts its service process (wandb-core)
@pytest.mark.timeout(120)
def test_offline_run_holds_every_logged_step_and_the_recipe(tmp_path, data_cache):
    records = train(load_recipe("llama_debug.toml", tmp_path, "--train.steps=3", *OFFLINE)).records
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    history, config, run = read_run(runs[0])
    assert run.run_id == (tmp_path / "wandb_run_id").read_text().strip() and run.project == "meshpar-test"
    assert run.display_name == tmp_path.name
    assert sorted(history) == [1, 2, 3]
    torch.testing.assert_close([history[s]["train/loss"] for s in (1, 2, 3)], train_losses(records), rtol=0, atol=0)
    assert {"train/grad_norm", "train/lr", "train/tokens_per_s", "train/mfu"} <= set(history[3])
    assert config["train"]["steps"] == 3 and config["model"]["family"] == "llama"


def test_missing_wandb_is_refused_naming_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError, match=r"pip install 'meshpar\[wandb\]'"):
        load_recipe("llama_debug.toml", tmp_path, *OFFLINE)


@pytest.mark.multirank  # wandb starts its service process (wandb-core)
@pytest.mark.timeout(180)
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, data_cache):
    """[Note: one W&B run per training run]: a run stopped at its checkpoint and resumed in the same
    output_dir reopens the W&B run of the first, and logs the steps after the checkpoint to it."""
    train(load_recipe("llama_debug.toml", tmp_path, "--train.steps=2", "--checkpoint.every=2", *OFFLINE))
    resumed = train(load_recipe("llama_debug.toml", tmp_path, "--train.steps=3", "--checkpoint.every=2", *OFFLINE))
    assert [r["step"] for r in resumed.records if "loss" in r] == [3]  # it did resume
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2, runs
    (first, _, a), (second, _, b) = (read_run(r) for r in runs)
    assert a.run_id == b.run_id == (tmp_path / "wandb_run_id").read_text().strip()
    assert sorted(first) == [1, 2] and sorted(second) == [3]
