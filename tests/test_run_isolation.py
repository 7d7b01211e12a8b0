"""No process-wide switches: two runs, or a run and a simulation, in one process never see each other's
collective counts, flight records, steps, forced collectives or reduce-scatter layout
(meshpar/distributed/comm_record.py [Note: the active record]), torch's pipeline p2p issue is replaced
only inside the block that asked for it, and meshpar/distributed and meshpar/fsdp hold no module-level
mutable state but the caches allowed below."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshpar.distributed import comm, comm_record
from meshpar.distributed._torch import schedule_p2p_through
from meshpar.distributed.comm_record import CommRecord
from meshpar.fsdp import fully_shard

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo process group in this process; the environment's switch off."""
    monkeypatch.delenv("MESHPAR_FORCE_COLLECTIVES", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _in_threads(*targets) -> list:
    """Run each target on its own thread, all at once; their results, in order (re-raising the first error)."""
    results, errors = [None] * len(targets), []

    def run(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def test_two_runs_on_two_threads_keep_their_own_records(one_rank):
    both_active = threading.Barrier(2, timeout=30)

    def run(record: CommRecord, step: int, op: str, calls: int) -> dict:
        t = torch.ones(4)
        with record.active(), comm_record.count() as counted:
            record.step = step
            both_active.wait()  # each thread's record active at once
            for _ in range(calls):
                if op == "all_reduce":
                    comm.all_reduce(t, one_rank, dim="a")
                else:
                    comm.all_gather(t.clone(), t, one_rank, dim="b")
            both_active.wait()
            return dict(active=comm_record.active() is record, forced=comm_record.forced(),
                        native=comm_record.native_layout(), step=comm_record.current_step(),
                        calls=dict(counted.calls), flight=[(e.seq, e.op, e.step) for e in comm_record.flight_record()])

    a, b = CommRecord(forced=True), CommRecord(native_layout=True)
    seen_a, seen_b = _in_threads(lambda: run(a, 1, "all_reduce", 3), lambda: run(b, 2, "all_gather", 2))
    assert seen_a == dict(active=True, forced=True, native=False, step=1, calls={("all_reduce", "a"): 3},
                          flight=[(1, "all_reduce", 1), (2, "all_reduce", 1), (3, "all_reduce", 1)])
    assert seen_b == dict(active=True, forced=False, native=True, step=2, calls={("all_gather", "b"): 2},
                          flight=[(1, "all_gather", 2), (2, "all_gather", 2)])
    # this thread was in neither
    assert comm_record.active() is None and comm_record.current_step() is None and not comm_record.forced()
    assert comm_record.flight_record() == []


def test_a_simulation_inside_a_run_keeps_its_own_record(one_rank):
    t = torch.ones(4)
    run = CommRecord()
    with run.active(), run.count() as in_run:
        run.step = 5
        comm.all_reduce(t, one_rank, dim="dp")
        with CommRecord(native_layout=True).active() as simulation, simulation.count() as simulated:
            assert comm_record.native_layout() and comm_record.current_step() is None
            comm.all_reduce(t, one_rank, dim="tp")
        assert comm_record.active() is run and not comm_record.native_layout()
        with comm_record.force_collectives():  # the active record's switch, for the block only
            assert run.forced and comm_record.forced()
        assert run.forced is None
        comm.all_reduce(t, one_rank, dim="dp", record=simulation)  # passed: reported there, not here
    assert in_run.calls == {("all_reduce", "dp"): 1}
    assert simulated.calls == {("all_reduce", "tp"): 1}
    assert [(e.op, e.dim, e.step) for e in run.flight] == [("all_reduce", "dp", 5)]
    assert [(e.op, e.dim, e.step) for e in simulation.flight] == [("all_reduce", "tp", None),
                                                                  ("all_reduce", "dp", None)]


def test_fsdp_backward_on_another_thread_reports_to_the_forwards_record(one_rank):
    """On CUDA autograd runs backward on a thread of its own, outside the caller's context variables.
    Here backward runs on a fresh thread: FSDP's reduce-scatters still reach the record active at its
    forward, which also forced the collective path at one rank; a collective issued plainly on that
    thread reaches no record."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    record = CommRecord(forced=True)
    with record.active(), record.count() as counted:
        loss = model(torch.randn(2, 8)).sum()

        def backward() -> bool:
            loss.backward()
            comm.all_reduce(torch.ones(1), one_rank, dim="elsewhere")
            return comm_record.active() is None

        assert _in_threads(backward) == [True]
    assert counted.calls[("all_gather", "dp_shard")] >= 2, counted.calls
    assert counted.calls[("reduce_scatter", "dp_shard")] == 2, counted.calls
    assert ("all_reduce", "elsewhere") not in counted.calls
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autograd's device threads need CUDA")
def test_a_backward_on_a_cuda_device_thread_reports_to_the_callers_record(one_rank):
    """A collective in an autograd function's backward (expert parallelism's all-to-all, context
    parallelism's gathers) runs on autograd's device thread on CUDA: it reaches the record active where
    backward was called (``_torch.backward_launch_context``)."""
    threads = []

    class Reduced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            threads.append(threading.current_thread() is threading.main_thread())
            comm.all_reduce(grad.cpu(), one_rank, dim="backward")
            return grad

    x = torch.ones(4, device="cuda", requires_grad=True)
    record = CommRecord()
    with record.active(), record.count() as counted:
        Reduced.apply(x).sum().backward()
    assert threads == [False]  # it did run on another thread
    assert counted.calls == {("all_reduce", "backward"): 1}


def test_torch_pipeline_p2p_is_routed_inside_the_block_only():
    from torch.distributed.pipelining import schedules

    torch_issue, calls = schedules._batch_p2p, []

    def issue(name: str):
        def call(torch_fn, ops, desc):
            calls.append((name, torch_fn is torch_issue, threading.current_thread() is threading.main_thread()))
            return torch_fn(ops, desc)
        return call

    with schedule_p2p_through(issue("outer")):
        assert schedules._batch_p2p is not torch_issue
        schedules._batch_p2p([])
        with schedule_p2p_through(issue("inner")):
            schedules._batch_p2p([])
        schedules._batch_p2p([])
        assert _in_threads(lambda: schedules._batch_p2p([])) == [[]]  # another thread: torch's own, untouched
    assert schedules._batch_p2p is torch_issue
    assert calls == [("outer", True, True), ("inner", True, True), ("outer", True, True)]


# --- no module-level mutable state ---------------------------------------------------------------------
# Module (and class) level names in meshpar/distributed and meshpar/fsdp that may hold a mutable value,
# each a cache of a pure function, with the reason. Anything else that can change is state of an
# object passed where it is used (a run's comm record, an FSDP unit), or a context variable whose
# value is immutable.
ALLOWED = {
    ("meshpar/fsdp/api.py", "_CLASSES"): "a module class -> its FSDP subclass, made once per class (a pure "
                                         "function of the class; one subclass keeps isinstance and pickling stable)",
}
_MUTABLE_CALLS = {"list", "dict", "set", "deque", "Counter", "defaultdict", "OrderedDict", "bytearray", "local",
                  "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}
_MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, _MUTABLE_NODES):
        return True
    if isinstance(value, ast.Call):
        name = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        if name == "ContextVar":  # its default is shared by every context: must be immutable
            return any(_mutable(k.value) for k in value.keywords if k.arg == "default")
        return name in _MUTABLE_CALLS
    return False


def _targets(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def mutable_state(source: str, path: str) -> list[str]:
    """``path:line name`` of every module- or class-level assignment of a mutable value, and every
    ``global`` statement, in ``source``."""
    found, todo = [], list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and _mutable(node.value):
            found += [f"{path}:{node.lineno} {name}" for name in _targets(node)
                      if name != "__all__" and (path, name) not in ALLOWED]
        elif isinstance(node, ast.ClassDef):
            todo += [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
    found += [f"{path}:{n.lineno} global {', '.join(n.names)}" for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.Global)]
    return found


def test_no_module_level_mutable_state_in_distributed_and_fsdp():
    found = []
    for room in ("distributed", "fsdp"):
        for file in sorted((ROOT / "meshpar" / room).rglob("*.py")):
            found += mutable_state(file.read_text(), str(file.relative_to(ROOT)))
    assert not found, ("module-level mutable state (make it state of the run, the mesh or the simulation, "
                       "or list a pure function's cache in ALLOWED with its reason):\n" + "\n".join(found))
    for path, name in ALLOWED:  # no stale entry
        assert name in (ROOT / path).read_text(), (path, name)


def test_the_scan_finds_planted_state():
    source = ("import threading\nfrom collections import deque\n_a: list[int] = []\n_b = {'x': 1}\n"
              "_c = deque(maxlen=3)\n_d = threading.local()\nTABLE = frozenset({1})\n__all__ = ['f']\n"
              "class K:\n    cache = {}\n    def f(self):\n        x = []\n"
              "def g():\n    global _a\n    _a = [1]\n"
              "from contextvars import ContextVar\n"
              "_e = ContextVar('e', default=[])\n_f = ContextVar('f', default=())\n")
    found = {line.split(" ", 1)[1] for line in mutable_state(source, "planted.py")}
    assert found == {"_a", "_b", "_c", "_d", "cache", "global _a", "_e"}, found
