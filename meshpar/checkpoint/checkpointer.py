"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): save, resume, reshard.

A checkpoint is a folder ``<dir>/step_<N>/``: DCP's ``.metadata`` and ``.distcp`` chunks,
``crc/<rank>.json``, ``recipe.toml``, the run's tokenizer files and ``meshpar.json`` (written
last). It holds one nested state dict: ``model.*``, ``optim.*``, ``lr_schedule.*``, ``data.*``,
``train.*``, ``rng.rank<r>``. File by file: docs/checkpoints.md#what-a-checkpoint-holds.

Saving writes this rank's shards only: no collective beyond DCP's own plan and metadata
exchange. Loading reads, on every rank, exactly the pieces of each tensor its own DTensors
cover, so a checkpoint saved on any layout loads on any other (``model.*`` and ``optim.*``
by global name and shape; the data position by global sample count, see meshpar/data/).
The files themselves (per-chunk CRCs, fused projections as chunks): format.py; finding
checkpoints on disk: folders.py; a run's tensors by global name: state.py; saving in the
background (``checkpoint.async``: a thread or a writer process): background.py; how a save
becomes visible, and what ``checkpoint.keep`` then deletes: publish.py.

Notes: [Note: the checkpoint folder is probed before the first step]; in publish.py
[Note: a checkpoint is complete or invisible], [Note: what checkpoint.keep deletes].
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from meshpar.checkpoint.background import Background
from meshpar.checkpoint.folders import is_complete, latest, read_info
from meshpar.checkpoint.format import (  # noqa: F401 - _Writer: tests patch it here
    CheckpointError,
    SafeReader,
    _CheckedLoadPlanner,
    _SavePlanner,
    _strided_as_pieces,
    _StridedPieces,
    _Writer,
)
from meshpar.checkpoint.publish import Publish, prune
from meshpar.checkpoint.state import _rng_state, optimizer_state, param_names
from meshpar.config.recipe import CheckpointConfig, RecipeError

# [Note: the checkpoint folder is probed before the first step]
# A run that saves would otherwise learn that ``checkpoint.dir`` is read-only, full or not a folder
# at its first save, hours in. So the Checkpointer, when ``checkpoint.every > 0``, creates the folder
# and a small file in it (written, fsynced, removed) as it is built, and raises a CheckpointError
# naming the folder, the OS's reason and the fix. Every rank probes (``.write_probe.rank<r>``),
# without a collective: each rank writes its own shards there, and on a cluster one node may lack
# the mount or see it read-only. A failed probe fails that rank at once, and the launcher stops the
# others. A disk that fills later still fails at save time, cleanly.



FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a tokenizer as Hugging Face folders hold it


# --- the checkpointer a training run uses ---------------------------------------------------------------
@dataclasses.dataclass
class RunState:
    """What a checkpoint holds beyond the weights: the objects the training loop owns."""

    stages: nn.ModuleList
    model_state: Callable[[], dict[str, torch.Tensor]]  # name -> parameter (DTensor when sharded), taken
    # afresh for each save and load: values that share the parameters' storage, this rank's stages
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    loader: Any  # meshpar.data.BatchLoader


class Checkpointer:
    """Saves every ``checkpoint.every`` steps into ``<dir>/step_<N>/`` and resumes from the newest.

    ``info`` is what ``meshpar.json`` records about the run (family, size, model_args, layout,
    world_size); ``recipe_toml`` the resolved recipe; ``tokenizer_files`` the run's tokenizer
    (``tokenizer.hf_files()``: name in TOKENIZER_FILES -> bytes; empty for none), written into
    every checkpoint. One per rank; every rank calls ``save`` and ``load`` (they are collective
    through DCP).
    """

    def __init__(self, cfg: CheckpointConfig, root: Path, *, rank: int, world_size: int, info: dict[str, Any],
                 recipe_toml: str, tokenizer_files: Mapping[str, bytes] | None = None, log=print):
        self.cfg, self.root, self.rank, self.world_size = cfg, root, rank, world_size
        self.info, self.recipe_toml, self.log = info, recipe_toml, log
        self.tokenizer_files = dict(tokenizer_files or {})
        unknown = sorted(set(self.tokenizer_files) - set(TOKENIZER_FILES))
        if unknown:
            raise ValueError(f"tokenizer_files: {unknown} are not tokenizer files ({', '.join(TOKENIZER_FILES)})")
        self._pending: Future | None = None  # the async save in flight: done once committed
        self._background: Background | None = None
        if cfg.async_mode is not None:
            # async saves run DCP's collectives (the plan; in a writer process, its set-up) on a
            # background thread: they get their own gloo group so they never interleave with the
            # training step's collectives
            group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._background = Background(cfg.async_mode, group)
        if cfg.every:
            self._probe()

    def _probe(self) -> None:
        """Fail now if this rank cannot write into ``root`` ([Note: the checkpoint folder is probed
        before the first step])."""
        probe = self.root / f".write_probe.rank{self.rank}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, bytes(4096))  # one block: a full disk refuses it here or at the fsync
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            where = f" at {e.filename}" if e.filename and Path(e.filename) not in (self.root, probe) else ""
            raise CheckpointError(f"checkpoint.dir {self.root} is not writable on rank {self.rank}: "
                                  f"{e.strerror or e}{where}; the run saves there (checkpoint.every = "
                                  f"{self.cfg.every}): set checkpoint.dir to a writable folder with room for its "
                                  f"checkpoints") from e

    # --- save ---------------------------------------------------------------------------------------
    def state_dict(self, run: RunState, step: int) -> dict[str, Any]:
        names = param_names(run.stages)
        return {
            "model": _strided_as_pieces(run.model_state(), "model"),
            "optim": _strided_as_pieces(optimizer_state(run.optimizer, names), "optim"),
            "lr_schedule": run.scheduler.state_dict(),
            "data": run.loader.state_dict(),
            "train": {"step": step},
            "rng": {f"rank{self.rank}": _rng_state()},
        }

    def save(self, run: RunState, step: int, *, blocking: bool = False) -> None:
        """Write step ``step``; with ``checkpoint.async``, let the previous save finish first and
        return once the state is copied to host (or shared) memory. ``blocking``: write it from this
        thread whatever ``checkpoint.async`` says (the save on a stop signal: no copy, no writer)."""
        self.wait()
        partial = self.root / f".step_{step}.partial"
        start = time.perf_counter()
        state = self.state_dict(run, step)
        info = dict(self.info, format=FORMAT, step=step, world_size=self.world_size)
        writer = _Writer(partial, self.rank, publish=Publish(self.root, step, self.recipe_toml, self.tokenizer_files,
                                                             info))
        if self._background is None or blocking:
            try:
                dcp.save(state, storage_writer=writer, planner=_SavePlanner())
            except CheckpointException as e:
                raise self._save_failed(step, partial, e) from e
            self._saved(step, start)
            return
        upload = self._background.start(state, writer, _SavePlanner())
        committed: Future = Future()

        def finished(done: Future) -> None:  # on DCP's executor thread, as soon as the upload ends
            try:
                try:
                    done.result()
                except (CheckpointException, Exception) as e:  # Exception: the writer process died
                    raise self._save_failed(step, partial, e) from e
                self._saved(step, start)
                committed.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                committed.set_exception(e)

        upload.add_done_callback(finished)
        self._pending = committed
        if self.rank == 0:
            where = "shared memory" if self.cfg.async_mode == "process" else "host memory"
            self.log(f"checkpoint: step {step} copied to {where} in {time.perf_counter() - start:.2f} s; writing "
                     f"in the background ({self.cfg.async_mode})")

    def wait(self) -> None:
        """Finish the save in flight, if any (its errors surface here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """End of the run, on every rank: stop the background writer (a save still in flight, after an
        error, is abandoned and stays invisible). Call ``wait`` first to keep the last save."""
        self._pending = None
        if self._background is not None:
            self._background.close()

    def _save_failed(self, step: int, partial: Path, e: BaseException) -> CheckpointError:
        """The error every rank raises for a failed save of ``step``; rank 0 removes its folder.
        ``e``: DCP's CheckpointException, or (a writer process that died) any error of this rank."""
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        failures = e.failures if isinstance(e, CheckpointException) else {self.rank: e}
        inner = _find_checkpoint_error(failures)
        if inner is not None:
            return inner
        causes = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in
                           sorted((r, _failure(f)) for r, f in failures.items()))
        previous = latest(self.root)
        kept = f"the newest complete checkpoint, {previous}, is untouched" if previous else "there is no earlier one"
        return CheckpointError(f"checkpoint: saving step {step} into {self.root} failed ({causes}); no step_{step} "
                               f"was made and {kept}: free space there, or set checkpoint.dir to a writable folder "
                               f"with room")

    def _saved(self, step: int, start: float) -> None:
        """Rank 0, after a save: report it, then apply ``keep``."""
        if self.rank != 0:
            return
        final = self.root / f"step_{step}"
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        seconds = time.perf_counter() - start
        self.log(f"checkpoint: saved {final} ({size / 2**20:,.1f} MiB in {seconds:.2f} s, "
                 f"{size / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
        prune(self.root, step, self.cfg.keep, protect=self._resume_target())

    def _resume_target(self) -> Path | None:
        """The resolved folder a restart of this run would resume from, if any."""
        try:
            path = self.resume_path()
        except RecipeError:  # load_from is gone: nothing to protect
            return None
        return path.resolve() if path is not None else None

    # --- load ---------------------------------------------------------------------------------------
    def resume_path(self) -> Path | None:
        """``checkpoint.load_from`` if set (it must exist), else the newest complete one in ``dir``."""
        if self.cfg.load_from:
            path = Path(self.cfg.load_from)
            if not path.is_dir():
                raise RecipeError(f"checkpoint.load_from = {str(path)!r}: no such folder; give a step_<N> folder "
                                  f"of a checkpoint dir", "checkpoint.load_from")
            if not is_complete(path) and latest(path) is not None:
                path = latest(path)  # a checkpoint dir: its newest complete checkpoint
            return path
        return latest(self.root)

    def remove_partial(self) -> None:
        """Rank 0: delete ``.partial`` folders that crashed saves left behind."""
        if self.rank == 0 and self.root.is_dir():
            for child in self.root.glob(".step_*.partial"):
                shutil.rmtree(child, ignore_errors=True)

    def load(self, path: Path, run: RunState) -> int:
        """Load ``path`` into the run (resharding to this layout); returns the step it was saved at."""
        start = time.perf_counter()
        saved = read_info(path)
        self._check_model(path, saved)
        exclude = set(self.cfg.exclude)
        names = param_names(run.stages)
        state: dict[str, Any] = {"model": _strided_as_pieces(run.model_state(), "model"), "train": {"step": 0}}
        if "optimizer" not in exclude:
            state["optim"] = _strided_as_pieces(optimizer_state(run.optimizer, names, create=True), "optim")
        if "lr_schedule" not in exclude:
            state["lr_schedule"] = run.scheduler.state_dict()
        if "data" not in exclude:
            state["data"] = run.loader.state_dict()
        metadata = SafeReader(path).read_metadata()
        # each rank's generator state, when this rank's is there (same world size, saved by training)
        same_ranks = f"rng.rank{self.rank}.cpu" in metadata.state_dict_metadata and \
            saved.get("world_size") == self.world_size
        if "rng" not in exclude and same_ranks:
            state["rng"] = {f"rank{self.rank}": _rng_state()}
        self._check_tensors(path, metadata, state)
        try:
            dcp.load(state, storage_reader=SafeReader(path), planner=_CheckedLoadPlanner(path))
        except CheckpointException as e:  # DCP wraps each rank's failure; ours is the message worth showing
            inner = _find_checkpoint_error(e.failures)
            if inner is not None:
                raise inner from None
            raise
        if "lr_schedule" in state:
            run.scheduler.load_state_dict(state["lr_schedule"])
            for group, lr in zip(run.optimizer.param_groups, run.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        if "data" in state:
            run.loader.load_state_dict(state["data"])
        if "rng" in state:
            rng = state["rng"][f"rank{self.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        step = int(state["train"]["step"])
        if self.rank == 0:
            layout = "x".join(f"{k} {v}" for k, v in saved.get("layout", {}).items() if v > 1) or "1 rank"
            skipped = sorted(exclude) + ([] if same_ranks or "rng" in exclude else
                                         ["rng (none saved for this rank on this world size)"])
            note = f"; not loaded: {', '.join(skipped)}" if skipped else ""
            self.log(f"checkpoint: resumed from {path} at step {step} (saved on {layout}) in "
                     f"{time.perf_counter() - start:.2f} s{note}")
        return step

    def _check_model(self, path: Path, saved: dict[str, Any]) -> None:
        mine = self.info
        for key in ("family", "model_args"):
            if saved.get(key) != mine.get(key):
                if key == "model_args":
                    diff = {k: (saved[key].get(k), v) for k, v in mine[key].items() if saved[key].get(k) != v}
                    what = ", ".join(f"{k} = {a!r} there, {b!r} here" for k, (a, b) in diff.items())
                else:
                    what = f"{saved.get(key)!r} there, {mine.get(key)!r} here"
                raise CheckpointError(f"checkpoint {path} is of another model ({key}: {what}); load it with the "
                                      f"recipe's [model] it was saved with, or start without it")

    @staticmethod
    def _check_tensors(path: Path, metadata: Metadata, state: dict[str, Any]) -> None:
        """Every tensor this run loads exists in the checkpoint with the same global shape."""
        stored = metadata.state_dict_metadata
        for prefix in ("model", "optim"):
            for key, value in _flat_tensors(state.get(prefix, {}), prefix):
                md = stored.get(key)
                if md is None:
                    fix = ("load it with the model it was saved from" if prefix == "model" else
                           "set checkpoint.exclude = [\"optimizer\"] to start the optimizer afresh")
                    raise CheckpointError(f"checkpoint {path} has no tensor {key}; it is from another model or "
                                          f"optimizer: {fix}")
                if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
                    raise CheckpointError(f"checkpoint {path}: tensor {key} has shape {list(md.size)} there but "
                                          f"{list(value.shape)} in this model; it is from another model shape")


def _flat_tensors(tree: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor | _StridedPieces]]:
    if isinstance(tree, (torch.Tensor, _StridedPieces)):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_tensors(v, f"{prefix}.{k}")


def _failure(failure: Any) -> BaseException:
    """One rank's exception in DCP's wrapper, which keeps (exception, traceback) per failed rank."""
    return failure[0] if isinstance(failure, tuple) else failure


def _find_checkpoint_error(failures: Mapping[int, Any]) -> CheckpointError | None:
    """Our error among DCP's failures (CheckpointException.failures)."""
    for failure in failures.values():
        if isinstance(_failure(failure), CheckpointError):
            return _failure(failure)
    return None
