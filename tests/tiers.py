"""The suite's tiers: which tests spawn processes (``multirank``) and which are slow (``slow``).

``pytest -m "not multirank and not slow"`` is the inner loop (tests/README.md). conftest.py marks
each collected test from what it calls, so a new test lands in the right tier without a decorator:

- ``multirank``: the test reaches ``run_distributed``, a ``CaseSet``, ``subprocess`` or
  ``tests.processes``, directly or through any function of the tests package it calls (followed
  through the names its code uses, resolved in its module's globals, its local imports, and its
  fixtures).
- ``slow``: a benchmark's test (``test_bench_*.py``), or a test marked ``@pytest.mark.slow`` by
  hand (target-size planner runs).

[Note: the tier guard]
The static reading cannot follow every path (a local ``from meshpar.cli import main`` that then
launches ranks), so it is checked at run time: while a test of the inner loop runs, starting
a subprocess (Python's ``subprocess.Popen`` audit event, which torchelastic's launcher raises too) or
calling ``run_distributed`` is recorded, and the test then fails naming what it started and the fix
(``@pytest.mark.multirank``; ``slow`` where it is inductor compiling kernels). So the inner loop can
not silently grow a spawn.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_SPAWNING_MODULES = ("subprocess", "multiprocessing", "tests.processes")


def _spawner(obj: object) -> bool:
    from tests.distributed import CaseSet, run_distributed

    if obj is run_distributed or isinstance(obj, CaseSet):
        return True
    return isinstance(obj, types.ModuleType) and obj.__name__ in _SPAWNING_MODULES


def _ours(obj: object) -> bool:
    """A function or class written in the tests package (whose body is followed)."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return False
    try:
        return Path(inspect.getfile(obj)).resolve().is_relative_to(TESTS)
    except (TypeError, OSError):
        return False


@functools.cache  # a function is read once, not once per test that reaches it (collection time)
def _uses(obj: object) -> tuple[object, ...]:
    return tuple(_used(obj))


def _used(obj: object) -> Iterator[object]:
    """Every object the source of ``obj`` names: bare names and attribute chains (``a.b.c``),
    resolved in its module's globals; names that do not resolve (locals, builtins) are skipped."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return
    scope = vars(sys.modules[obj.__module__])
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):  # a local ``import subprocess``
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            yield from (sys.modules[n] for n in names if n in _SPAWNING_MODULES and n in sys.modules)
            continue
        chain: list[str] = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in scope:
            continue
        value = scope[node.id]
        yield value
        for attr in reversed(chain):
            value = getattr(value, attr, None)
            if value is None:
                break
            yield value


def spawns(fn: object, fixtures: list[object]) -> bool:
    """Whether ``fn`` (a test function) or one of its ``fixtures`` can reach a process spawn."""
    return _spawns(fn, tuple(fixtures))


@functools.cache  # each parametrization of a test asks again
def _spawns(fn: object, fixtures: tuple[object, ...]) -> bool:
    seen: set[int] = set()
    todo = [fn, *fixtures]
    while todo:
        obj = inspect.unwrap(todo.pop())
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for used in _uses(obj):
            if _spawner(used):
                return True
            if _ours(used) and id(used) not in seen:
                todo.append(used)
    return False


# The test running now, while it is one of the inner loop's (else None), and what it started: [Note: the tier guard].
_current: str | None = None
_started: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if _current is not None and event == "subprocess.Popen":
        _started.append(f"subprocess {args[1]!r}"[:200])


def note_spawn(what: str) -> None:
    """Called by the harness when it spawns ranks (multiprocessing raises no audit event)."""
    if _current is not None:
        _started.append(what)


def install() -> None:
    sys.addaudithook(_audit)


def begin(nodeid: str | None) -> None:
    global _current
    _current = nodeid
    _started.clear()


def end() -> list[str]:
    """What the test that just ran started, were it one of the inner loop's."""
    global _current
    _current = None
    started = list(_started)
    _started.clear()
    return started
