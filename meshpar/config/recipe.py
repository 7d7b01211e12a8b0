"""Recipes: one TOML file becomes frozen dataclasses, one per section.

A recipe is the whole description of a run: model, parallel layout, batch sizes, optimizer,
data, checkpointing, profiling and metrics. Precedence is command line > recipe file >
the defaults declared in meshpar/config/keys.py, where every field is documented, so
``meshpar recipe --keys`` prints that documentation.

Every key's type and range, and the rules across keys, are checked here, and every problem
raises :class:`RecipeError` naming the file (or the command-line override), the key and
what is allowed. The CLI turns it into one line on stderr and exit code 2. Checks against
the model registry and the world size (family, size, which parallel dims a family can run,
divisibility) are meshpar.training.preflight's: this module imports nothing else of meshpar.

Each part of meshpar receives its own section (``ParallelConfig`` for the mesh,
``DataConfig`` for the loader, ...), never the whole recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from meshpar.config.errors import RecipeError  # re-exported: meshpar.config.recipe.RecipeError stays importable
from meshpar.config.keys import (  # noqa: F401 - re-exported: import sections from meshpar.config.recipe
    MOE_KEYS,
    CheckpointConfig,
    DataConfig,
    DataSource,
    FaultConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    Recipe,
    TrainConfig,
    option,
)

SECTIONS: dict[str, type] = typing.get_type_hints(Recipe)  # section name -> its dataclass, in file order


def _toml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _fields_by_key(section_cls: type) -> dict[str, dataclasses.Field]:
    return {_toml_key(f): f for f in dataclasses.fields(section_cls)}


def _unknown(what: str, name: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown {what} '{name}'{hint}; allowed: {', '.join(allowed)}"


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field's annotation; ints are accepted for floats."""
    def fail(expected: str) -> RecipeError:
        return RecipeError(f"{where} = {_toml_value(value)}: expected {expected}, got {type(value).__name__}")

    if annotation is bool:
        if not isinstance(value, bool):
            raise fail(_EXPECTED[bool])
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(_EXPECTED[int])
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(_EXPECTED[float])
        if not math.isfinite(value):
            raise fail("a finite number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise fail(_EXPECTED[str])
        return value
    if isinstance(annotation, types.UnionType):  # e.g. bool | str: the first type the value has
        for member in typing.get_args(annotation):
            with contextlib.suppress(RecipeError):
                return _coerce(value, member, where)
        raise fail(" or ".join(_EXPECTED.get(m, m.__name__) for m in typing.get_args(annotation)))
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        if not isinstance(value, (list, tuple)):
            raise fail(f"a list of {'tables' if dataclasses.is_dataclass(item) else item.__name__}")
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(annotation):  # a table inside a section: [[data.sources]]
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise fail("a table such as {" + ", ".join(f"{_toml_key(f)} = ..." for f in dataclasses.fields(annotation))
                       + "}")
        prefix, _, name = where.rpartition(": ")  # "<origin>: data.sources[0]"
        return _build_table(annotation, value, name, prefix=prefix + ": " if prefix else "")
    raise TypeError(f"unsupported recipe field type {annotation!r}")  # a meshpar bug, not a user error


def _check_range(value: Any, f: dataclasses.Field, where: str) -> None:
    m = f.metadata
    shown = _toml_value(value)
    if m["valid"] is not None and not m["valid"][0](value):
        raise RecipeError(f"{where} = {shown}: must be {m['valid'][1]}")
    if m["choices"] is not None:
        items = value if isinstance(value, tuple) else (value,)
        if any(not any(type(v) is type(c) and v == c for c in m["choices"]) for v in items):  # 1 is not true
            which = "each item must be" if isinstance(value, tuple) else "must be"
            raise RecipeError(f"{where} = {shown}: {which} one of {', '.join(map(_toml_value, m['choices']))}")
    bounds = [(m["ge"], ">=", lambda v, b: v >= b), (m["gt"], ">", lambda v, b: v > b),
              (m["le"], "<=", lambda v, b: v <= b), (m["lt"], "<", lambda v, b: v < b)]
    for bound, sign, ok in bounds:
        if bound is not None and not ok(value, bound):
            raise RecipeError(f"{where} = {shown}: must be {sign} {bound:g}")


def _build_section(name: str, table: Any, origin: dict[str, str]) -> Any:
    if not isinstance(table, dict):
        raise RecipeError(f"{origin.get(name, '?')}: [{name}] must be a table of keys, got {table!r}")
    return _build_table(SECTIONS[name], table, name, origin)


def _build_table(cls: type, table: dict[str, Any], name: str, origin: dict[str, str] | None = None,
                 prefix: str = "") -> Any:
    """A section's (or a table's inside a section) dataclass from its TOML table; ``name`` is its dotted place,
    ``origin`` where each key of a section came from, ``prefix`` where a table inside one did."""
    fields = _fields_by_key(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in table.items():
        source = f"{origin.get(f'{name}.{key}', '?')}: " if origin is not None else prefix
        if key not in fields:
            raise RecipeError(source + _unknown(f"key in [{name}]", key, list(fields)))
        f = fields[key]
        where = f"{source}{name}.{key}"
        if isinstance(hints[f.name], types.UnionType) and f.metadata["choices"] is not None:
            _check_range(value, f, where)  # a field of mixed types is its list of values: name them for any value
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
    if sections["model"].family == "hf" and not sections["model"].hf_path:  # the folder it starts from
        sections["model"] = dataclasses.replace(sections["model"], hf_path=sections["checkpoint"].hf_weights)
    recipe = Recipe(**sections)
    try:
        check(recipe)
    except RecipeError as e:
        where = origin.get(e.key or "", str(path) if path is not None else "recipe")
        raise RecipeError(f"{where}: {e}", e.key) from None
    return recipe


def set_keys(path: str | Path | None, overrides: Sequence[str] = ()) -> tuple[set[str], set[str]]:
    """The "section.key"s the recipe file sets and those the overrides set (``load`` has checked both)."""
    in_file = set()
    if path is not None:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        in_file = {f"{section}.{key}" for section, table in raw.items() if isinstance(table, dict) for key in table}
    return in_file, {".".join(parse_override(arg)[:2]) for arg in overrides}


def check(recipe: Recipe) -> None:
    """Checks across keys. Those against the model registry (family, size, the parallel dims a
    family runs) and the world size are meshpar.training.preflight's."""
    t = recipe.train
    if t.global_batch % t.micro_batch:
        raise RecipeError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch "
                          f"({t.micro_batch})", "train.micro_batch")
    m = recipe.model
    if m.bias_update_rate != ModelConfig.bias_update_rate and not m.aux_free_bias:
        raise RecipeError(f"model.bias_update_rate = {m.bias_update_rate:g} has no effect without aux-free "
                          f"balancing: set model.aux_free_bias = true, or remove bias_update_rate",
                          "model.bias_update_rate")
    if m.hf_path and m.family != "hf":
        raise RecipeError(f"model.hf_path = {m.hf_path!r} is read only by model.family = \"hf\" (family "
                          f"'{m.family}' builds its own model: start it from the folder with checkpoint.hf_weights); "
                          "set model.family = \"hf\" or remove hf_path", "model.hf_path")
    if m.family == "hf":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise RecipeError("model.family = 'hf' builds the model with transformers, which is not installed: pip "
                              "install 'meshpar[hf]'", "model.family")
    if m.float8_emulate and m.float8 == "none":
        raise RecipeError("model.float8_emulate = true has no effect with model.float8 = \"none\": set model.float8 "
                          "(e.g. \"tensorwise\"), or remove float8_emulate", "model.float8_emulate")
    if m.float8 != "none":
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise RecipeError("model.float8 needs torchao, which is not installed: pip install 'meshpar[float8]' "
                              "(or set model.float8 = \"none\")", "model.float8")
    _check_replicas(recipe)
    if recipe.metrics.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise RecipeError("metrics.tensorboard = true needs the tensorboard package, which is not installed: "
                              "pip install tensorboard (metrics.jsonl is always written; or set "
                              "metrics.tensorboard = false)", "metrics.tensorboard")
    if recipe.metrics.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise RecipeError("metrics.wandb = true needs the wandb package, which is not installed: pip install "
                              "'meshpar[wandb]' (metrics.jsonl is always written; or set metrics.wandb = false)",
                              "metrics.wandb")


def _check_replicas(recipe: Recipe) -> None:
    """``fault.replicas = "torchft"`` and the keys that go with it."""
    f, groups = recipe.fault, recipe.parallel.dp_replicate
    if f.replicas != "torchft":
        for key in ("replica_id", "lighthouse", "min_replicas", "replica_wait", "quorum_timeout"):
            if getattr(f, key) != getattr(FaultConfig, key):
                raise RecipeError(f"fault.{key} is read only by fault.replicas = \"torchft\": set it, or remove "
                                  f"{key}", f"fault.{key}")
        return
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise RecipeError("fault.replicas = \"torchft\" needs torchft, which is not installed: pip install "
                          "'meshpar[ft]' (or set fault.replicas = \"none\")", "fault.replicas")
    if not (f.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise RecipeError("fault.replicas = \"torchft\" needs a lighthouse: start `meshpar lighthouse` and set "
                          "fault.lighthouse (or TORCHFT_LIGHTHOUSE) to the address it prints", "fault.lighthouse")
    if recipe.model.aux_free_bias:
        raise RecipeError("model.aux_free_bias with fault.replicas = \"torchft\" is not built: each replica group "
                          "would move its expert biases by its own loads and the groups would drift apart; use "
                          "model.aux_loss_coef for balancing, or fault.replicas = \"none\"", "model.aux_free_bias")
    if f.quorum_timeout and not f.quorum_timeout > 2 * f.timeout > 0:
        raise RecipeError(f"fault.quorum_timeout = {f.quorum_timeout:g} must exceed 2 x fault.timeout, set explicitly "
                          f"(it is {f.timeout:g}; 0 stands for a default that depends on the backend): a rank whose "
                          f"peer died sits in its all-reduce for fault.timeout while the others vote, and a shorter "
                          f"quorum wait would give up on a live lighthouse; set e.g. --fault.timeout="
                          f"{max(1.0, f.quorum_timeout / 3):g}, or leave fault.quorum_timeout 0",
                          "fault.quorum_timeout")
    if f.replica_id >= groups:
        raise RecipeError(f"fault.replica_id = {f.replica_id}: the job has parallel.dp_replicate = {groups} replica "
                          f"groups, numbered 0 to {groups - 1}; start each group with its own id", "fault.replica_id")
    if f.min_replicas > groups:
        raise RecipeError(f"fault.min_replicas = {f.min_replicas} is more than the parallel.dp_replicate = {groups} "
                          f"groups there are: no step could commit; use 1 to {groups}", "fault.min_replicas")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are all valid TOML basic-string escapes
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):  # an inline table: [[data.sources]] entries
        return "{" + ", ".join(f"{_toml_key(f)} = {_toml_value(getattr(value, f.name))}"
                               for f in dataclasses.fields(value)) + "}"
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
