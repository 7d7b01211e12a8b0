"""``meshpar.fsdp`` is a drop-in for the FSDP2 API of the installed torch's ``torch.distributed.fsdp``.

Checked by reading both APIs with ``inspect`` (no process group), so a torch upgrade that
adds or changes a name fails here until meshpar follows; most of the file's time is the one
1-rank gloo job that the exceptions' test spawns:

- every FSDP2 public name (the package's public names, submodules included, minus the
  ``FSDP1`` list below) exists in ``meshpar.fsdp`` and in its ``__all__``, as a class where
  torch's is a class;
- every public method of those classes that is not an ``nn.Module`` method (``FSDPModule``'s
  ``unshard``, ``set_*``, ...; ``UnshardHandle.wait``) exists in meshpar's class;
- signatures are compatible: every parameter of torch's is in meshpar's with the same name,
  kind and default (defaults compared by value; a dataclass default such as
  ``MixedPrecisionPolicy()`` by class name and field values), positional parameters in
  torch's order; meshpar may add only keyword-only parameters with a default
  (``fully_shard``'s ``shard_threshold=0``). Annotations are not compared;
- the policy dataclasses have torch's fields (names, defaults) and frozenness, and
  ``CPUOffloadPolicy`` subclasses ``OffloadPolicy``.

Each test lists every missing or mismatched name at once.

Signatures have no exceptions: meshpar accepts every call torch accepts. Where it cannot do
what torch does (a GPU-only feature), the method raises ``NotImplementedError`` naming why,
and that is an exception to document. To add one:

1. add ``"Class.method": "why"`` to ``EXCEPTIONS``;
2. add to ``REFUSED_CALLS`` the call that raises (and any calls that are still accepted), with
   a pattern its message must match; ``test_exception_raises_not_implemented`` runs it on a
   ``fully_shard``-ed module in a 1-rank gloo job;
3. name the method, with the reason, in docs/fsdp.md's API table (``test_docs_name_every_exception``).
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import meshpar.fsdp as meshpar_fsdp
from tests.distributed import CaseSet

# Qualified name -> why meshpar's behaviour differs from torch's (the signature does not).
EXCEPTIONS: dict[str, str] = {
    "FSDPModule.set_symm_mem_for_comm":
        "NCCL symmetric memory for the collectives' buffers is a GPU feature meshpar does not have: "
        "raises NotImplementedError",
    "FSDPModule.set_allocate_memory_from_process_group_for_comm":
        "allocating communication buffers from the process group's allocator is not supported: "
        "enable=True raises NotImplementedError (False, the default behaviour, is accepted)",
}

# Qualified name -> (argument tuples accepted without error, the arguments that raise
# NotImplementedError, a pattern its message must match: the reason, named).
REFUSED_CALLS: dict[str, tuple[list[tuple], tuple, str]] = {
    "FSDPModule.set_symm_mem_for_comm": ([], (), r"(?i)symmetric memory"),
    "FSDPModule.set_allocate_memory_from_process_group_for_comm": ([(False,)], (True,), r"(?i)process.?group"),
}

# FSDP1: the FullyShardedDataParallel wrapper and what belongs to it, out of scope. A name of
# torch.distributed.fsdp in neither this list nor meshpar.fsdp fails the test until it is
# classified here or ported.
FSDP1 = frozenset({
    "FullyShardedDataParallel", "ShardingStrategy", "StateDictType", "MixedPrecision", "CPUOffload",
    "BackwardPrefetch", "FlatParameter", "OptimStateKeyType",
    "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig", "ShardedStateDictConfig",
    "OptimStateDictConfig", "FullOptimStateDictConfig", "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig",
    "StateDictSettings",
    # submodules: FSDP1's implementation, its wrap policies and its fp16 ShardedGradScaler
    "api", "fully_sharded_data_parallel", "wrap", "sharded_grad_scaler",
})

ROOT = Path(__file__).resolve().parents[1]
_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _torch_public_names() -> set[str]:
    """``__all__``, public attributes and public submodules. Submodules are read from the
    package's folder: which are attributes depends on what else the process imported."""
    attrs = {n for n, v in vars(torch_fsdp).items() if not n.startswith("_") and not isinstance(v, ModuleType)}
    modules = {m.name for m in pkgutil.iter_modules(torch_fsdp.__path__) if not m.name.startswith("_")}
    return set(torch_fsdp.__all__) | attrs | modules


FSDP2 = sorted(_torch_public_names() - FSDP1)
CLASSES = [n for n in FSDP2 if inspect.isclass(getattr(torch_fsdp, n))]
DATACLASSES = [n for n in CLASSES if dataclasses.is_dataclass(getattr(torch_fsdp, n))]


def _methods(cls: type) -> list[str]:
    """Public methods and properties of ``cls`` that ``nn.Module`` does not have."""
    out = []
    for name in dir(cls):
        if name.startswith("_") or hasattr(nn.Module, name):
            continue
        attr = inspect.getattr_static(cls, name)
        if inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod, property)):
            out.append(name)
    return out


def _pairs() -> tuple[list[tuple[str, object, object]], list[str]]:
    """(qualified name, torch's object, meshpar's) for everything both have; and what meshpar lacks."""
    pairs, missing = [], []
    for name in FSDP2:
        ours = getattr(meshpar_fsdp, name, None)
        if ours is None:
            missing.append(name)
            continue
        pairs.append((name, getattr(torch_fsdp, name), ours))
        if name in CLASSES and inspect.isclass(ours):
            for method in _methods(getattr(torch_fsdp, name)):
                qual = f"{name}.{method}"
                if inspect.getattr_static(ours, method, None) is None:
                    missing.append(qual)
                else:
                    pairs.append((qual, inspect.getattr_static(getattr(torch_fsdp, name), method),
                                  inspect.getattr_static(ours, method)))
    return pairs, missing


def _default(value: object) -> object:
    """A default comparable across the two engines: dataclass instances by class name and fields."""
    if value is _EMPTY:
        return "<no default>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("dataclass", type(value).__name__, dataclasses.asdict(value))
    return (type(value).__name__, value)


def _show(value: object) -> str:
    return "required" if value is _EMPTY else f"default {value!r}"


def signature_mismatches(qual: str, theirs: object, ours: object) -> list[str]:
    """Why a call written for torch's ``theirs`` might not work with ``ours``; [] if none."""
    if isinstance(theirs, property) or isinstance(ours, property):
        same = isinstance(theirs, property) == isinstance(ours, property)
        return [] if same else [f"{qual}: a {type(ours).__name__}, torch's is a {type(theirs).__name__}"]
    if type(theirs) is not type(ours) and (isinstance(theirs, (staticmethod, classmethod))
                                          or isinstance(ours, (staticmethod, classmethod))):
        return [f"{qual}: a {type(ours).__name__}, torch's is a {type(theirs).__name__}"]
    if inspect.isclass(theirs) != inspect.isclass(ours):
        what = lambda o: "a class" if inspect.isclass(o) else "a function"
        return [f"{qual}: {what(ours)}, torch's is {what(theirs)}"]
    if inspect.isclass(theirs) and not dataclasses.is_dataclass(theirs):
        return []  # FSDPModule, UnshardHandle: made by fully_shard and unshard, not called by users
    unwrap = lambda o: o.__func__ if isinstance(o, (staticmethod, classmethod)) else o
    try:
        t, o = inspect.signature(unwrap(theirs)), inspect.signature(unwrap(ours))
    except (TypeError, ValueError) as e:
        return [f"{qual}: no signature to compare ({e})"]
    out = []
    for name, p in t.parameters.items():
        q = o.parameters.get(name)
        if q is None:
            out.append(f"{qual}: lacks parameter {name!r} ({p.kind.description}, {_show(p.default)})")
            continue
        if q.kind != p.kind:
            out.append(f"{qual}({name}): {q.kind.description}, torch's is {p.kind.description}")
        if _default(q.default) != _default(p.default):
            out.append(f"{qual}({name}): {_show(q.default)}, torch's: {_show(p.default)}")
    for name, q in o.parameters.items():
        if name not in t.parameters and (q.kind != inspect.Parameter.KEYWORD_ONLY or q.default is _EMPTY):
            out.append(f"{qual}({name}): an added parameter must be keyword-only with a default; it is "
                       f"{q.kind.description}, {_show(q.default)}")
    order = lambda s: [n for n, p in s.parameters.items() if p.kind in _POSITIONAL]
    if sorted(order(t)) == sorted(order(o)) and order(t) != order(o):
        out.append(f"{qual}: positional parameters {order(o)}, torch's are in the order {order(t)}")
    return out


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what} (torch.distributed.fsdp -> meshpar.fsdp):\n  " + "\n  ".join(problems)


def test_the_fsdp2_names_are_those_of_torch_not_fsdp1():
    """Guards the rest against a vacuous pass: the set computed from torch holds the core API."""
    assert {"fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy"} <= set(FSDP2), FSDP2
    assert _methods(torch_fsdp.FSDPModule), "torch's FSDPModule has no public methods? _methods is broken"
    assert "unshard" in _methods(torch_fsdp.FSDPModule) and "forward" not in _methods(torch_fsdp.FSDPModule)


def test_every_fsdp2_name_and_method_exists_in_meshpar():
    _, missing = _pairs()
    exported = set(getattr(meshpar_fsdp, "__all__", ()))
    unexported = [f"{n} (in torch's __all__, not in meshpar.fsdp.__all__)" for n in FSDP2
                  if n in torch_fsdp.__all__ and n not in missing and n not in exported]
    problems = [f"{n} missing" for n in missing] + unexported
    assert not problems, _report(problems, "FSDP2 name(s) or method(s) missing")


def test_every_signature_is_compatible_with_torch():
    pairs, _ = _pairs()
    assert pairs
    problems = [m for qual, theirs, ours in pairs for m in signature_mismatches(qual, theirs, ours)]
    assert not problems, _report(problems, "signature mismatch(es)")


def _field_default(f: dataclasses.Field) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _EMPTY if f.default is dataclasses.MISSING else f.default


def dataclass_mismatches(name: str, theirs: type, ours: type) -> list[str]:
    """How dataclass ``ours`` differs from ``theirs`` in fields (names, defaults) and frozenness."""
    if not dataclasses.is_dataclass(ours):
        return [f"{name}: not a dataclass"]
    ours_fields = {f.name: f for f in dataclasses.fields(ours)}
    problems = []
    for f in dataclasses.fields(theirs):
        mine = ours_fields.get(f.name)
        if mine is None:
            problems.append(f"{name}.{f.name} missing")
        elif _default(_field_default(mine)) != _default(_field_default(f)):
            problems.append(f"{name}.{f.name}: {_show(_field_default(mine))}, torch's: {_show(_field_default(f))}")
    frozen = [c.__dataclass_params__.frozen for c in (theirs, ours)]
    if frozen[0] != frozen[1]:
        problems.append(f"{name}: frozen={frozen[1]}, torch's is frozen={frozen[0]}")
    return problems


@pytest.mark.parametrize("name", DATACLASSES)
def test_policy_dataclass_matches_torch(name):
    ours = getattr(meshpar_fsdp, name, None)
    if ours is None:
        pytest.fail(f"meshpar.fsdp.{name} is missing", pytrace=False)
    problems = dataclass_mismatches(name, getattr(torch_fsdp, name), ours)
    assert not problems, _report(problems, f"difference(s) in the {name} dataclass")


def test_the_dataclass_check_catches_fields_defaults_and_frozenness():
    @dataclasses.dataclass
    class Theirs:
        a: int = 1
        b: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Ours:
        a: bool = True
        c: int = 0

    assert dataclass_mismatches("P", Theirs, Theirs) == []
    assert dataclass_mismatches("P", Theirs, Ours) == ["P.a: default True, torch's: default 1", "P.b missing",
                                                      "P: frozen=True, torch's is frozen=False"]


def test_cpu_offload_policy_is_an_offload_policy():
    assert issubclass(torch_fsdp.CPUOffloadPolicy, torch_fsdp.OffloadPolicy)
    missing = [n for n in ("CPUOffloadPolicy", "OffloadPolicy") if not hasattr(meshpar_fsdp, n)]
    assert not missing, f"meshpar.fsdp lacks {missing}"
    assert issubclass(meshpar_fsdp.CPUOffloadPolicy, meshpar_fsdp.OffloadPolicy)


def test_the_signature_check_catches_each_kind_of_difference():
    theirs_mp, ours_mp = torch_fsdp.MixedPrecisionPolicy(), meshpar_fsdp.MixedPrecisionPolicy()
    ours_mp_no_cast = meshpar_fsdp.MixedPrecisionPolicy(cast_forward_inputs=False)

    def torch_like(self, a, b=1, *, c=theirs_mp, d=True):
        pass

    def renamed(self, a, bb=1, *, c=theirs_mp, d=True):
        pass

    def kinds_and_defaults(self, a, *, b=1, c=ours_mp_no_cast, d=1):
        pass

    def added(self, a, b=1, e=0, *, c=ours_mp, d=True, f=None, g):
        pass

    def swapped(a, self, b=1, *, c=theirs_mp, d=True):
        pass

    def compatible(self, a, b=1, *, c=ours_mp, d=True, shard_threshold=0):
        pass

    assert signature_mismatches("f", torch_like, compatible) == []
    found = {bug: signature_mismatches("f", torch_like, ours) for bug, ours in
             [("renamed", renamed), ("kinds_and_defaults", kinds_and_defaults), ("added", added),
              ("swapped", swapped)]}
    assert found["renamed"] == ["f: lacks parameter 'b' (positional or keyword, default 1)",
                                "f(bb): an added parameter must be keyword-only with a default; it is "
                                "positional or keyword, default 1"], found["renamed"]
    assert len(found["kinds_and_defaults"]) == 3, found["kinds_and_defaults"]  # b's kind, c's fields, d: 1 != True
    assert [m.split(":")[0] for m in found["added"]] == ["f(e)", "f(g)"], found["added"]
    assert found["swapped"] == ["f: positional parameters ['a', 'self', 'b'], torch's are in the order "
                                "['self', 'a', 'b']"], found["swapped"]


def test_exceptions_name_torch_methods_and_each_has_a_refused_call():
    assert set(EXCEPTIONS) == set(REFUSED_CALLS), "each exception needs its call in REFUSED_CALLS, and vice versa"
    stale = [q for q in EXCEPTIONS if q.split(".")[0] not in FSDP2
             or not hasattr(getattr(torch_fsdp, q.split(".")[0]), q.split(".")[1])]
    assert not stale, f"EXCEPTIONS names what torch.distributed.fsdp's FSDP2 API does not have: {stale}"


def test_docs_name_every_exception():
    page = (ROOT / "docs" / "fsdp.md").read_text()
    undocumented = [q for q in EXCEPTIONS if q.rsplit(".", 1)[-1] not in page]
    assert not undocumented, (f"docs/fsdp.md does not name {len(undocumented)} exception(s) to torch's FSDP2 API; "
                              f"add each, with its reason, to its API table: {undocumented}")


def _setup(tmp):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))


def _refused_call(qual: str, mesh) -> str | None:
    """Calls the accepted arguments (they must not raise), then the refused ones; the
    NotImplementedError's message, or None if nothing was raised."""
    module = meshpar_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    method = getattr(module, qual.split(".")[1])
    accepted, refused, _ = REFUSED_CALLS[qual]
    for args in accepted:
        method(*args)
    try:
        method(*refused)
    except NotImplementedError as e:
        return str(e)
    return None


REFUSALS = CaseSet({qual: (lambda mesh, qual=qual: _refused_call(qual, mesh), 1) for qual in REFUSED_CALLS},
                   setup=_setup, timeout=60)


@pytest.mark.parametrize("qual", sorted(REFUSED_CALLS))
def test_exception_raises_not_implemented(qual):
    """Behaviour, not signature: the documented exception raises NotImplementedError naming why
    (on a 1-rank gloo job), and still accepts the calls that it supports."""
    _, refused, pattern = REFUSED_CALLS[qual]
    [message] = REFUSALS.check(qual, 1)
    call = f"{qual}({', '.join(map(repr, refused))})"
    assert message is not None, f"{call} returned; it must raise NotImplementedError ({EXCEPTIONS[qual]})"
    assert re.search(pattern, message), f"{call}'s message does not name the reason ({pattern}): {message!r}"
