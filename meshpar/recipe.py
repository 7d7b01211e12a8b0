"""Recipes: one TOML file becomes frozen dataclasses, one per section.

A recipe is the whole description of a run: model, parallel layout, batch sizes, optimizer,
data, checkpointing, profiling and metrics. Precedence is command line > recipe file >
the defaults declared below, and every field is documented where it is declared, so
``meshpar recipe --keys`` prints this file's documentation.

Every key's type and range, and the rules across keys, are checked here, and every problem
raises :class:`RecipeError` naming the file (or the command-line override), the key and
what is allowed. The CLI turns it into one line on stderr and exit code 2. Checks against
the model registry and the world size (family, size, which parallel dims a family can run,
divisibility) are meshpar.preflight's: this module imports nothing else of meshpar.

Each part of meshpar receives its own section (``ParallelConfig`` for the mesh,
``DataConfig`` for the loader, ...), never the whole recipe.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from meshpar.errors import RecipeError  # re-exported: meshpar.recipe.RecipeError stays importable


def option(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, choices: Sequence[Any] | None = None,
           valid: tuple[Callable[[Any], bool], str] | None = None, key: str | None = None) -> Any:
    """Declare a recipe field: its default, its documentation and the values it allows.

    ``choices`` applies to each item of a list field. ``valid`` is ``(predicate, "what is
    allowed")`` for rules the bounds cannot say. ``key`` is the TOML spelling where it cannot
    be a Python name (``async``).
    """
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "valid": valid, "key": key}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    family: str = option("llama", "Model family: llama, qwen2, qwen3 or gpt2 (see meshpar/models/).")
    size: str = option("debug", "Named size of the family, e.g. debug, 1b, 8b, 70b, 405b for llama.")
    n_layers: int = option(0, "Override the size's number of transformer blocks; 0 keeps the size's own.", ge=0)
    vocab_size: int = option(0, "Override the size's vocabulary; 0 keeps the size's own. Must hold every "
                                "token id the data produces.", ge=0)


@dataclass(frozen=True)
class ParallelConfig:
    pp: int = option(1, "Pipeline-parallel degree (outermost mesh dim).", ge=1)
    dp_replicate: int = option(1, "Data-parallel replicas: parameters replicated, gradients all-reduced.", ge=1)
    dp_shard: int = option(-1, "Data-parallel sharding degree (FSDP); -1 takes the ranks left over.",
                           valid=(lambda v: v == -1 or v >= 1, "-1 (the ranks left over) or >= 1"))
    cp: int = option(1, "Context-parallel degree (sequence split across ranks).", ge=1)
    tp: int = option(1, "Tensor-parallel degree (innermost mesh dim, fastest links).", ge=1)
    reshard_after_forward: bool = option(True, "FSDP: free unsharded parameters after forward and all-gather "
                                               "again in backward (ZeRO-3); false keeps them until after "
                                               "backward (ZeRO-2: less communication, more memory). Under "
                                               "pipeline parallelism (pp > 1) units always keep them: one "
                                               "all-gather per step, not one per microbatch.")
    grad_reduce: str = option("step", "FSDP with several microbatches per step: step reduce-scatters each "
                                      "unit's gradients once, after the last microbatch (each unit holds its "
                                      "unsharded gradient across the microbatches); microbatch reduce-scatters "
                                      "after every microbatch's backward (gradients stay sharded: less memory, "
                                      "data-parallel gradient traffic x the microbatches).",
                              choices=("step", "microbatch"))
    param_dtype: str = option("float32", "FSDP compute and all-gather dtype; sharded parameters and optimizer "
                                         "state stay float32.", choices=("float32", "bfloat16", "float16"))
    reduce_dtype: str = option("float32", "FSDP gradient reduce-scatter dtype.",
                               choices=("float32", "bfloat16", "float16"))
    shard_threshold: int = option(0, "FSDP: parameters with fewer elements stay replicated (one all-reduce "
                                     "for all of them instead of tiny shards).", ge=0)
    loss_parallel: bool = option(True, "Tensor parallel: keep the logits sharded over the vocabulary and "
                                       "compute the loss on the shards (no all-gather of [B, T, V] logits).")
    pp_schedule: str = option("1f1b", "Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble "
                                      "(interleaved, backward split into input and weight passes) or zbv "
                                      "(zero bubble, V placement, 2 stages per rank). Microbatches per step are "
                                      "train.global_batch / (dp x train.micro_batch).",
                              choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"))
    pp_virtual_stages: int = option(1, "Pipeline stages per rank: 1 for gpipe / 1f1b, >= 2 for the "
                                       "interleaved schedules, 2 for zbv.", ge=1)
    pp_boundaries: tuple[int, ...] = option((), "Pipeline split: the first layer of each stage after the first "
                                                "(pp x pp_virtual_stages - 1 increasing indices); empty splits "
                                                "the layers evenly.", valid=(lambda b: all(x >= 1 for x in b),
                                                                             "layer indices >= 1"))
    activation_checkpoint: str = option("none", "Recompute activations in backward: none, full (keep only each "
                                                "block's input) or selective (keep matmul and attention outputs, "
                                                "recompute the elementwise work).",
                                        choices=("none", "full", "selective"))
    ac_every: int = option(1, "Checkpoint every this many blocks (blocks whose index is a multiple of it).", ge=1)
    compile: bool = option(False, "torch.compile each transformer block (inductor; the first step compiles).")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(100, "Optimizer steps to run.", ge=1)
    output_dir: str = option("", "Where metrics.jsonl, recipe.toml and traces go; empty means runs/<recipe name>.")
    log_every: int = option(10, "Log a line and a metrics.jsonl record every this many steps.", ge=1)
    seed: int = option(0, "Seed for initialization and data order; a run is deterministic given it.", ge=0)
    global_batch: int = option(16, "Sequences per optimizer step across all data-parallel ranks. Global, so "
                                    "tokens per step and the losses do not depend on the layout.", ge=1)
    micro_batch: int = option(4, "Sequences per forward/backward on one data-parallel rank; gradient "
                                  "accumulation (or, with pp > 1, the pipeline's microbatches) covers the "
                                  "rest of global_batch.", ge=1)
    seq_len: int = option(256, "Tokens per sequence.", ge=2)
    eval_every: int = option(50, "Validation loss every this many steps (and after the last); 0 turns it off.", ge=0)
    eval_batches: int = option(4, "Global batches of held-out data per validation.", ge=1)
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu or cuda.", choices=("auto", "cpu", "cuda"))


@dataclass(frozen=True)
class OptimConfig:
    name: str = option("adamw", "Optimizer.", choices=("adamw",))
    lr: float = option(1e-3, "Peak learning rate.", gt=0)
    min_lr_ratio: float = option(0.1, "Final learning rate as a fraction of lr.", ge=0, le=1)
    warmup_steps: int = option(10, "Linear warmup steps from 0 to lr.", ge=0)
    schedule: str = option("cosine", "Decay after warmup.", choices=("cosine", "linear", "constant"))
    betas: tuple[float, ...] = option((0.9, 0.95), "AdamW (beta1, beta2).",
                                      valid=(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                                             "two numbers in [0, 1)"))
    eps: float = option(1e-8, "AdamW epsilon.", gt=0)
    weight_decay: float = option(0.1, "Decoupled weight decay on matrices (not on norms, biases).", ge=0)
    grad_clip: float = option(1.0, "Clip the global gradient norm to this; 0 turns clipping off.", ge=0)


@dataclass(frozen=True)
class DataConfig:
    path: str = option("", "Training data: empty for the built-in Shakespeare corpus, a .txt file, a folder "
                           "of .txt files, or a file of token ids (see format).")
    format: str = option("text", "text, or uint16 / uint32 for a pre-tokenized file of raw token ids "
                                 "(memory-mapped).", choices=("text", "uint16", "uint32"))
    tokenizer: str = option("bpe", "For text: bpe (byte-level BPE trained on the data and cached) or byte.",
                            choices=("bpe", "byte"))
    vocab_size: int = option(2048, "Vocabulary of the trained BPE tokenizer.", ge=260, le=65536)
    val_fraction: float = option(0.05, "Share of the tokens (the tail) held out for validation.", ge=0, lt=0.5)
    cache_dir: str = option("", "Tokenizer and token cache; empty means $MESHPAR_CACHE or ~/.cache/meshpar.")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = option("", "Checkpoint folder (holds step_<N>/ folders); empty means <train.output_dir>/checkpoints. "
                          "A run whose dir holds a complete checkpoint resumes from the newest.")
    every: int = option(0, "Save every this many steps; 0 turns saving off.", ge=0)
    keep: int = option(3, "Keep the newest this many checkpoints.", ge=1)
    async_save: bool = option(False, "Write in the background while training continues.", key="async")
    load_from: str = option("", "Start from this checkpoint (a step_<N> folder, or a checkpoint dir: its newest) "
                                "instead of the newest in dir.")
    hf_weights: str = option("", "Start from the weights in this Hugging Face folder (config.json + safetensors) "
                                 "instead of random initialization; a checkpoint to resume from takes precedence.")
    exclude: tuple[str, ...] = option((), "State to leave out when loading: optimizer, lr_schedule, data, rng.",
                                      choices=("optimizer", "lr_schedule", "data", "rng"))


@dataclass(frozen=True)
class ProfileConfig:
    enable: bool = option(False, "Trace steps with torch.profiler.")
    wait: int = option(1, "Profiler schedule: steps skipped before warmup.", ge=0)
    warmup: int = option(1, "Profiler schedule: steps traced but discarded.", ge=0)
    active: int = option(2, "Profiler schedule: steps recorded.", ge=1)
    repeat: int = option(1, "Profiler schedule: cycles of wait/warmup/active.", ge=1)
    ranks: str = option("all", "Ranks to trace: all, rank0, stages (the first rank of each pipeline stage) or a "
                               "list such as \"0,3\".")
    record_shapes: bool = option(False, "Record operator input shapes.")
    profile_memory: bool = option(False, "Record tensor allocations and frees.")
    with_stack: bool = option(False, "Record Python stacks (large traces).")
    max_trace_mb: float = option(200.0, "Cap on each trace file (uncompressed JSON): the shortest events are "
                                        "dropped first.", gt=0)


@dataclass(frozen=True)
class MetricsConfig:
    hardware: str = option("auto", "Hardware profile for MFU: a name in profiles/ (cpu, a100_80gb, h100_sxm, "
                                    "h200) or a path to one; auto picks by the device.")
    progress: str = option("auto", "Progress bar on rank 0: auto (when stderr is a terminal), on or off.",
                           choices=("auto", "on", "off"))
    tensorboard: bool = option(False, "Also write TensorBoard event files to <train.output_dir>/tensorboard "
                                      "(needs the tensorboard package).")


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


SECTIONS: dict[str, type] = typing.get_type_hints(Recipe)  # section name -> its dataclass, in file order


def _toml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _fields_by_key(section_cls: type) -> dict[str, dataclasses.Field]:
    return {_toml_key(f): f for f in dataclasses.fields(section_cls)}


def _unknown(what: str, name: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown {what} '{name}'{hint}; allowed: {', '.join(allowed)}"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field's annotation; ints are accepted for floats."""
    def fail(expected: str) -> RecipeError:
        return RecipeError(f"{where} = {_toml_value(value)}: expected {expected}, got {type(value).__name__}")

    if annotation is bool:
        if not isinstance(value, bool):
            raise fail("true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("a number")
        if not math.isfinite(value):
            raise fail("a finite number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise fail("a string")
        return value
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        if not isinstance(value, (list, tuple)):
            raise fail(f"a list of {item.__name__}")
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"unsupported recipe field type {annotation!r}")  # a meshpar bug, not a user error


def _check_range(value: Any, f: dataclasses.Field, where: str) -> None:
    m = f.metadata
    shown = _toml_value(value)
    if m["valid"] is not None and not m["valid"][0](value):
        raise RecipeError(f"{where} = {shown}: must be {m['valid'][1]}")
    if m["choices"] is not None:
        items = value if isinstance(value, tuple) else (value,)
        if any(v not in m["choices"] for v in items):
            which = "each item must be" if isinstance(value, tuple) else "must be"
            raise RecipeError(f"{where} = {shown}: {which} one of {', '.join(map(_toml_value, m['choices']))}")
    bounds = [(m["ge"], ">=", lambda v, b: v >= b), (m["gt"], ">", lambda v, b: v > b),
              (m["le"], "<=", lambda v, b: v <= b), (m["lt"], "<", lambda v, b: v < b)]
    for bound, sign, ok in bounds:
        if bound is not None and not ok(value, bound):
            raise RecipeError(f"{where} = {shown}: must be {sign} {bound:g}")


def _build_section(name: str, table: Any, origin: dict[str, str]) -> Any:
    cls = SECTIONS[name]
    if not isinstance(table, dict):
        raise RecipeError(f"{origin.get(name, '?')}: [{name}] must be a table of keys, got {table!r}")
    fields = _fields_by_key(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in table.items():
        where = f"{origin.get(f'{name}.{key}', '?')}: {name}.{key}"
        if key not in fields:
            raise RecipeError(f"{origin.get(f'{name}.{key}', '?')}: " + _unknown(f"key in [{name}]", key, list(fields)))
        f = fields[key]
        value = _coerce(value, hints[f.name], where)
        _check_range(value, f, where)
        kwargs[f.name] = value
    return cls(**kwargs)


def parse_override(arg: str) -> tuple[str, str, Any]:
    """``--section.key=value`` -> (section, key, value).

    The value is read as TOML (``50``, ``1e-4``, ``[0.9, 0.99]``, ``true``), except that a
    string key keeps the text as written (``--train.output_dir=2024``), and a bare word that is
    not TOML stays a string (``--model.size=8b``).
    """
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise RecipeError(f"override '{arg}': expected --section.key=value, e.g. --train.steps=50")
    dotted, text = body.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return section, key, text
    field_ = _fields_by_key(SECTIONS[section]).get(key) if section in SECTIONS else None
    if field_ is not None and typing.get_type_hints(SECTIONS[section])[field_.name] is str and not isinstance(
            value, str):
        return section, key, text
    return section, key, value


def load(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe file (or only defaults when ``path`` is None), apply overrides, validate.

    Raises :class:`RecipeError` for anything the user must fix.
    """
    tables: dict[str, dict[str, Any]] = {}
    origin: dict[str, str] = {}  # "section" / "section.key" -> where its value came from
    stem = "default"
    if path is not None:
        path = Path(path)
        stem = path.stem
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise RecipeError(f"{path}: no such recipe file") from None
        except IsADirectoryError:
            raise RecipeError(f"{path}: is a folder; give a recipe file, e.g. {path}/llama_debug.toml") from None
        except OSError as e:
            raise RecipeError(f"{path}: cannot read: {e.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise RecipeError(f"{path}: not valid TOML (UTF-8): {e}") from None
        for section, table in raw.items():
            if section not in SECTIONS:
                raise RecipeError(f"{path}: " + _unknown("section", section, list(SECTIONS)))
            tables[section] = table
            origin[section] = str(path)
            if isinstance(table, dict):
                origin.update({f"{section}.{k}": str(path) for k in table})
    for arg in overrides:
        section, key, value = parse_override(arg)
        if section not in SECTIONS:
            raise RecipeError(f"override '{arg}': " + _unknown("section", section, list(SECTIONS)))
        tables.setdefault(section, {})
        if isinstance(tables[section], dict):
            tables[section][key] = value
        origin[f"{section}.{key}"] = f"override '{arg}'"
        origin.setdefault(section, f"override '{arg}'")

    sections = {name: _build_section(name, tables.get(name, {}), origin) for name in SECTIONS}
    if not sections["train"].output_dir:
        sections["train"] = dataclasses.replace(sections["train"], output_dir=str(Path("runs") / stem))
    recipe = Recipe(**sections)
    try:
        check(recipe)
    except RecipeError as e:
        where = origin.get(e.key or "", str(path) if path is not None else "recipe")
        raise RecipeError(f"{where}: {e}", e.key) from None
    return recipe


def check(recipe: Recipe) -> None:
    """Checks across keys. Those against the model registry (family, size, the parallel dims a
    family runs) and the world size are meshpar.preflight's."""
    t = recipe.train
    if t.global_batch % t.micro_batch:
        raise RecipeError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch "
                          f"({t.micro_batch})", "train.micro_batch")
    if recipe.metrics.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise RecipeError("metrics.tensorboard = true needs the tensorboard package, which is not installed: "
                              "pip install tensorboard (metrics.jsonl is always written; or set "
                              "metrics.tensorboard = false)", "metrics.tensorboard")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are all valid TOML basic-string escapes
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def dumps(recipe: Recipe) -> str:
    """The resolved recipe as TOML, every key present; ``load`` of it gives the same recipe."""
    out = []
    for name in SECTIONS:
        section = getattr(recipe, name)
        out.append(f"[{name}]")
        out += [f"{_toml_key(f)} = {_toml_value(getattr(section, f.name))}" for f in dataclasses.fields(section)]
        out.append("")
    return "\n".join(out)


def describe_keys() -> str:
    """Every recipe key with its default and documentation, for ``meshpar recipe --keys``."""
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"[{name}]")
        for f in dataclasses.fields(cls):
            out.append(f"  {_toml_key(f)} = {_toml_value(f.default)}\n      {f.metadata['doc']}")
        out.append("")
    return "\n".join(out)
