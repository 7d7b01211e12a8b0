"""Run a function on N gloo ranks, each in its own process, with a deadline.

    results = run_distributed(fn, 4, arg1, arg2, timeout=120)

``fn`` must be importable (defined at module level). Each rank gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...) and, unless
``init_process_group=False``, an initialized gloo default process group. The return values
come back in rank order. If any rank raises, the error lists every failing rank's
traceback; if the ranks do not finish within ``timeout`` seconds (a hang in a collective,
typically), they are killed and the error names the ranks that never reported.
Ranks are forked from a server that imported torch ([Note: ranks forked from a server that
imported torch]); each still imports meshpar and sets up gloo, so loop sub-cases inside one call.

Most distributed tests are many small cases at a few world sizes: register them in a
``CaseSet`` (below), which runs every case of one world size inside one spawned job and
lets each ``test_*`` read its own case's outcome. Call ``run_distributed`` directly only
for a genuinely one-off job (a crash or hang on purpose, a run whose processes the test
controls). tests/README.md says more.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

# [Note: ports under pytest-xdist]
# A rank-0 store binds the port the test chose a moment earlier. Picked by binding port 0, that port
# is an ephemeral one, and with two pytest workers (.ci/run) the other worker's gloo connections take
# ephemeral ports all the time, and one can take a chosen port before its store binds it
# (EADDRINUSE). So a test's ports come from
# below the ephemeral range (Linux's 32768-60999 by default), a disjoint slice per xdist worker, each
# checked free by binding it: nothing else picks ports there, and within a worker tests run one at
# a time.
PORTS = range(10000, 32000)


def free_port() -> int:
    """A free localhost port for a rendezvous: [Note: ports under pytest-xdist]."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = len(PORTS) // max(1, workers)
    first = PORTS.start + worker * width
    for port in random.sample(range(first, first + width), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{first + width - 1} after 200 tries")


# [Note: ranks forked from a server that imported torch]
# Importing torch costs a process seconds of CPU on this machine (docs/performance.md#test-suite-and-set-up),
# and the suite starts well over a thousand ranks. So ranks come from multiprocessing's "forkserver": one server process
# per pytest worker imports torch, the torch modules meshpar's ranks load (DTensor, DCP, FSDP, pipelining,
# dynamo, which DTensor pulls in) and meshpar's training stack once (``_PRELOAD``, ``_context``) and forks each
# rank from itself, a process with no threads and no process group, as "spawn" would start a fresh interpreter.
# A rank takes the parent's environment as it is at the call (the server's dates from its start), before
# anything reads it: meshpar reads no variable at import (the torch modules preloaded read theirs from the
# server's environment, which is the pytest worker's: .ci/run sets ATEN_CPU_CAPABILITY before pytest). It
# also writes to the parent's stdout and stderr as they are at the call (pytest's capture of the
# running test), not the server's: ``_StdFds`` sends those two descriptors along.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
            "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.pipelining",
            "torch.distributed.elastic", "torch._dynamo", "torch.nn.attention.flex_attention", "torch.nn.functional",
            "torch.utils.flop_counter", "pytest", "meshpar.train", "meshpar.fsdp", "meshpar.checkpoint"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first rank)
    return ctx


class _StdFds:
    """The parent's file descriptors 1 and 2, duplicated into the rank as it is started
    (``multiprocessing.reduction.DupFd``, while the process object is pickled)."""

    def __reduce__(self):
        return _std_fds, (reduction.DupFd(1), reduction.DupFd(2))


def _std_fds(out, err) -> tuple[int, int]:
    return out.detach(), err.detach()


def _rank_main(rank: int, world_size: int, port: int, init_pg: bool, fn: Callable, args: tuple,
               results: mp.Queue, environ: dict[str, str] | None = None,
               std_fds: tuple[int, int] | None = None, fault_path: str | None = None) -> None:
    # the parent's environment and output, at the call: [Note: ranks forked from a server that imported torch]
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if std_fds is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(std_fds, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
    # A rank that dies in C++ (SIGABRT from a gloo enforce or glibc's heap checks, SIGSEGV) writes every
    # thread's Python stack to its fault file, which the parent puts first in the test's error: the
    # cause, where the survivors' tracebacks show only its effect (a connection closed by the peer).
    # The server does not inherit pytest's faulthandler; the file stays open until the process ends.
    if fault_path is not None:
        faulthandler.enable(open(fault_path, "w"), all_threads=True)  # noqa: SIM115
    else:
        faulthandler.enable(all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    all_ok = False
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors into the message; the multiprocessing queue would pass
        # shared-memory handles that die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
        all_ok = True
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, readable
        results.put((rank, False, traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            # A gloo group destroyed while a peer still uses it occasionally aborts (SIGABRT) at
            # exit; meeting first avoids it. Skipped after a failure, where peers may be gone.
            if all_ok:
                dist.barrier()
            dist.destroy_process_group()


def _exit(code: int | None) -> str:
    """An exit code in words: negative codes are signals (-6 SIGABRT: a C++ abort, like a gloo enforce)."""
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _crash_reports(faults: Path, procs: list) -> list[str]:
    """What faulthandler wrote for each rank that died of a signal it catches (SIGSEGV, SIGABRT,
    SIGFPE, SIGBUS, SIGILL): the crashing thread's Python stack and every other thread's."""
    reports = []
    for r, p in enumerate(procs):
        path = faults / f"rank{r}.txt"
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            reports.append(f"--- rank {r} crashed (exit code {_exit(p.exitcode)}); faulthandler:\n{text}")
    return reports


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                    init_process_group: bool = True) -> list[Any]:
    from tests import tiers

    tiers.note_spawn(f"run_distributed({getattr(fn, '__name__', fn)}, {world_size})")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    # not daemonic, as torchrun's ranks are not: a rank may start processes of its own (checkpoint.async =
    # "process"); the finally below ends every rank however the job goes
    faults = Path(tempfile.mkdtemp(prefix="meshpar-faults-"))
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, init_process_group, fn, args, results,
                                                  environ, _StdFds(), str(faults / f"rank{r}.txt")), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    grace: float | None = None  # after a failure (or a death), peers blocked on it get 5 s, then are killed
    try:
        while len(outcomes) < world_size:
            wait = min(deadline, grace) if grace is not None else deadline
            try:  # poll each second: a rank that died without reporting is noticed at once
                rank, ok, value = results.get(timeout=min(max(wait - time.monotonic(), 0.01), 1.0))
                outcomes[rank] = (ok, value)
                if not ok and grace is None:
                    grace = time.monotonic() + 5
            except queue_mod.Empty:
                if time.monotonic() >= wait:
                    break
                dead = [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None]
                if dead and grace is None:  # killed, aborted (a gloo enforce), segfault; its report may lag
                    grace = time.monotonic() + 5
    finally:
        for p in procs:
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()

    crashes = _crash_reports(faults, procs)
    shutil.rmtree(faults, ignore_errors=True)
    errors = [f"--- rank {r} raised:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        lines = [f"{len(errors)} of {world_size} ranks failed" + (
            f"; ranks {missing} never reported (exit codes {[_exit(procs[r].exitcode) for r in missing]}: "
            f"killed here = hung past {timeout:.0f}s, or blocked on a failed peer)" if missing else "")]
        raise AssertionError("\n".join(lines + crashes + errors))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


class CaseSet:
    """Named test cases that run inside one spawned job per world size.

        CASES = CaseSet({"units": (_case_units, (1, 2, 4)), "hybrid": (_case_hybrid, 4)},
                        setup=_setup, timeout=240)

        @pytest.mark.parametrize("world", CASES.worlds("units"))
        def test_units(world):
            CASES.check("units", world)

    A case is a callable run on every rank of a job of each of its world sizes, in
    registration order; it gets ``setup``'s return value (``setup(tmp)`` runs once per rank
    before the cases, ``tmp`` being a scratch folder shared by the job's ranks), or no
    argument when there is no ``setup``. Its return value comes back to the test. A case
    that raises is recorded with its traceback and the job goes on to the next case (a rank
    left waiting in a collective by a peer's failure hangs the job until ``timeout``, which
    then fails every case of that world size, naming the ranks that never reported).

    The first ``check`` at a world size spawns that world's job; its outcomes are kept on
    this object, so the rest of the session's tests read them without another spawn. Cases
    may be closures or partials: the spawned ranks find this object by importing the module
    that created it and looking it up by name, so it must be a module-level global.

    A job runs only the cases the session's selected tests check, when conftest.py could read
    them (``select_cases``: one test run alone spawns one case, not its whole world's); a case
    checked that was not foreseen runs in one more job, with the world's other unrun ones.
    """

    def __init__(self, cases: dict[str, tuple[Callable, int | tuple[int, ...]]] | None = None, *,
                 timeout: float, setup: Callable[[Path], Any] | None = None) -> None:
        self.timeout = timeout  # seconds for one whole job
        self.setup = setup
        self.module = sys._getframe(1).f_globals["__name__"]  # where the ranks look this set up
        self._cases: dict[str, tuple[Callable, tuple[int, ...]]] = {}
        self._outcomes: dict[int, list[dict[str, tuple[bool, Any]]] | AssertionError] = {}
        self.wanted: set[str] | None = None  # the cases the selected tests check (select_cases); None: all
        self.spawned: list[int] = []  # the world size of each job started, in order
        for name, (fn, worlds) in (cases or {}).items():
            self.add(name, fn, worlds)

    def add(self, name: str, fn: Callable, worlds: int | tuple[int, ...]) -> None:
        """Register case ``name`` to run at each world size in ``worlds``."""
        if name in self._cases:
            raise ValueError(f"case {name!r} is registered twice")
        self._cases[name] = (fn, (worlds,) if isinstance(worlds, int) else tuple(worlds))

    def worlds(self, name: str) -> tuple[int, ...]:
        """The world sizes case ``name`` runs at, for ``pytest.mark.parametrize("world", ...)``."""
        return self._cases[name][1]

    def names(self, world: int | None = None) -> list[str]:
        """The cases (at ``world``, or all), in registration order."""
        return [n for n, (_, worlds) in self._cases.items() if world is None or world in worlds]

    def params(self) -> list:
        """Every (case, world) pair as ``pytest.param``s, for ``parametrize(("case", "world"), ...)``."""
        import pytest

        return [pytest.param(n, w, id=f"{n}-{w}") for n, (_, worlds) in self._cases.items() for w in worlds]

    def check(self, name: str, world: int) -> list[Any]:
        """Case ``name``'s return value on each rank of the ``world``-rank job, in rank order;
        the test fails with every failing rank's traceback (or the job's hang or crash)."""
        import pytest

        if world not in self.worlds(name):
            raise ValueError(f"case {name!r} is not registered at {world} ranks, only {self.worlds(name)}")
        outcomes = self._job(world, name)
        if isinstance(outcomes, AssertionError):
            pytest.fail(f"{name} at {world} ranks: the job failed\n{outcomes}", pytrace=False)
        failures = [f"--- rank {r}:\n{out[name][1]}" for r, out in enumerate(outcomes) if not out[name][0]]
        if failures:
            pytest.fail(f"{name} at {world} ranks:\n" + "\n".join(failures), pytrace=False)
        return [out[name][1] for out in outcomes]

    def _job(self, world: int, name: str) -> list[dict[str, tuple[bool, Any]]] | AssertionError:
        done = self._outcomes.get(world)
        if isinstance(done, AssertionError) or (done is not None and name in done[0]):
            return done
        ran = set(done[0]) if done is not None else set()
        every = self.wanted is None or name not in self.wanted  # an unforeseen case: the selection missed some
        names = [n for n in self.names(world) if n not in ran and (every or n in self.wanted)]
        self.spawned.append(world)
        tmp = tempfile.mkdtemp(prefix=f"meshpar-cases{world}-")
        try:
            outcomes = run_distributed(_run_cases, world, self.module, self._attr(), tmp, names, timeout=self.timeout)
            self._outcomes[world] = outcomes if done is None else [
                {**before, **after} for before, after in zip(done, outcomes, strict=True)]
        except AssertionError as e:  # a hang or a crash: every case of this world fails with it
            self._outcomes[world] = e
        except BaseException as e:  # pytest-timeout's, or ^C: the rest of this world's cases fail at
            self._outcomes[world] = AssertionError(f"the job was interrupted: {e!r}")  # once, unspawned
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self._outcomes[world]

    def _attr(self) -> str:
        names = [k for k, v in vars(sys.modules[self.module]).items() if v is self]
        if not names:
            raise RuntimeError(f"a CaseSet must be a global of its module ({self.module}) for the ranks to find it")
        return names[0]


def select_cases(items: list[Any]) -> None:
    """Before the session's tests run (conftest.py): each ``CaseSet`` a selected test calls ``check`` on
    directly gets the cases they name (a string, or the test's parameter the name is passed from) as
    ``wanted``. A set whose checks cannot be read this way (a name computed in the test, a check made
    in a helper) keeps None: its jobs run every case of their world."""
    import ast
    import inspect
    import textwrap

    wanted: dict[int, tuple[CaseSet, set[str] | None]] = {}
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check"
                    and isinstance(node.func.value, ast.Name) and node.args):
                continue
            cases = fn.__globals__.get(node.func.value.id)
            if not isinstance(cases, CaseSet):
                continue
            _, names = wanted.setdefault(id(cases), (cases, set()))
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                name = first.value
            elif isinstance(first, ast.Name) and isinstance(params.get(first.id), str):
                name = params[first.id]
            else:
                wanted[id(cases)] = (cases, None)
                continue
            if names is not None:
                names.add(name)
    for cases, names in wanted.values():
        cases.wanted = names


def _run_cases(module: str, attr: str, tmp: str, names: list[str]) -> dict[str, tuple[bool, Any]]:
    """On one rank: the cases ``names`` (of this world size), each ``(True, its return value)`` or
    ``(False, its traceback)``; a failed ``setup`` fails every case with its traceback."""
    import importlib

    cases: CaseSet = getattr(importlib.import_module(module), attr)
    outcomes: dict[str, tuple[bool, Any]] = {}
    try:
        arg = (cases.setup(Path(tmp)),) if cases.setup is not None else ()
    except Exception:  # noqa: BLE001 - reported by every test of this world size
        error = traceback.format_exc()
        return {name: (False, f"setup failed:\n{error}") for name in names}
    for name in names:
        try:
            outcomes[name] = (True, cases._cases[name][0](*arg))
        except Exception:  # noqa: BLE001 - reported by the test that owns the case
            outcomes[name] = (False, traceback.format_exc())
    return outcomes
