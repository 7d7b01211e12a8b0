"""meshpar's SLURM scripts under a real SLURM: a one-machine cluster (slurmctld, slurmd, munge and
8 stand-in GPUs, ``scripts/slurm_local.sh``) started for this file.

- ``scripts/slurm.sbatch``: a job trains on 2 ranks (torchrun), gets SIGUSR1 in its batch shell
  (what ``--signal=B:USR1@120`` sends before the time limit; here ``scancel --signal=USR1
  --batch``), every rank checkpoints and stops, the script requeues the job, SLURM runs it again,
  and it resumes: metrics.jsonl equals an uninterrupted ``meshpar train`` of the same layout bit
  for bit (timings left out).
- ``scripts/slurm_replicas.sbatch``: two replica groups under torchft as two job steps of one job,
  with the lighthouse in the batch script: both groups train every step together and end with the
  same parameters.

The cluster needs root and Debian's slurm-wlm and munge (``bash scripts/slurm_local.sh install``,
which ``.ci/run`` runs); without them the tests are skipped, saying why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port
from tests.helpers import ROOT, SMALL
from tests.processes import STEPS, finish_run, metrics_records, start_run

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
RECIPE = "recipes/llama_debug_fsdp.toml"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> dict[str, str]:
    """The environment a job is submitted with: SLURM_CONF of a cluster started here, meshpar's
    interpreter first on PATH (torchrun, python), free ports for rendezvous and lighthouse."""
    where = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SCRIPT), "start", str(where)], capture_output=True, text=True, timeout=60)
    if started.returncode != 0:
        pytest.skip(f"no one-machine SLURM here: {(started.stderr or started.stdout).strip()}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_CONF=started.stdout.strip().split("=", 1)[1], MESHPAR_RDZV_PORT=str(free_port()),
               MESHPAR_LIGHTHOUSE_PORT=str(free_port()))
    env.pop("WORLD_SIZE", None)
    yield env
    subprocess.run(["bash", str(SCRIPT), "stop", str(where)], capture_output=True, timeout=60)


def _submit(env: dict[str, str], out: Path, script: str, *args: str) -> str:
    """sbatch on 1 node with 2 stand-in GPUs (2 ranks per torchrun); the job id."""
    out.mkdir(parents=True, exist_ok=True)  # SLURM opens --output there and makes no folder
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=2", "--cpus-per-task=1", "--time=20",
           f"--output={out}/slurm-%j.out", script, RECIPE, *SMALL, f"--train.output_dir={out}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _state(env: dict[str, str], job: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\w+)", shown)
    return match.group(1) if match else "GONE"


def _wait(env: dict[str, str], job: str, until, timeout: float, log: Path) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(env, job)
        if until(state):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still {_state(env, job)} after {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else f"(no {log})"


def _done(state: str) -> bool:
    return state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE")


@pytest.mark.timeout(420)
def test_time_limit_signal_checkpoints_requeues_and_resumes_bit_for_bit(slurm, tmp_path, data_cache):
    clean = start_run(tmp_path / "clean")  # meanwhile: the same layout under meshpar train, undisturbed
    out = tmp_path / "job"
    job = _submit(slurm, out, "scripts/slurm.sbatch", f"--train.steps={STEPS}", "--checkpoint.every=10")
    log = out / f"slurm-{job}.out"
    deadline = time.monotonic() + 240
    while not any(r.get("step", 0) >= 6 for r in metrics_records(out)):
        assert time.monotonic() < deadline and not _done(_state(slurm, job)), _tail(log)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    # the script requeues the job: SLURM holds a requeued job 2 minutes, released here at once
    _wait(slurm, job, lambda s: s == "PENDING" or _done(s), 120, log)
    # slurmd refuses a job whose credential is not newer than the requeue's revocation of the old
    # one, in whole seconds ("Job credential revoked"): released within that second, it failed
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm, check=True)
    assert _wait(slurm, job, _done, 240, log) == "COMPLETED", _tail(log)

    text = log.read_text()
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+)", text)
    assert stopped and "requeueing job" in text, text[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped.group(1)}'} at step {stopped.group(1)}" in text
    assert "(restart 1)" in text, text[-3000:]  # the second run of the job is SLURM's requeue
    code, output = finish_run(clean)
    assert code == 0, output[-3000:]
    assert metrics_records(out) == metrics_records(tmp_path / "clean")


@pytest.mark.timeout(420)
def test_replica_groups_run_as_job_steps_with_a_lighthouse(slurm, tmp_path, data_cache):
    out, steps = tmp_path / "job", 8
    job = _submit(slurm, out, "scripts/slurm_replicas.sbatch", "--parallel.dp_replicate=2", f"--train.steps={steps}",
                  f"--checkpoint.every={steps}")
    log = out / f"slurm-{job}.out"
    assert _wait(slurm, job, _done, 300, log) == "COMPLETED", _tail(log)
    groups = [metrics_records(out / f"replica_{g}") for g in (0, 1)]
    assert [(r["step"], r["replica_groups"]) for r in groups[0]] == [(s, 2) for s in range(1, steps + 1)], _tail(log)
    assert groups[0] == groups[1]  # the quorum's loss and one gradient norm, step by step
    from meshpar.convert import convert

    final = []
    for g in (0, 1):
        convert(out / f"replica_{g}" / "checkpoints" / f"step_{steps}", tmp_path / f"{g}.pt", "torch", progress=False)
        final.append(torch.load(tmp_path / f"{g}.pt", weights_only=True))
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
