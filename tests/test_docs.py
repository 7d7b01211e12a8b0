"""The commands and links of README.md and docs/*.md still work, checked without running them.

A shell block is checked when the line before its ```bash fence is ``<!-- runnable -->``; every
```bash block must be marked (a command no test checks does not belong in the docs). Its lines are
joined at a trailing backslash, comments dropped, and split into commands at ``&&``, ``||``, ``;``
and ``|``; leading ``NAME=value`` words are skipped. Each command is checked by what it starts with:

- ``meshpar``, ``.venv/bin/meshpar``, ``python -m meshpar``: parsed by meshpar's own argument
  parser (``meshpar plan`` by the planner's); for ``train``, ``recipe`` and ``plan`` the recipe is
  loaded with its overrides and its layout checked at its world size, as before a launch, so a
  renamed key, a missing recipe file or an impossible layout fails here; ``plan --model F/S`` checks
  the model against the registry; ``generate``'s flags are parsed by its own parser;
- ``torchrun ... -m meshpar.train RECIPE ...``, ``python -m meshpar.train RECIPE ...`` and
  ``sbatch [OPTIONS] scripts/slurm.sbatch RECIPE ...``: the same for the recipe;
- ``python -m pytest ...``: every marker named by ``-m`` is registered in pyproject.toml, and every
  test path exists;
- ``python -m MODULE ...`` (a benchmark): the module exists, and every ``--flag`` it is given is
  named in its source;
- ``bash FILE``, ``sbatch FILE``, ``.ci/run``, ``ruff check PATHS``: the files exist.

Anything else in a marked block fails the test. Nothing is run: one process, no spawn.

Links: every relative link (and image) in README.md and docs/*.md points at an existing file, and
a ``#fragment`` into a Markdown file names one of its headings, as GitHub makes anchors of them.

README.md's recipe table names each recipe's degrees and rank count as its file sets them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshpar import cli
from meshpar.config import recipe as recipelib
from meshpar.config.keys import local_world_size
from meshpar.planner import cli as plan_cli
from meshpar.training.preflight import check_layout, check_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Command:
    page: Path
    line: int  # 1-based, the command's first line
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks(page: Path) -> list[tuple[int, str, bool, list[tuple[int, str]]]]:
    """(fence line, language, marked runnable, [(line number, text)]) for each fenced block."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, lang = i, m.group(1), m.group(2).lower()
        marked = i > 0 and lines[i - 1].strip() == MARK
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        out.append((start + 1, lang, marked, body))
        i += 1
    return out


def _commands(page: Path) -> list[Command]:
    commands = []
    for _, lang, marked, body in _blocks(page):
        if not (marked and lang in SHELLS):
            continue
        pending, first = "", 0
        for number, text in body:
            if not pending:
                first = number
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            joined = (pending + text).strip()
            pending = ""
            if joined and not joined.startswith("#"):
                commands.append(Command(page, first, joined))
    return commands


COMMANDS = [c for page in PAGES for c in _commands(page)]


def _segments(text: str) -> list[list[str]]:
    """Words of each command of a shell line, split at && || ; |, comments and NAME=value dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments, words = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            segments.append(words)
            words = []
        else:
            words.append(token)
    segments.append(words)
    out = []
    for words in segments:
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


class ParseError(Exception):
    pass


@contextlib.contextmanager
def _argparse_errors():
    """argparse exits on a bad command line; turn that into an exception carrying its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as e:
        if e.code:
            raise ParseError(err.getvalue().strip() or f"exit {e.code}") from None


def _overrides(extra: list[str]) -> list[str]:
    bad = [a for a in extra if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        raise ParseError(f"unrecognized arguments {bad} (recipe overrides are --section.key=value)")
    return extra


def _recipe(path: str | Path, overrides: list[str], world: int | None = None) -> None:
    """Load a recipe with its overrides and check its layout, as meshpar does before a launch."""
    path = Path(path)
    recipe = recipelib.load(path if path.is_absolute() else REPO / path, overrides)
    check_layout(recipe, local_world_size(recipe.parallel) if world is None else world)


def _auto(path: str, overrides: list[str], gpus: int | None) -> None:
    """``meshpar train RECIPE --auto --gpus N``: the search has candidates on N CPU ranks."""
    from meshpar.config.hardware import load_profile
    from meshpar.planner.auto import pinned
    from meshpar.planner.candidates import candidates

    if not gpus:
        raise ParseError("meshpar train --auto in the docs names its ranks (--gpus N)")
    path = Path(path) if Path(path).is_absolute() else REPO / path
    if not candidates(overrides, gpus, load_profile("cpu", "cpu"), gpus, None, path=path,
                      pinned=pinned(path, overrides)):
        raise ParseError(f"meshpar train --auto: no layout of {gpus} ranks keeps what {path.name} pins")


def _meshpar(args: list[str]) -> None:
    if args[:1] == ["plan"]:
        with _argparse_errors():
            ns, extra = plan_cli.parser().parse_known_args(args[1:])
        overrides = _overrides(extra)
        if ns.model:
            family, _, size = ns.model.partition("/")
            if not size or not ns.gpus:
                raise ParseError("meshpar plan --model takes FAMILY/SIZE and needs --gpus N")
            check_model(recipelib.load(None, [f"--model.family={family}", f"--model.size={size}", *overrides]))
        elif ns.recipe is None:
            raise ParseError("meshpar plan needs a RECIPE or --model FAMILY/SIZE --gpus N")
        else:
            _recipe(ns.recipe, overrides, ns.world)
        return
    if args[:1] == ["generate"]:  # its own parser: the flags parse (the folders are a run's outputs)
        from meshpar.inference.generate import parser as generate_parser

        with _argparse_errors():
            generate_parser().parse_args(args[1:])
        return
    with _argparse_errors():
        ns, extra = cli.parser().parse_known_args(args)  # meshpar/cli.py builds the parser here
    if ns.command == "train":
        overrides = _overrides(extra) + (["--profile.enable=true"] if ns.profile else [])
        if ns.auto:
            _auto(ns.recipe, overrides, ns.gpus or ns.nproc)
        else:
            _recipe(ns.recipe, overrides, ns.nproc)
    elif ns.command == "recipe":
        overrides = _overrides(extra)
        if ns.recipe is not None:
            _recipe(ns.recipe, overrides)
    elif extra:
        raise ParseError(f"meshpar {ns.command}: unrecognized arguments {extra}")


def _train_module(args: list[str], world: int | None = None) -> None:
    """``python -m meshpar.train RECIPE [overrides]``, the torchrun entry."""
    if not args:
        raise ParseError("meshpar.train needs a RECIPE")
    _recipe(args[0], _overrides(args[1:]), world)


def _torchrun(args: list[str]) -> None:
    if "-m" not in args or args[args.index("-m") + 1] != "meshpar.train":
        raise ParseError("a torchrun command in the docs runs -m meshpar.train")
    opts = dict(zip(args, args[1:], strict=False))
    try:
        world = int(opts.get("--nnodes", "1")) * int(opts.get("--nproc-per-node", ""))
    except ValueError:
        world = None
    _train_module(args[args.index("-m") + 2:], world)


def _markers() -> set[str]:
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {m.split(":", 1)[0].strip() for m in ini.get("markers", [])}


def _pytest(args: list[str]) -> None:
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-m", "-k", "-n", "--dist", "-p", "--durations"):
            if arg == "-m":
                names = set(re.findall(r"[A-Za-z_]\w*", args[i + 1])) - {"and", "or", "not"}
                unknown = names - _markers()
                if unknown:
                    raise ParseError(f"pytest -m names markers not registered in pyproject.toml: {sorted(unknown)}")
            i += 2
            continue
        if not arg.startswith("-") and not (REPO / arg.split("::")[0]).exists():
            raise ParseError(f"pytest: no such test path {arg}")
        i += 1


def _module(module: str, args: list[str]) -> None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ParseError(f"python -m {module}: no such module")
    source = Path(spec.origin).read_text()
    for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
        if f'"{flag}"' not in source and f"'{flag}'" not in source:
            raise ParseError(f"python -m {module}: {flag} is not an option of {spec.origin}")


def _exists(path: str) -> None:
    if not (REPO / path).exists():
        raise ParseError(f"no such file: {path}")


def check(words: list[str]) -> None:
    """Check one command, given as its words; raises ParseError or RecipeError naming the problem."""
    head, args = words[0], words[1:]
    if head in ("meshpar", ".venv/bin/meshpar"):
        return _meshpar(args)
    if re.fullmatch(r"(.*/)?python3?", head):
        if args[:1] != ["-m"] or len(args) < 2:
            raise ParseError(f"a python command in the docs runs a module (-m): {words}")
        module, rest = args[1], args[2:]
        if module in ("meshpar", "meshpar.cli"):
            return _meshpar(rest)
        if module == "meshpar.train":
            return _train_module(rest)
        if module == "pytest":
            return _pytest(rest)
        return _module(module, rest)
    if head == "torchrun":
        return _torchrun(args)
    if head in ("bash", "sbatch"):
        if head == "sbatch":  # sbatch's own options come before the script
            args = list(itertools.dropwhile(lambda a: a.startswith("-"), args))
        _exists(args[0])
        if args[0] == "scripts/slurm.sbatch":
            _train_module(args[1:])
        return None
    if head == ".ci/run":
        return _exists(head)
    if re.fullmatch(r"(.*/)?ruff", head) and args[:1] == ["check"]:
        for path in args[1:]:
            if not path.startswith("-"):
                _exists(path)
        return None
    raise ParseError(f"{head}: not a command this test can check; leave it out of a runnable block")


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_runnable_command(command: Command):
    for words in _segments(command.text):
        try:
            check(words)
        except (ParseError, recipelib.RecipeError, argparse.ArgumentError) as e:
            pytest.fail(f"{command.where}: `{command.text}`: {e}", pytrace=False)


def test_there_are_runnable_commands():
    pages = {c.page.name for c in COMMANDS}
    assert "README.md" in pages and len(COMMANDS) > 20, pages


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_shell_block_is_checked(page: Path):
    """A ```bash block is either marked runnable (and checked above) or does not belong in the docs;
    a marker on anything but a shell block is a mistake."""
    for line, lang, marked, _ in _blocks(page):
        where = f"{page.relative_to(REPO)}:{line}"
        assert marked or lang not in SHELLS, f"{where}: mark the ```{lang} block {MARK} (tests/test_docs.py)"
        assert not marked or lang in SHELLS, f"{where}: {MARK} marks a ```{lang or 'text'} block, not a shell one"


# --- links ---------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(page: Path, code: bool = False) -> str:
    """The page without fenced blocks, and without inline code (where brackets are not links)
    unless ``code``, which keeps its text and drops only the backticks (as in a heading)."""
    lines, keep, fence = page.read_text().splitlines(), [], None
    for text in lines:
        m = FENCE.match(text)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and text.startswith(fence):
            fence = None
        elif fence is None:
            keep.append(text.replace("`", "") if code else re.sub(r"`[^`]*`", "", text))
    return "\n".join(keep)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -,
    repeats numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for text in _prose(page, code=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", text)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links(page: Path):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links:\n  " + "\n  ".join(broken)


_RECIPE_ROW = re.compile(r"^\| `(\w+\.toml)` \| [^|]+ \| ([\d,]+)(?: \w+)? \| ([^|]+) \|")
_DEGREE = re.compile(r"\b(pp|dp_replicate|dp_shard|cp|tp|ep) (\d+)")


def test_the_readme_recipe_table_gives_each_recipes_layout():
    """README.md's recipe table: each row of one recipe names its degrees (``pp 4 x dp_shard 64 x tp 4,
    ep 64``) and its rank count as the recipe file sets them; a recipe whose layout changed fails here
    until its row does."""
    rows = [m.groups() for line in (REPO / "README.md").read_text().splitlines() if (m := _RECIPE_ROW.match(line))]
    assert len(rows) >= 20, f"the table's rows were not found: {len(rows)}"
    for name, ranks, layout in rows:
        p = recipelib.load(REPO / "recipes" / name).parallel
        said = {dim: int(n) for dim, n in _DEGREE.findall(layout)}
        if "single rank" in layout:
            said = {dim: 1 for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")}
        for dim, n in said.items():
            value = getattr(p, dim)
            assert value in (n, -1 if dim == "dp_shard" else n), f"{name}: README says {dim} {n}, the recipe {value}"
        mesh = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        total = math.prod(said.get(dim, max(getattr(p, dim), 1)) for dim in mesh)
        assert total == int(ranks.replace(",", "")), f"{name}: README says {ranks} ranks, its layout makes {total}"
