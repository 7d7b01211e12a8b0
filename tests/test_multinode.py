"""Two torchrun agents on this machine as two nodes of one job: one agent's numbers, and each
duty done once, where it belongs.

``recipes/llama_debug_2d.toml`` (dp_shard 2 x tp 2, 4 ranks) runs as one agent with 4 local
ranks and as two agents (``--nnodes 2 --nproc-per-node 2``) meeting at a c10d rendezvous on
localhost, as ``scripts/slurm.sbatch`` starts them on a cluster. Each agent has its own token
cache (``$MESHPAR_CACHE``, a node's local disk) and its own ``train.output_dir`` (local
disks), and both share one ``checkpoint.dir`` (a shared file system, which checkpoints need:
every rank writes its shards into the folder rank 0 then renames).

Global rank r sits at the same mesh position in both runs, and gloo talks TCP between every
pair of ranks whether they share an agent or not, so the arithmetic is the same: the logged
numbers and the checkpoint files are equal bit for bit. The c10d rendezvous ignores
``--node-rank``: it orders agents by (host, agent pid), so the test reads which agent got
ranks 0-1 from torchrun's rank-prefixed output instead of assuming it.

The SLURM script runs here too, under stand-ins for srun and scontrol. How long the file takes:
docs/performance.md#test-suite-and-set-up.
"""

import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from meshpar import data
from tests.distributed import free_port
from tests.helpers import ROOT

RECIPE = "recipes/llama_debug_2d.toml"  # dp_shard 2 x tp 2: 4 ranks, 2 per agent
STEPS = 6
# the byte tokenizer: a node's cache is built, locked and published as with BPE, without training one per node
BYTES = ["--data.tokenizer=byte", "--model.vocab_size=256"]
ARGS = [*BYTES, f"--train.steps={STEPS}", "--train.log_every=1", f"--train.eval_every={STEPS}",
        "--train.eval_batches=1", f"--checkpoint.every={STEPS}"]
TIMING = {"tokens_per_s", "mfu", "mem_gb"}  # what may differ between two runs of the same numbers
DEADLINE = 150  # seconds for one run (agents and ranks), about 6x what it takes here



def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment carries ``marker``: the agents and their ranks,
    which torchrun starts in sessions of their own (so the agents' process groups miss them)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"MESHPAR_TEST_JOB={marker}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone, or not ours to read
            continue


def _run(agents: list[dict[str, str]], nnodes: int, nproc: int, logs: Path) -> list[str]:
    """Start one ``torchrun`` agent per entry of ``agents`` (its ``cache`` and ``output_dir``),
    checkpoints in ``logs/checkpoints``; wait for all with a deadline; return their outputs. A
    failed or late agent fails the test at once; nothing is left running either way."""
    marker, port, run_id = uuid.uuid4().hex, free_port(), f"meshpar-test-{uuid.uuid4().hex[:8]}"
    procs, outputs = [], [logs / f"agent{i}.log" for i in range(len(agents))]
    try:
        for extra, out in zip(agents, outputs, strict=True):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
                   str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
                   "--tee", "3", "--log-dir", str(logs / out.stem), "-m", "meshpar.train", RECIPE, *ARGS,
                   f"--train.output_dir={extra['output_dir']}", f"--checkpoint.dir={logs / 'checkpoints'}"]
            env = dict(os.environ, OMP_NUM_THREADS="1", MESHPAR_TEST_JOB=marker, MESHPAR_CACHE=extra["cache"],
                       TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank${rank}]:")
            with open(out, "w") as f:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + DEADLINE
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            assert not failed and time.monotonic() < deadline, "\n".join(
                f"--- agent {i} (exit {p.returncode}, {'failed' if i in failed else 'running'}):\n"
                f"{outputs[i].read_text()[-3000:]}" for i, p in enumerate(procs))
            time.sleep(0.2)
        assert all(p.returncode == 0 for p in procs), [out.read_text()[-3000:] for out in outputs]
        return [out.read_text() for out in outputs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        _kill_marked(marker)
        for p in procs:
            p.wait(timeout=10)


def _records(output_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in lines]


def _built_by(cache: Path) -> dict:
    """Who built the cache's one entry (meta.json's host, pid, rank, local_rank)."""
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2 and entries[1] == entries[0] + ".lock", entries  # one entry, its lock, no .tmp
    return json.loads((cache / entries[0] / "meta.json").read_text())["built_by"]


def _checkpoint(step_dir: Path) -> dict[str, object]:
    """The checkpoint's shard files (hashed) and each rank's CRC list (a dict: its key order is the
    write threads'). Not .metadata and meshpar.json, which hold paths and times."""
    files: dict[str, object] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.glob("*.distcp")}
    assert {int(name.split("_")[2]) for name in files} == {0, 1, 2, 3}, files  # __<rank>_<i>.distcp
    files |= {f"crc/{p.name}": json.loads(p.read_text()) for p in (step_dir / "crc").iterdir()}
    return files


@pytest.mark.timeout(300)
def test_two_agents_train_like_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    for d in (two, one):
        d.mkdir()
    nodes = [{"cache": str(two / f"cache{i}"), "output_dir": str(two / f"out{i}")} for i in range(2)]
    outputs = _run(nodes, nnodes=2, nproc=2, logs=two)

    # global rank 0 is on the agent whose output torchrun prefixes [rank0]; the other has ranks 2-3
    head = [i for i, out in enumerate(outputs) if "[rank0]:meshpar: llama debug | 4 ranks" in out]
    assert len(head) == 1, outputs
    head = head[0]
    for i, node in enumerate(nodes):
        ranks = {0, 1} if i == head else {2, 3}
        # one build per node-local cache, by a rank of that node (whichever took the lock first)
        built_by = _built_by(Path(node["cache"]))
        assert built_by["rank"] in ranks and built_by["local_rank"] == built_by["rank"] % 2, (i, built_by)
        # files of the run are global rank 0's: the other node's output_dir is never even created
        if i == head:
            assert {p.name for p in Path(node["output_dir"]).iterdir()} == {"metrics.jsonl", "recipe.toml"}
        else:
            assert not Path(node["output_dir"]).exists()
    shared = two / "checkpoints"
    assert sorted(p.name for p in shared.iterdir()) == [f"step_{STEPS}"]  # published, no .partial left
    assert sorted(p.name for p in (shared / f"step_{STEPS}" / "crc").iterdir()) == [f"{r}.json" for r in range(4)]

    # the same job as one agent of 4 ranks, on the head node's cache, now warm: not built again
    warm = _built_by(Path(nodes[head]["cache"]))
    _run([{"cache": nodes[head]["cache"], "output_dir": str(one / "out")}], nnodes=1, nproc=4, logs=one)
    assert _built_by(Path(nodes[head]["cache"])) == warm
    reference = _records(one / "out")
    assert [r["step"] for r in reference if "loss" in r] == list(range(1, STEPS + 1))
    assert _records(Path(nodes[head]["output_dir"])) == reference  # loss, grad_norm, lr, val_loss: bit for bit
    assert _checkpoint(shared / f"step_{STEPS}") == _checkpoint(one / "checkpoints" / f"step_{STEPS}")


# Stand-ins for SLURM's commands: srun runs its command once per "node" on this machine (with
# SLURM_NODEID and a cache per node), scontrol names the nodes and records a requeue.
FAKE_SRUN = """#!/bin/bash
while [[ ${1:-} == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i MESHPAR_CACHE=$FAKE/cache$i "$@" & done
rc=0
for p in $(jobs -p); do wait "$p" || { r=$?; (( r > rc )) && rc=$r; }; done
exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
case $1 in
  show) for ((i = 0; i < SLURM_NNODES; i++)); do echo localhost; done ;;
  requeue) echo "$2" >> "$FAKE/requeued" ;;
esac
"""


@pytest.mark.timeout(300)
def test_slurm_script_passes_the_time_limit_signal_to_each_rank_once_and_requeues(tmp_path):
    """scripts/slurm.sbatch under stand-ins for srun and scontrol: two agents meet and train;
    SIGUSR1 to the batch shell reaches every rank exactly once, through its agent, which does
    not restart them; the script requeues the job. (What a rank does with the signal is
    meshpar.runtime.fault's; this checks the wiring.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    marker, log = uuid.uuid4().hex, tmp_path / "job.out"
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", FAKE=str(tmp_path),
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[1-2]", SLURM_GPUS_PER_NODE="2",
               TMPDIR=str(tmp_path), MESHPAR_RDZV_PORT=str(free_port()), OMP_NUM_THREADS="1",
               MESHPAR_TEST_JOB=marker)
    cmd = ["bash", "scripts/slurm.sbatch", RECIPE, *BYTES, "--train.steps=100", "--train.log_every=1",
           "--train.eval_every=0", f"--train.output_dir={tmp_path / 'out'}"]
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + DEADLINE
        while "step      2 |" not in log.read_text():  # training, on both nodes' ranks
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        job.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@120
        job.wait(timeout=DEADLINE)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        _kill_marked(marker)
    out = log.read_text()
    assert (tmp_path / "requeued").read_text() == "4242\n", out[-3000:]
    assert "requeueing job 4242" in out
    forwarded = re.findall(r"Sending process (\d+) closing signal SIGUSR1", out)
    assert len(forwarded) == len(set(forwarded)) == 4, out[-3000:]  # once to each rank
    assert out.count("Received 10 death signal") == 2, out[-3000:]  # each agent stops its ranks itself
    assert out.count("meshpar: llama debug | 4 ranks") == 1, out[-3000:]  # and never restarts them


def test_a_shared_cache_whose_lock_does_not_span_hosts(tmp_path, monkeypatch):
    """Where flock is node-local or missing ([Note: a cache per node or one for all] in
    meshpar/data.py), builders on other hosts run at the same time: ours must not delete their
    folder in progress, nor fail when theirs is published first."""
    host, key = socket.gethostname(), "byte-0123"
    theirs, dead = tmp_path / f".{key}.tmp@other-host.x1", tmp_path / f".{key}.tmp@{host}.x2"
    theirs.mkdir()
    dead.mkdir()

    def build(tmp: Path) -> None:  # while we build, the other host publishes the entry
        (tmp / "meta.json").write_text("ours")
        (tmp_path / key).mkdir()
        (tmp_path / key / "meta.json").write_text("theirs")

    entry = data.cached(tmp_path, key, build)
    assert (entry / "meta.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, key, f"{key}.lock"]

    def no_flock(*args):  # Lustre mounted with noflock
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = tmp_path / f".byte-4567.tmp@{host}.x3"
    dead.mkdir()
    entry = data.cached(tmp_path, "byte-4567", lambda tmp: (tmp / "meta.json").write_text("built"))
    assert (entry / "meta.json").read_text() == "built"
    assert dead.exists()  # unlocked, it cannot know this host's other builders are dead
