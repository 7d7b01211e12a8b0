"""Replica groups that heal while the others train: ``fault.replicas = "torchft"``.

    groups = ReplicaGroups.for_run(recipe, run, step, device, timeout)   # None unless fault.replicas = "torchft"
    step = groups.advance(step, on_heal)  # every step: this step's quorum (a group behind heals first)
    groups.average(grads)               # after the group's own reduction: the mean over the quorum
    if not groups.commit(): ...         # the step is redone with the same batch
    groups.close()

[Note: replica groups under torchft]
``parallel.dp_replicate`` groups, each its own job (one ``meshpar train`` or torchrun per group),
each training the same layout of ``world / dp_replicate`` ranks with meshpar's own FSDP inside.
Group rank r of every group holds the same shards, so rank r of each group joins one torchft
process group and the groups' gradients average shard by shard: one all-reduce per dtype over a
flat copy of the rank's local gradients, after the group's reduce-scatter, before clipping (every
group then clips and steps on the same numbers). torchft's ``Manager`` runs each step's quorum
through the lighthouse: the groups alive join it, the all-reduce divides by the groups that took
part, and each group's gradient is already the mean over its own tokens (equal counts), so the
step's gradient is the mean over the tokens the quorum trained, however many groups it has.
A group whose step is behind the quorum's (restarted after a fault, from its own checkpoint or
from step 0) receives, rank by rank over HTTP from a live group, the local shards of the
parameters, the optimizer state, the LR schedule and the data position, and joins the same step.
A step whose all-reduce failed (a peer died inside it) is not committed by any group in it; the
loop gives its batch back and runs that step again. Data: the data-parallel rank of a group's
rank is ``replica_id * group dp + its dp rank`` over the whole job's dp, so a step trains the
slices of the groups in its quorum; a missing group's slice of that step is skipped, never
repeated (docs/cluster.md, "Replica groups").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpar.config.keys import FaultConfig, Recipe
from meshpar.config.recipe import RecipeError
from meshpar.distributed._torch import dtensor_like, local_tensor
from meshpar.distributed.mesh import Layout
from meshpar.runtime.atomic import write_atomic

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse's address


def managed(recipe: Recipe) -> bool:
    """Whether torchft manages ``parallel.dp_replicate`` (each replica group its own job)."""
    return recipe.fault.replicas == "torchft"


def group_layout(recipe: Recipe, layout: Layout) -> Layout:
    """The layout one job builds its mesh with: the whole layout, or under torchft one replica group's."""
    return dataclasses.replace(layout, dp_replicate=1) if managed(recipe) else layout


def group_recipe(recipe: Recipe) -> Recipe:
    """Under torchft each group writes its own metrics and checkpoints: ``train.output_dir`` and
    ``checkpoint.dir`` (when set) gain ``replica_<id>/``; otherwise ``recipe`` unchanged."""
    if not managed(recipe):
        return recipe
    sub = f"replica_{recipe.fault.replica_id}"
    t, c = recipe.train, recipe.checkpoint
    train = dataclasses.replace(t, output_dir=os.path.join(t.output_dir, sub)) if t.output_dir else t
    checkpoint = dataclasses.replace(c, dir=os.path.join(c.dir, sub)) if c.dir else c
    return dataclasses.replace(recipe, train=train, checkpoint=checkpoint)


FINISHED = "replica_finished.json"  # in a group's output folder once it trained the run's last step


def mark_finished(recipe: Recipe, step: int) -> None:
    """Rank 0 of a group that trained the last step: say so in its folder, for a group that comes
    back after the others are done (``finished_elsewhere``)."""
    write_atomic(Path(recipe.train.output_dir) / FINISHED, json.dumps({"step": step}))


def nothing_left(recipe: Recipe, announce: bool) -> bool:
    """Whether another group already trained the run to its end (``finished_elsewhere``); says so
    when ``announce``."""
    done_by = finished_elsewhere(recipe)
    if done_by is not None and announce:
        print(f"meshpar: replica group {recipe.fault.replica_id}: the run is done ({done_by} trained step "
              f"{recipe.train.steps}); nothing left for this group", flush=True)
    return done_by is not None


def finished_elsewhere(recipe: Recipe) -> Path | None:
    """Under torchft, another group's folder that says it trained ``train.steps``: a group that
    restarts after the others finished has no quorum to join and nothing left to train."""
    if not managed(recipe) or not recipe.train.output_dir:
        return None
    job = Path(recipe.train.output_dir).parent
    for g in range(recipe.parallel.dp_replicate):
        marker = job / f"replica_{g}" / FINISHED
        if g != recipe.fault.replica_id and marker.is_file():
            with contextlib.suppress(ValueError, KeyError):
                if json.loads(marker.read_text())["step"] >= recipe.train.steps:
                    return marker.parent
    return None


def lighthouse_address(fault: FaultConfig) -> str:
    """``fault.lighthouse``, else the environment's, else a RecipeError saying how to start one."""
    address = fault.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise RecipeError(f"fault.replicas = \"torchft\" needs a lighthouse: start `meshpar lighthouse` and set "
                          f"fault.lighthouse (or {LIGHTHOUSE_ENV}) to the address it prints", "fault.lighthouse")
    return address if "://" in address else f"http://{address}"


class QuorumLost(RuntimeError):
    """No quorum within the wait (the lighthouse gone or out of reach). ``intact``: this rank's
    state is still its last committed step's (no heal had begun), so the group may save it."""

    def __init__(self, message: str, intact: bool):
        super().__init__(message)
        self.intact = intact


class ReplicaGroups:
    """This rank's seat in the replica groups: torchft's Manager and its cross-group process group."""

    WAIT_INTERVAL_S = 0.5  # between the quorums of a group waiting for the others at its start

    def __init__(self, manager: Any, store: dist.Store | None, groups: int, wait_s: float, address: str,
                 wait: datetime.timedelta):
        self.manager, self.groups, self.address, self.wait = manager, groups, address, wait
        self.healing = False  # set once a live group's state starts to load into this rank's run
        self._store = store  # group rank 0 hosts the store the group's managers meet in: kept alive
        # quorums left to wait for every group in at the start: a count, not a clock, so that every
        # rank of the group (which sees the same quorums) stops waiting at the same one
        self._waits = math.ceil(wait_s / self.WAIT_INTERVAL_S)

    @classmethod
    def join(cls, fault: FaultConfig, groups: int, heal_state: Callable[[], dict],
             load_heal_state: Callable[[dict], None], *, step: int, device: torch.device,
             timeout: datetime.timedelta) -> ReplicaGroups:
        """Every rank of the group, after its own process group and before the first step: this
        rank's Manager among ``groups`` replica groups, at ``step`` (the group's checkpoint, or 0).
        ``heal_state`` gives what a group behind receives; ``load_heal_state`` takes it in."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum and commit at info: RUST_LOG=info
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ImportError as e:
            raise RecipeError("fault.replicas = \"torchft\" needs torchft, which is not installed: pip install "
                              "'meshpar[ft]'", "fault.replicas") from e
        if device.type != "cuda":  # torchft warns at each new quorum that it cannot reset NCCL's recorder
            logging.getLogger("torchft.manager").addFilter(_quiet_without_nccl)
        rank, world = dist.get_rank(), dist.get_world_size()
        store, host, port = _group_store()
        # The groups' all-reduce fails after ``timeout`` (fault.timeout) when a peer hangs; the
        # group's own vote and quorum wait longer: a rank whose peer died still sits in that
        # all-reduce while the others of its group already vote, and a group with a hung rank
        # stays in the lighthouse's view (heartbeating) until its own collectives time out.
        # (fault.quorum_timeout, when set, is checked to exceed 2 x fault.timeout: config/recipe.py)
        waits = (datetime.timedelta(seconds=fault.quorum_timeout) if fault.quorum_timeout
                 else 2 * timeout + datetime.timedelta(seconds=60))
        address = lighthouse_address(fault)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        seat: ReplicaGroups | None = None

        def load(state: dict) -> None:
            seat.healing = True  # from here until the step commits, this rank's state may be half a live group's
            load_heal_state(state)

        manager = Manager(pg=pg, load_state_dict=load, state_dict=heal_state,
                          min_replica_size=fault.min_replicas, use_async_quorum=False, init_sync=False,
                          timeout=waits, quorum_timeout=waits, connect_timeout=timeout, rank=rank,
                          world_size=world, store_addr=host, store_port=port,
                          lighthouse_addr=address if rank == 0 else None,
                          replica_id=f"meshpar_replica_{fault.replica_id}")
        manager.load_state_dict({"step": step, "batches_committed": 0})
        seat = cls(manager, store, groups, fault.replica_wait, address, waits)
        return seat

    @classmethod
    def for_run(cls, recipe: Recipe, run: Any, step: int, device: torch.device,
                timeout: datetime.timedelta) -> ReplicaGroups | None:
        """Under ``fault.replicas = "torchft"`` this rank's seat, at the step its group resumed
        from; a group behind receives ``run`` (a meshpar.checkpoint.RunState: model state,
        optimizer, LR schedule, data loader) from a live one. None otherwise."""
        if not managed(recipe):
            return None
        parts = (run.model_state, run.optimizer, run.scheduler, run.loader)
        return cls.join(recipe.fault, recipe.parallel.dp_replicate, lambda: heal_state(*parts),
                        lambda state: load_heal_state(state, *parts), step=step, device=device, timeout=timeout)

    def advance(self, step: int, on_heal: Callable[[int], None]) -> int:
        """The step to train after ``step``: the quorum's. When this group was behind, it has just
        received a live group's state at the quorum's step, and ``on_heal`` gets that step."""
        following = self.next_step()
        if following != step + 1:
            on_heal(following - 1)
        return following

    def next_step(self) -> int:
        """This step's quorum (a collective with the groups alive; a group behind heals inside it):
        the number of the step to train, one past the step the quorum has committed. The first
        quorum is asked again until every group is in it or ``fault.replica_wait`` has passed.
        QuorumLost when the lighthouse gives none within the wait."""
        try:
            self.manager.start_quorum()
            while self._waits > 0 and self.manager.num_participants() < self.groups:
                self._waits -= 1
                time.sleep(self.WAIT_INTERVAL_S)
                self.manager.start_quorum()
        except TimeoutError as e:  # torchft's quorum call past its timeout
            raise QuorumLost(f"no quorum from the lighthouse at {self.address} within {self.wait} ({e}): is "
                             f"`meshpar lighthouse` still running there?", intact=not self.healing) from e
        self._waits = 0
        self.healing = False
        return self.manager.current_step() + 1

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def average(self, params: list[torch.Tensor]) -> None:
        """Each parameter's gradient (its local shard) set to the mean over the quorum's groups:
        one all-reduce per dtype over a flat copy. After a failed all-reduce the gradients are
        unusable, and ``commit`` says so."""
        grads = [g for g in (_local(p.grad) for p in params if p.grad is not None)]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        flats = [(torch.cat([g.reshape(-1) for g in group]), group) for group in by_dtype.values()]
        works = [self.manager.allreduce(flat) for flat, _ in flats]
        for work in works:
            work.wait()
        for flat, group in flats:
            for g, part in zip(group, flat.split([g.numel() for g in group]), strict=True):
                g.copy_(part.view_as(g))

    def mean(self, x: torch.Tensor) -> None:
        """``x`` (a float tensor, the same shape on every group) in place: the mean over the quorum's
        groups. For metrics, after the step committed: a peer lost inside it leaves ``x`` wrong for
        this record and changes no weight (the next quorum starts afresh)."""
        self.manager.allreduce(x).wait()

    def commit(self) -> bool:
        """Whether every rank of every group in the quorum may step (torchft's vote); False: redo the step."""
        return self.manager.should_commit()

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _quiet_without_nccl(record: logging.LogRecord) -> bool:
    return "NCCL flight recorder" not in record.getMessage()


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if isinstance(t, DTensor) else t


def _group_store() -> tuple[dist.Store | None, str, int]:
    """A store of this group's own for its managers, on group rank 0 at a free port, the address
    broadcast over the group: torchelastic's store outlives a restart, and a manager of the new
    attempt could read the dead one's address there ([Note: one store, many attempts] in
    meshpar/runtime/process.py)."""
    store, shared = None, [None]
    if dist.get_rank() == 0:
        host = os.environ.get("MASTER_ADDR", "localhost")
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        shared = [(host, store.port)]
    dist.broadcast_object_list(shared, src=0)
    host, port = shared[0]
    return store, host, port


# --- what a group behind receives: this rank's local shards, as plain tensors ------------------------
def heal_state(model_state: Callable[[], dict[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
               scheduler: Any, loader: Any) -> dict[str, Any]:
    """This rank's part of the run, without DTensors: group rank r of every group holds the same
    shards, so the local tensors are what rank r of a group behind needs."""
    optim = optimizer.state_dict()
    state = {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in optim["state"].items()}
    return {"model": {k: _local(v).detach() for k, v in model_state().items()},
            "optim": {"state": state, "param_groups": optim["param_groups"]},
            "scheduler": scheduler.state_dict(), "loader": loader.state_dict()}


def load_heal_state(state: dict[str, Any], model_state: Callable[[], dict[str, torch.Tensor]],
                    optimizer: torch.optim.Optimizer, scheduler: Any, loader: Any) -> None:
    """``heal_state`` of a live group's same rank, into this rank's run (in place for the model;
    the optimizer's state rebuilt as DTensors placed as their parameters)."""
    with torch.no_grad():
        for name, value in model_state().items():
            _local(value).copy_(state["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state = {}
    for i, s in state["optim"]["state"].items():
        p = params[i]
        optim_state[i] = {k: dtensor_like(v, p) if isinstance(p, DTensor) and isinstance(v, torch.Tensor)
                          and v.shape == _local(p).shape else v for k, v in s.items()}
    optimizer.load_state_dict({"state": optim_state, "param_groups": state["optim"]["param_groups"]})
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])


# --- the lighthouse: the quorum's coordinator, one per job ---------------------------------------------
def serve_lighthouse(port: int, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> int:
    """``meshpar lighthouse``: serve until SIGTERM or Ctrl-C. A quorum forms once ``min_replicas``
    groups asked for one, waiting ``join_timeout_ms`` for more; a group silent for
    ``heartbeat_timeout_ms`` is left out of the next one."""
    import signal
    import threading

    os.environ.setdefault("RUST_LOG", "warn")  # a line per quorum at info: RUST_LOG=info shows them
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise RecipeError("meshpar lighthouse needs torchft, which is not installed: pip install 'meshpar[ft]'") \
            from None
    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              heartbeat_timeout_ms=heartbeat_timeout_ms)
    print(f"meshpar: lighthouse at {server.address()} (min_replicas {min_replicas}); set fault.lighthouse = "
          f"\"{server.address()}\" or {LIGHTHOUSE_ENV}={server.address()} for each replica group", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
    return 0
