"""Replica groups under torchft (``fault.replicas = "torchft"``): each group its own job, a
lighthouse in this process, gloo ranks.

- Two groups of 2 ranks (dp_shard 2 each, dp_replicate 2 over torchft) train as one process
  does, in float64 to 1e-9 (tests/parity.py [Note: parity in float64]), and end bit-identical
  to each other: the quorum's average replaces HSDP's replica all-reduce.
- One group's rank SIGKILLed mid-run (``meshpar train`` as users launch it): the other group
  trains every step once without stopping (alone while the first restarts, when the lighthouse
  has dropped it by then); the restarted
  group receives the live group's state, rejoins, and both end with identical parameters and
  optimizer state, bit for bit (the healed state is a copy and every later step is the same
  arithmetic on both).
- The lighthouse killed mid-run: each group, once its quorum wait has passed, saves its last
  committed step and exits 75 with an error naming the lighthouse; with a lighthouse again the
  same commands resume both and they finish together.
- Recipe errors before any process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.config.recipe import RecipeError
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, load_recipe, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64, must_fail
from tests.processes import finish_run, metrics_records, rank_pid, start_run, wait_for_step

torchft = pytest.importorskip("torchft", reason="fault.replicas = \"torchft\" needs the ft extra")

GROUPS = ("--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--fault.replicas=torchft")


@contextlib.contextmanager
def lighthouse() -> Iterator[str]:
    """A lighthouse in this process (as `meshpar lighthouse` serves one); its address."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=2000)
    try:
        yield server.address()
    finally:
        server.shutdown()


# --- recipe checks (one process, no torchft server) ------------------------------------------------------
def test_recipe_errors_name_the_key_and_the_fix(tmp_path):
    def load(*extra: str) -> recipelib.Recipe:
        return recipelib.load(ROOT / "recipes" / "llama_debug_fsdp.toml", [*SMALL, f"--train.output_dir={tmp_path}",
                                                                           *extra])

    with pytest.raises(RecipeError, match=r"fault.replica_id = 2: .* numbered 0 to 1"):
        load(*GROUPS, "--fault.lighthouse=localhost:1", "--fault.replica_id=2")
    with pytest.raises(RecipeError, match=r"fault.min_replicas = 3 .* use 1 to 2"):
        load(*GROUPS, "--fault.lighthouse=localhost:1", "--fault.min_replicas=3")
    with pytest.raises(RecipeError, match=r"model.aux_free_bias with fault.replicas = \"torchft\" is not built"):
        load(*GROUPS, "--fault.lighthouse=localhost:1", "--model.aux_free_bias=true")
    with pytest.raises(RecipeError, match=r"fault.replica_id is read only by fault.replicas"):
        load("--fault.replica_id=1")
    for timeout in ("0", "10"):  # unset (a backend's default), or not under half the quorum wait
        with pytest.raises(RecipeError, match=r"fault.quorum_timeout = 20 must exceed 2 x fault.timeout, set expl"):
            load(*GROUPS, "--fault.lighthouse=localhost:1", "--fault.quorum_timeout=20", f"--fault.timeout={timeout}")
    assert load(*GROUPS, "--fault.lighthouse=localhost:1", "--fault.quorum_timeout=20",
                "--fault.timeout=9").fault.quorum_timeout == 20
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIGHTHOUSE"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", env)
        with pytest.raises(RecipeError, match=r"needs a lighthouse: start `meshpar lighthouse`"):
            load(*GROUPS)


def test_each_group_writes_its_own_folder_and_reads_its_slice(tmp_path):
    from meshpar.config.keys import replica_jobs
    from meshpar.runtime import replicas

    recipe = recipelib.load(ROOT / "recipes" / "llama_debug_fsdp.toml",
                            [*SMALL, *GROUPS, f"--train.output_dir={tmp_path}", "--fault.lighthouse=localhost:1",
                             "--fault.replica_id=1", f"--checkpoint.dir={tmp_path / 'ckpt'}"])
    group = replicas.group_recipe(recipe)
    assert group.train.output_dir == str(tmp_path / "replica_1")
    assert group.checkpoint.dir == str(tmp_path / "ckpt" / "replica_1")
    assert replica_jobs(recipe) == 2 and replica_jobs(recipelib.load(None, [])) == 1
    # a group back after the others finished finds their marker and trains nothing
    assert replicas.finished_elsewhere(group) is None
    other = dataclasses.replace(group.train, output_dir=str(tmp_path / "replica_0"))
    (tmp_path / "replica_0").mkdir()  # the group's run made it
    replicas.mark_finished(dataclasses.replace(group, train=other), group.train.steps - 1)
    assert replicas.finished_elsewhere(group) is None  # short of the last step: not done
    replicas.mark_finished(dataclasses.replace(group, train=other), group.train.steps)
    assert replicas.finished_elsewhere(group) == tmp_path / "replica_0"


# --- two groups against one process, float64 -------------------------------------------------------------
def _groups_run(tmp_path: Path, steps: int) -> list[list[tuple[list[dict], dict[str, torch.Tensor]]]]:
    """Both groups of 2 ranks, each its own spawned job, side by side: each rank's (records, state)."""
    with lighthouse() as address:
        recipes = [load_recipe("llama_debug_fsdp.toml", tmp_path, *GROUPS, f"--fault.lighthouse={address}",
                               f"--fault.replica_id={g}", f"--train.steps={steps}") for g in (0, 1)]
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(run_distributed, in_float64, 2, train_on_rank, r, init_process_group=False,
                                timeout=240) for r in recipes]
            return [job.result() for job in jobs]


def _assert_parity(records: list[dict], state: dict[str, torch.Tensor], reference) -> None:
    torch.testing.assert_close(train_losses(records), train_losses(reference.records), rtol=TOL, atol=TOL)
    norms = [[r["grad_norm"] for r in rs if "grad_norm" in r] for rs in (records, reference.records)]
    torch.testing.assert_close(norms[0], norms[1], rtol=TOL, atol=TOL)
    assert state.keys() == reference.state_dict.keys()
    for name, ref in reference.state_dict.items():
        assert ref.dtype == torch.float64, name
        torch.testing.assert_close(state[name], ref, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.multirank
@pytest.mark.parity
@pytest.mark.timeout(300)
def test_two_groups_train_as_one_process(tmp_path, data_cache):
    steps = 4
    groups = _groups_run(tmp_path / "groups", steps)
    with default_dtype():
        reference = train(load_recipe("llama_debug.toml", tmp_path / "ref", f"--train.steps={steps}"),
                          return_state=True)
    (records, state), (other_records, other_state) = groups[0][0], groups[1][0]
    assert [r["replica_groups"] for r in records] == [2] * steps, records  # every step had both groups
    _assert_parity(records, state, reference)
    same = ("step", "loss", "grad_norm", "lr", "replica_groups")  # the quorum's mean loss, one norm, on both
    assert [{k: r[k] for k in same} for r in records] == [{k: r[k] for k in same} for r in other_records]
    for name, value in state.items():
        assert torch.equal(value, other_state[name]), name
    bent = {k: v * (1 + 1e-7) if k == "norm.weight" else v for k, v in state.items()}
    must_fail(lambda: _assert_parity(records, bent, reference), "one parameter off by 1e-7")


# --- a group killed mid-run heals from the other, which never stops -------------------------------------------
STEPS = 60


def _final_state(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The group's checkpoint at the last step, every entry (weights, AdamW state, schedule, data)."""
    from meshpar.convert import convert

    dst = tmp / f"{out.name}.pt"
    convert(out / "checkpoints" / f"step_{STEPS}", dst, "torch", progress=False, model_only=False)
    return torch.load(dst, weights_only=True)


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_a_killed_group_heals_while_the_other_trains(tmp_path, data_cache):
    out = tmp_path / "run"
    rng = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "") + str(time.time_ns()))
    kill_at, victim = rng.randint(4, 10), rng.randint(0, 1)
    common = (*GROUPS, f"--train.steps={STEPS}", f"--checkpoint.every={STEPS}")
    with lighthouse() as address:
        live = start_run(out, *common, f"--fault.lighthouse={address}", "--fault.replica_id=0")
        dying = start_run(out, *common, f"--fault.lighthouse={address}", "--fault.replica_id=1", "--max-restarts=1")
        try:
            wait_for_step(dying, out / "replica_1", kill_at, timeout=240)
            os.kill(rank_pid(dying.pid, victim), signal.SIGKILL)
        finally:  # whatever happened above, both runs end (finish_run kills them past its timeout)
            live_code, live_output = finish_run(live, timeout=300)
            dying_code, dying_output = finish_run(dying, timeout=120)
    assert live_code == 0, live_output[-3000:]
    assert dying_code == 0, dying_output[-3000:]
    assert f"rank {victim} (pid" in dying_output and "signal SIGKILL" in dying_output, dying_output[-3000:]

    survivor = metrics_records(out / "replica_0")
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1)), "the live group redid or skipped a step"
    assert not any("healed" in r or "skipped" in r for r in survivor), survivor
    # steps alone while the killed group restarts: none when its restart came back before the
    # lighthouse's heartbeat timeout dropped it from the quorum (it then heals at once)
    alone = [r["step"] for r in survivor if r["replica_groups"] == 1]
    assert all(step > kill_at for step in alone), (alone, kill_at)
    assert survivor[-1]["replica_groups"] == 2, "the killed group never rejoined"

    healed = metrics_records(out / "replica_1")
    heal = next(r for r in healed if "healed" in r)
    assert heal["step"] >= max(alone, default=kill_at), (heal, alone)  # the state the live group had reached
    after = [r for r in healed if r["step"] > heal["step"]]
    assert [r["step"] for r in after] == list(range(heal["step"] + 1, STEPS + 1))
    assert after == [r for r in survivor if r["step"] > heal["step"]]  # the same loss and norm, step by step

    ours, theirs = _final_state(out / "replica_0", tmp_path), _final_state(out / "replica_1", tmp_path)
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]) if isinstance(value, torch.Tensor) else value == theirs[name], name


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_a_lost_lighthouse_stops_each_group_with_a_checkpoint_and_the_same_commands_resume(tmp_path, data_cache):
    out, steps = tmp_path / "run", 12
    common = (*GROUPS, f"--train.steps={steps}", f"--checkpoint.every={steps}", "--fault.timeout=5",
              "--fault.quorum_timeout=20")

    def both(address: str) -> list:
        return [start_run(out, *common, f"--fault.lighthouse={address}", f"--fault.replica_id={g}") for g in (0, 1)]

    with lighthouse() as address:
        runs = both(address)
        try:
            wait_for_step(runs[0], out / "replica_0", 3, timeout=240)
        except BaseException:
            for p in runs:
                finish_run(p, timeout=1)
            raise
    ends = [finish_run(p, timeout=240) for p in runs]  # each waits out its quorum (fault.quorum_timeout) first
    stopped = []
    for g, (code, output) in enumerate(ends):
        assert code == 75, output[-3000:]
        assert "no quorum from the lighthouse at" in output, output[-3000:]
        found = re.search(r"stopped after step (\d+): checkpoint", output)
        assert found, output[-3000:]
        stopped.append(int(found.group(1)))
        assert (out / f"replica_{g}" / "checkpoints" / f"step_{stopped[-1]}" / "meshpar.json").is_file()
    assert stopped[0] == stopped[1] >= 3, stopped  # both had committed the same steps
    with lighthouse() as address:
        runs = both(address)
        ends = [finish_run(p, timeout=300) for p in runs]
    for code, output in ends:
        assert code == 0 and f"resumed from {out}" in output, output[-3000:]
    groups = [metrics_records(out / f"replica_{g}") for g in (0, 1)]
    assert [r["step"] for r in groups[0]] == list(range(1, steps + 1)), groups[0]
    assert groups[0] == groups[1]
