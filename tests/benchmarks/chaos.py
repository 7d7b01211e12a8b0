"""Chaos: a 2D training run under ``--max-restarts`` while SIGTERM, SIGKILL and SIGSTOP hit random
ranks at random times, beside the same run left alone.

    python -m tests.benchmarks.chaos [--steps 200] [--faults 6] [--seed 0] [--timeout 10] [--dir DIR]

Both runs are ``meshpar train recipes/llama_debug_2d.toml`` (dp_shard 2 x tp 2, 4 gloo ranks)
with the tests' small overrides, a checkpoint every ``--every`` steps and the collective
timeout ``--timeout``. The chaos run gets ``--max-restarts`` = faults + 1; a seeded generator
picks, for each fault, a delay after the run has made progress again, a signal and a rank:

- SIGTERM: a preemption of one rank: all ranks stop after the same step, save, exit 75, and
  the agent restarts them (a restart counts against --max-restarts);
- SIGKILL: a dead rank: the agent restarts every rank from the newest checkpoint;
- SIGSTOP: a hung rank: its peers time out after --timeout s, fail naming it, and the agent
  restarts every rank (the stopped one is SIGKILLed after the agent's 30 s grace).

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
    args = parser.parse_args(argv)
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every (the final parameters are read from the last checkpoint)")
    tmp = args.dir or Path(tempfile.mkdtemp(prefix="meshpar-chaos-"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

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
    injected: list[tuple[str, int, int]] = []  # (signal, rank, step it came at)
    try:
        for _ in range(args.faults):
            reached = _last_step(out)
            while chaos.poll() is None and _last_step(out) < reached + 3:  # progress again after the last fault
                time.sleep(0.2)
            time.sleep(rng.uniform(0.5, 1.5 * clean_s / args.steps * args.every))  # somewhere in the next steps
            kind, rank = rng.choice(KINDS), rng.randrange(4)
            pids = _rank_pids(chaos.pid)
            if chaos.poll() is not None or rank not in pids:
                break
            at = _last_step(out)
            os.kill(pids[rank], kind)
            injected.append((kind.name, rank, at))
            print(f"  fault {len(injected)}: {kind.name} to rank {rank} at step {at} "
                  f"({time.monotonic() - start:.1f} s)", flush=True)
        code = chaos.wait(timeout=3600)
    finally:
        if chaos.poll() is None:
            _kill_tree(chaos)
    chaos_s = time.monotonic() - start
    log = (tmp / "chaos.log").read_text()
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", log)]
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
    print(f"  faults survived        {survived}  (exit code {code}, {len(resumed)} resumes)")
    print(f"  steps redone           {redone}")
    print(f"  wall time              {chaos_s:.1f} s vs {clean_s:.1f} s clean: {lost:.1f} s lost per fault")
    print(f"  metrics.jsonl          {'bit-identical' if same_metrics else 'DIFFERENT'} to the clean run's")
    print(f"  final parameters       {'bit-identical' if same_params else 'DIFFERENT'} to the clean run's")
    print(f"  logs                   {tmp / 'clean.log'}, {tmp / 'chaos.log'}")


if __name__ == "__main__":
    main()
