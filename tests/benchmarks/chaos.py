"""Chaos: a 2D training run under ``--max-restarts`` while SIGTERM, SIGKILL and SIGSTOP hit random
ranks at random times, beside the same run left alone.

    python -m tests.benchmarks.chaos [--steps 200] [--faults 6] [--seed 0] [--timeout 10] [--dir DIR]
    python -m tests.benchmarks.chaos --replicas torchft [--steps 200] [--faults 4] ...

Both runs are ``meshpar train recipes/llama_debug_2d.toml`` (dp_shard 2 x tp 2, 4 gloo ranks)
with the tests' small overrides, a checkpoint every ``--every`` steps and the collective
timeout ``--timeout``. The chaos run gets ``--max-restarts`` = faults + 1; a seeded generator
picks, for each fault, a delay after the run has made progress again, a signal and a rank:

- SIGTERM: a preemption of one rank: all ranks stop after the same step, save, exit 75, and
  the agent restarts them (a restart counts against --max-restarts);
- SIGKILL: a dead rank: the agent restarts every rank from the newest checkpoint;
- SIGSTOP: a hung rank: its peers time out after --timeout s, fail naming it, and the agent
  restarts every rank (the stopped one is SIGKILLed after the agent's 30 s grace).

With ``--replicas torchft`` the same seeded SIGKILLs and SIGSTOPs (alternating; none in the run's
second half, so that the live group cannot finish before the victim is back) go to the ranks of replica 1,
once in one 4-rank job (dp_replicate 2 x dp_shard 2) restarting from checkpoints, once in 2
replica groups of 2 ranks under torchft, each beside its clean run: steps redone and seconds lost
per fault in each mode; under torchft whether the live group trained every step once, how many
full-batch steps one group trained alone, whether the healed group ends bit-identical to the
live one, and the final loss against the clean run's (the shrunken quorum trains half a batch on
those steps, so the run is not the clean run's arithmetic: its loss is compared with the clean
run's step-to-step spread).

It prints faults injected and survived (the run went past the step it was at when the fault
came), steps redone (trained twice because they came after the newest checkpoint), seconds
lost per fault (wall time beyond the clean run's, over the faults), and whether metrics.jsonl
(timings left out) and the final parameters (the last checkpoint, converted to one torch
file) are bit-identical to the clean run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshpar.convert import convert
from tests.processes import descendants

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model.n_layers=2", "--train.seq_len=64", "--train.global_batch=8", "--train.micro_batch=2",
         "--train.log_every=1", "--train.eval_every=0", "--data.tokenizer=byte", "--model.vocab_size=256",
         "--metrics.progress=off", "--optim.warmup_steps=2"]
TIMED = ("tokens_per_s", "mfu", "mem_gb")
KINDS = (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP)


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            rows.append({k: v for k, v in json.loads(line).items() if k not in TIMED})
    return rows


def _last_step(out: Path) -> int:
    return max((r.get("step", 0) for r in _records(out)), default=0)


def _resumes(log: str) -> list[int]:
    """The step each restart of a run resumed from (0: no checkpoint yet), in order: the log's
    attempts start with the run's banner (``| layout ``), a resume says so after it."""
    attempts = re.split(r"^meshpar: .* \| layout .*$", log, flags=re.M)[2:]  # text before and after the first
    return [int(m.group(1)) if (m := re.search(r"resumed from \S+ at step (\d+)", a)) else 0 for a in attempts]


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the training processes under ``launcher`` (named ``meshpar rank R``:
    meshpar/runtime/launch.py)."""
    ranks = {}
    for pid in descendants(launcher):
        with contextlib.suppress(OSError):
            name = (Path("/proc") / str(pid) / "comm").read_text().strip()
            if name.startswith("meshpar rank ") and name[13:].isdigit():
                ranks[int(name[13:])] = pid
    return ranks


def _command(out: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshpar.cli", "train", str(ROOT / "recipes" / "llama_debug_2d.toml"), *SMALL,
            f"--train.steps={args.steps}", f"--train.output_dir={out}", f"--checkpoint.every={args.every}",
            f"--fault.timeout={args.timeout}", *extra]


def _run(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _final_params(out: Path, steps: int, tmp: Path) -> dict[str, torch.Tensor]:
    dst = tmp / f"{out.name}.pt"
    convert(out / "checkpoints" / f"step_{steps}", dst, "torch", progress=False)
    return torch.load(dst, weights_only=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="fault.timeout, seconds")
    parser.add_argument("--every", type=int, default=10, help="checkpoint.every")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--replicas", choices=("none", "torchft"), default="none",
                        help="torchft: 2 replica groups x 2 ranks healing under torchft against one 4-rank job "
                        "restarting from checkpoints, the same faults to the ranks of one replica")
    args = parser.parse_args(argv)
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every (the final parameters are read from the last checkpoint)")
    tmp = args.dir or Path(tempfile.mkdtemp(prefix="meshpar-chaos-"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if args.replicas == "torchft":
        replicas_main(args, tmp)
        return

    start = time.monotonic()
    clean = _run(_command(tmp / "clean", args), tmp / "clean.log")
    if clean.wait(timeout=3600) != 0:
        sys.exit(f"chaos: the clean run failed; see {tmp / 'clean.log'}")
    clean_s = time.monotonic() - start
    print(f"clean run: {args.steps} steps in {clean_s:.1f} s", flush=True)

    rng = random.Random(args.seed)
    out = tmp / "chaos"
    chaos = _run(_command(out, args, f"--max-restarts={args.faults + 1}"), tmp / "chaos.log")
    start = time.monotonic()
    # (signal, rank, delay) drawn in the order the runs of earlier commits drew them: a seed gives the same faults
    faults = []
    for _ in range(args.faults):
        delay = rng.uniform(0.5, 1.5 * clean_s / args.steps * args.every)  # somewhere in the next steps
        faults.append((rng.choice(KINDS), rng.randrange(4), delay))
    try:
        injected = _inject(faults, chaos, out, 0, start, args.steps)
        code = chaos.wait(timeout=3600)
    finally:
        if chaos.poll() is None:
            _kill_tree(chaos)
    chaos_s = time.monotonic() - start
    resumed = _resumes((tmp / "chaos.log").read_text())
    survived = sum(1 for _, _, at in injected if code == 0 and _last_step(out) > at)
    redone = sum(max(0, at - r) for (_, _, at), r in zip(injected, resumed, strict=False))
    same_metrics = _records(out) == _records(tmp / "clean")
    same_params = False
    if code == 0:
        a, b = _final_params(tmp / "clean", args.steps, tmp), _final_params(out, args.steps, tmp)
        same_params = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lost = (chaos_s - clean_s) / max(len(injected), 1)
    print(f"\nchaos: {args.steps} steps, 4 ranks (dp_shard 2 x tp 2), checkpoint every {args.every}, "
          f"timeout {args.timeout:g} s, seed {args.seed}")
    print(f"  faults injected        {len(injected)}  ({', '.join(k for k, _, _ in injected)})")
    print(f"  faults survived        {survived}  (exit code {code}, {len(resumed)} restarts)")
    print(f"  steps redone           {redone}")
    print(f"  wall time              {chaos_s:.1f} s vs {clean_s:.1f} s clean: {lost:.1f} s lost per fault")
    print(f"  metrics.jsonl          {'bit-identical' if same_metrics else 'DIFFERENT'} to the clean run's")
    print(f"  final parameters       {'bit-identical' if same_params else 'DIFFERENT'} to the clean run's")
    print(f"  logs                   {tmp / 'clean.log'}, {tmp / 'chaos.log'}")


# --- --replicas torchft: healing replica groups against restarts, on the same faults ---------------------------
FT_KINDS = (signal.SIGKILL, signal.SIGSTOP)  # a dead rank, a hung one
REPLICAS = ("--parallel.dp_replicate=2", "--parallel.dp_shard=2")  # 4 ranks: replica 1 is ranks 2 and 3


def _ft_command(out: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, "-m", "meshpar.cli", "train", str(ROOT / "recipes" / "llama_debug_fsdp.toml"), *SMALL,
            *REPLICAS, f"--train.steps={args.steps}", f"--train.output_dir={out}", f"--checkpoint.every={args.every}",
            f"--fault.timeout={args.timeout}", *extra]


def _inject(faults: list[tuple[signal.Signals, int, float]], launcher: subprocess.Popen, victim_out: Path,
            first_rank: int, start: float, last: int) -> list[tuple[str, int, int]]:
    """Each fault once the victim (the whole job, or replica 1's group) trained 3 steps past the
    previous one, up to step ``last``: (signal, rank of the victim's launcher, the victim's step
    when it came)."""
    injected = []
    for kind, rank, delay in faults:
        reached = _last_step(victim_out)
        while launcher.poll() is None and _last_step(victim_out) < reached + 3:
            time.sleep(0.2)
        time.sleep(delay)
        pids = _rank_pids(launcher.pid)
        if launcher.poll() is not None or first_rank + rank not in pids or _last_step(victim_out) > last:
            break
        at = _last_step(victim_out)
        os.kill(pids[first_rank + rank], kind)
        injected.append((kind.name, first_rank + rank, at))
        print(f"    fault {len(injected)}: {kind.name} to rank {first_rank + rank} at step {at} "
              f"({time.monotonic() - start:.1f} s)", flush=True)
    return injected


def _groups(tmp: Path, name: str, args: argparse.Namespace, address: str, faults=None):
    """Both replica groups side by side (replica 1 restartable and faulted when ``faults``):
    (exit codes, wall seconds, faults injected)."""
    out = tmp / name
    common = (f"--fault.lighthouse={address}", "--fault.replicas=torchft")
    restarts = [f"--max-restarts={len(faults) + 1}"] if faults else []
    start = time.monotonic()
    procs = [_run(_ft_command(out, args, *common, "--fault.replica_id=0"), tmp / f"{name}_0.log"),
             _run(_ft_command(out, args, *common, "--fault.replica_id=1", *restarts), tmp / f"{name}_1.log")]
    injected = []
    try:
        if faults:  # none in the last half: the live group would finish before the victim came back
            injected = _inject(faults, procs[1], out / "replica_1", 0, start, args.steps // 2)
        codes = [p.wait(timeout=3600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
    return codes, time.monotonic() - start, injected


def _loss_tail(records: list[dict], n: int = 20) -> tuple[float, float]:
    """Mean and standard deviation of the last ``n`` logged losses."""
    tail = [r["loss"] for r in records if "loss" in r][-n:]
    mean = sum(tail) / len(tail)
    return mean, (sum((x - mean) ** 2 for x in tail) / len(tail)) ** 0.5


def replicas_main(args: argparse.Namespace, tmp: Path) -> None:
    """The same seeded faults (SIGKILL or SIGSTOP to a rank of replica 1) to one 4-rank job under
    ``--max-restarts`` and to 2 replica groups under torchft; prints what each fault cost."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    rng = random.Random(args.seed)
    faults = [(FT_KINDS[i % 2], rng.randrange(2), rng.uniform(0.5, 3.0)) for i in range(args.faults)]  # both kinds
    shown = [(k.name, r, round(d, 2)) for k, r, d in faults]
    print(f"faults (signal, rank of replica 1, delay s): {shown}", flush=True)

    print("restart mode: one job, dp_replicate 2 x dp_shard 2", flush=True)
    start = time.monotonic()
    if _run(_ft_command(tmp / "restart_clean", args), tmp / "restart_clean.log").wait(timeout=3600) != 0:
        sys.exit(f"chaos: the clean run failed; see {tmp / 'restart_clean.log'}")
    restart_clean_s = time.monotonic() - start
    out = tmp / "restart"
    job = _run(_ft_command(out, args, f"--max-restarts={args.faults + 1}"), tmp / "restart.log")
    start = time.monotonic()
    try:
        injected = _inject(faults, job, out, 2, start, args.steps // 2)
        restart_code = job.wait(timeout=3600)
    finally:
        if job.poll() is None:
            _kill_tree(job)
    restart_s = time.monotonic() - start
    resumed = _resumes((tmp / "restart.log").read_text())
    redone = sum(max(0, at - r) for (_, _, at), r in zip(injected, resumed, strict=False))
    restart_same = restart_code == 0 and _records(out) == _records(tmp / "restart_clean")

    print("torchft mode: 2 replica groups x dp_shard 2, a lighthouse", flush=True)
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=2000)
    try:
        clean_codes, ft_clean_s, _ = _groups(tmp, "ft_clean", args, server.address())
        if clean_codes != [0, 0]:
            sys.exit(f"chaos: the clean replica groups failed ({clean_codes}); see {tmp}/ft_clean_*.log")
        ft_codes, ft_s, ft_injected = _groups(tmp, "ft", args, server.address(), faults)
    finally:
        server.shutdown()
    survivor = _records(tmp / "ft" / "replica_0")
    steps = [r["step"] for r in survivor if "loss" in r]
    once = steps == list(range(1, args.steps + 1))
    missed = sum(2 - r["replica_groups"] for r in survivor if "loss" in r) / 2  # full-batch steps not trained
    same_params = False
    if ft_codes == [0, 0]:
        a, b = (_final_params(tmp / "ft" / f"replica_{g}", args.steps, tmp) for g in (0, 1))
        same_params = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    clean_loss, noise = _loss_tail(_records(tmp / "ft_clean" / "replica_0"))
    chaos_loss, _ = _loss_tail(survivor)

    n, m = max(len(injected), 1), max(len(ft_injected), 1)
    print(f"\nchaos --replicas torchft: {args.steps} steps, 4 ranks, checkpoint every {args.every}, timeout "
          f"{args.timeout:g} s, seed {args.seed}")
    print(f"  restart mode   {len(injected)} faults, exit {restart_code}: {redone} steps redone "
          f"({redone / n:.1f} per fault), {(restart_s - restart_clean_s) / n:.1f} s lost per fault; metrics "
          f"{'bit-identical' if restart_same else 'DIFFERENT'} to its clean run's")
    print(f"  torchft mode   {len(ft_injected)} faults, exits {ft_codes}: 0 steps redone (step counter "
          f"{'never went back, every step once' if once else 'WENT BACK or skipped'}); {missed:g} full-batch steps "
          f"trained by one group only ({missed / m:.1f} per fault); {(ft_s - ft_clean_s) / m:.1f} s lost per fault")
    print(f"  torchft final  healed group's parameters and optimizer state "
          f"{'bit-identical' if same_params else 'DIFFERENT'} to the survivors'; loss over the last 20 steps "
          f"{chaos_loss:.4f} against {clean_loss:.4f} clean (clean's step-to-step std {noise:.4f})")
    print(f"  logs           {tmp}")


if __name__ == "__main__":
    main()
