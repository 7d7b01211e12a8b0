"""Recipes: every shipped recipe loads and round-trips, and every mistake gives its own error.

An error must name where the value came from (the file or the command-line override), the
key, and what is allowed, so each case below matches the whole message, not a fragment.
Nothing here starts a process group: the CLI runs as a subprocess only to check exit codes
and the one-line error, and ``preflight`` runs on a small text file with the byte tokenizer.
"""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshpar.config import recipe as recipelib
from meshpar.config.keys import local_world_size
from meshpar.config.recipe import SECTIONS, ParallelConfig, Recipe, RecipeError, dumps, load, parse_override
from meshpar.distributed import mesh as meshlib
from meshpar.models import FAMILIES, NOT_BUILT, get_family
from meshpar.training.preflight import check_model, preflight

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
# (family, dim) for every mesh dim a family cannot run yet (gpt2: cp); ep on a dense family is refused
# by the layout check (tests/test_expert_parallel.py)
NOT_BUILT_DIMS = [(family, d) for family in FAMILIES for d in meshlib.DIMS if d not in get_family(family).mesh_dims]
assert NOT_BUILT_DIMS, "every family runs every dim: test_parallel_dim_not_built_yet has nothing to test"


def _write(tmp_path: Path, text: str, name: str = "bad.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- 1. the shipped recipes -------------------------------------------------------------------


def test_recipes_folder_is_not_empty():
    assert RECIPES, "no recipes/*.toml found"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipe_loads_and_round_trips(path, tmp_path):
    recipe = load(path)
    assert recipe.train.output_dir == str(Path("runs") / path.stem)
    again = load(_write(tmp_path, dumps(recipe), "resolved.toml"))
    assert again == recipe
    assert dumps(again) == dumps(recipe)


def test_round_trip_keeps_every_kind_of_value(tmp_path):
    # Strings that need escaping (quote, backslash, tab, newline, non-ASCII), a bool under its
    # TOML spelling, tuples and floats in exponent form must all survive dumps -> load.
    text = r'''
[train]
output_dir = "runs/a \"q\" \\ b\tc\nd é"
[optim]
betas = [0.8, 0.999]
eps = 1e-12
lr = 2.5e-4
[checkpoint]
async = true
exclude = ["optimizer", "rng"]
'''
    recipe = load(_write(tmp_path, text, "tricky.toml"))
    assert recipe.train.output_dir == 'runs/a "q" \\ b\tc\nd é'
    assert load(_write(tmp_path, dumps(recipe), "resolved.toml")) == recipe


# --- 2. malformed recipes ---------------------------------------------------------------------

# (id, recipe text, what the message says after "<file>: ")
BAD_FILES = [
    # unknown names, with did-you-mean and the allowed list
    ("unknown-section", "[trian]\nsteps = 3\n",
     r"unknown section 'trian' \(did you mean 'train'\?\); allowed: model, parallel, train, optim, data, "
     r"checkpoint, profile, metrics, fault$"),
    ("unknown-key-train", "[train]\nstpes = 3\n",
     r"unknown key in \[train\] 'stpes' \(did you mean 'steps'\?\); allowed: steps, output_dir, .*device, "
     r"on_nonfinite, max_skips, loss_chunks$"),
    ("unknown-key-no-hint", "[train]\nzzz = 3\n", r"unknown key in \[train\] 'zzz'; allowed: steps, "),
    ("unknown-key-model", '[model]\nfamilly = "llama"\n',
     r"unknown key in \[model\] 'familly' \(did you mean 'family'\?\); allowed: family, size, "),
    ("unknown-key-parallel", "[parallel]\ndp_shards = 2\n",
     r"unknown key in \[parallel\] 'dp_shards' \(did you mean 'dp_shard'\?\); allowed: pp, dp_replicate, "),
    ("unknown-key-optim", "[optim]\nweight_decy = 0.1\n",
     r"unknown key in \[optim\] 'weight_decy' \(did you mean 'weight_decay'\?\); allowed: name, lr, "),
    ("unknown-key-data", '[data]\ntokeniser = "byte"\n',
     r"unknown key in \[data\] 'tokeniser' \(did you mean 'tokenizer'\?\); allowed: path, format, "),
    ("unknown-key-python-name", "[checkpoint]\nasync_save = true\n",  # the TOML key is `async`
     r"unknown key in \[checkpoint\] 'async_save' \(did you mean 'async'\?\); allowed: dir, every, keep, async, "),
    ("unknown-key-metrics", '[metrics]\nprogres = "on"\n',
     r"unknown key in \[metrics\] 'progres' \(did you mean 'progress'\?\)"),
    # wrong types
    ("str-for-int", '[train]\nsteps = "100"\n', r'train\.steps = "100": expected an integer, got str$'),
    ("float-for-int", "[train]\nsteps = 1.5\n", r"train\.steps = 1\.5: expected an integer, got float$"),
    ("bool-for-int", "[train]\nsteps = true\n", r'train\.steps = true: expected an integer, got bool$'),
    ("int-for-bool", "[profile]\nwith_stack = 1\n", r"profile\.with_stack = 1: expected true or false, got int$"),
    ("async-misspelt", '[checkpoint]\nasync = "procss"\n',
     r'checkpoint\.async = "procss": must be one of false, true, "thread", "process"$'),
    ("async-int", "[checkpoint]\nasync = 1\n", r'checkpoint\.async = 1: must be one of false, true, "thread", '
                                               r'"process"$'),
    ("str-for-bool", '[profile]\nenable = "yes"\n', r'profile\.enable = "yes": expected true or false, got str$'),
    ("str-for-float", '[optim]\nlr = "1e-3"\n', r'optim\.lr = "1e-3": expected a number, got str$'),
    ("list-for-str", '[model]\nfamily = ["llama"]\n', r'model\.family = \["llama"\]: expected a string, got list$'),
    ("scalar-betas", "[optim]\nbetas = 0.9\n", r"optim\.betas = 0\.9: expected a list of float, got float$"),
    ("str-in-betas", '[optim]\nbetas = [0.9, "x"]\n', r'optim\.betas\[1\] = "x": expected a number, got str$'),
    ("section-not-table", "train = 5\n", r"\[train\] must be a table of keys, got 5$"),
    # out of range
    ("steps-0", "[train]\nsteps = 0\n", r"train\.steps = 0: must be >= 1$"),
    ("seq-len-1", "[train]\nseq_len = 1\n", r"train\.seq_len = 1: must be >= 2$"),
    ("dp-shard-0", "[parallel]\ndp_shard = 0\n",
     r"parallel\.dp_shard = 0: must be -1 \(the ranks left over\) or >= 1$"),
    # -1 and >= 1 are the only degrees; ">= -1" would suggest 0 is allowed
    ("dp-shard-minus-2", "[parallel]\ndp_shard = -2\n", r".*dp_shard = -2: must be -1 .*or >= 1$"),
    ("lr-0", "[optim]\nlr = 0\n", r"optim\.lr = 0\.0: must be > 0$"),
    ("lr-inf", "[optim]\nlr = inf\n", r"optim\.lr = inf: expected a finite number, got float$"),
    ("negative-weight-decay", "[optim]\nweight_decay = -0.1\n", r"optim\.weight_decay = -0\.1: must be >= 0$"),
    ("min-lr-ratio-1.5", "[optim]\nmin_lr_ratio = 1.5\n", r"optim\.min_lr_ratio = 1\.5: must be <= 1$"),
    ("val-fraction-0.5", "[data]\nval_fraction = 0.5\n", r"data\.val_fraction = 0\.5: must be < 0\.5$"),
    ("data-vocab-100", "[data]\nvocab_size = 100\n", r"data\.vocab_size = 100: must be >= 260$"),
    ("data-vocab-huge", "[data]\nvocab_size = 70000\n", r"data\.vocab_size = 70000: must be <= 65536$"),
    # choices
    ("device-tpu", '[train]\ndevice = "tpu"\n', r'train\.device = "tpu": must be one of "auto", "cpu", "cuda"$'),
    ("schedule-step", '[optim]\nschedule = "step"\n',
     r'optim\.schedule = "step": must be one of "cosine", "linear", "constant"$'),
    ("format-int8", '[data]\nformat = "int8"\n',
     r'data\.format = "int8": must be one of "auto", "text", "uint16", "uint32", "chat"$'),
    ("progress-yes", '[metrics]\nprogress = "yes"\n',
     r'metrics\.progress = "yes": must be one of "auto", "on", "off"$'),
    ("exclude-typo", '[checkpoint]\nexclude = ["optimzer"]\n',
     r'checkpoint\.exclude = \["optimzer"\]: each item must be one of "optimizer", "lr_schedule", "data", "rng"$'),
    # betas
    ("betas-3", "[optim]\nbetas = [0.9, 0.95, 0.99]\n",
     r"optim\.betas = \[0\.9, 0\.95, 0\.99\]: must be two numbers in \[0, 1\)$"),
    ("beta-1", "[optim]\nbetas = [0.9, 1.0]\n", r"optim\.betas = \[0\.9, 1\.0\]: must be two numbers in \[0, 1\)$"),
    # TOML syntax
    ("bad-syntax", "[train\nsteps = 3\n", r"not valid TOML \(UTF-8\): "),
    ("duplicate-key", "[train]\nsteps = 1\nsteps = 2\n", r"not valid TOML \(UTF-8\): "),
    # across keys
    ("batch-multiple", "[train]\nglobal_batch = 10\nmicro_batch = 4\n",
     r"train\.global_batch \(10\) must be a multiple of train\.micro_batch \(4\)$"),
]


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_malformed_recipe(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(RecipeError, match="^" + re.escape(f"{path}: ") + message):
        load(path)


# Against the model registry: meshpar.training.preflight's checks (meshpar.config.recipe imports no model), so
# the message names the key but not the file or override it came from.
BAD_MODELS = [
    ("unknown-family", '[model]\nfamily = "mistral"\n',
     rf"model\.family = 'mistral': unknown family; choose one of {', '.join(FAMILIES)}$"),
    ("unknown-size", '[model]\nsize = "13b"\n',
     rf"model\.size = '13b': no such size for family 'llama'; choose one of {', '.join(FAMILIES['llama'].sizes)}$"),
    ("unknown-size-gpt2", '[model]\nfamily = "gpt2"\nsize = "8b"\n',
     rf"model\.size = '8b': no such size for family 'gpt2'; choose one of {', '.join(FAMILIES['gpt2'].sizes)}$"),
]


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in BAD_MODELS], ids=[c[0] for c in BAD_MODELS])
def test_model_not_in_the_registry(tmp_path, text, message):
    recipe = load(_write(tmp_path, text))  # the recipe itself is well-formed
    with pytest.raises(RecipeError, match="^" + message):
        check_model(recipe)


@pytest.mark.parametrize(("family", "dim"), NOT_BUILT_DIMS, ids=[f"{f}-{d}" for f, d in NOT_BUILT_DIMS])
def test_parallel_dim_not_built_yet(tmp_path, family, dim):
    reason = "" if dim not in FAMILIES[family].not_built else ": " + re.escape(FAMILIES[family].not_built[dim])
    message = (rf"^parallel\.{dim} = 2: {re.escape(NOT_BUILT[dim])} is not built yet for "
               rf"model family '{family}'{reason} \(built: .*\); set parallel\.{dim} = 1$")
    text = f'[model]\nfamily = "{family}"\n[parallel]\n{dim} = 2\n'
    for recipe in (load(_write(tmp_path, text)), load(None, [f"--model.family={family}", f"--parallel.{dim}=2"])):
        with pytest.raises(RecipeError, match=message) as err:
            check_model(recipe)
        assert err.value.key == f"parallel.{dim}"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(RecipeError, match="^" + re.escape(f"{path}: no such recipe file") + "$"):
        load(path)


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(RecipeError, match="^" + re.escape(str(tmp_path))):
        load(tmp_path)


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[train]\noutput_dir = "caf\xe9"\n')
    with pytest.raises(RecipeError, match="^" + re.escape(f"{path}: ")):
        load(path)


# (file text, overrides, the override the message must name, what the message says after it)
BAD_OVERRIDES = [
    ("", ["--train.steps=0"], "--train.steps=0", r"train\.steps = 0: must be >= 1$"),
    ("", ["--trian.steps=5"], "--trian.steps=5", r"unknown section 'trian' \(did you mean 'train'\?\)"),
    ("[train]\nsteps = 3\n", ["--train.stpes=5"], "--train.stpes=5",
     r"unknown key in \[train\] 'stpes' \(did you mean 'steps'\?\)"),
    ("", ["--train.device=tpu"], "--train.device=tpu", r'train\.device = "tpu": must be one of "auto", "cpu", "cuda"$'),
    # checks in __post_init__ and in check() must blame the override, not the file that never set the key
    ("[parallel]\npp = 1\n", ["--parallel.dp_shard=0"], "--parallel.dp_shard=0", r".*dp_shard = 0: must be -1"),
    ("[optim]\nlr = 1e-3\n", ["--optim.betas=[0.9,1.0]"], "--optim.betas=[0.9,1.0]",
     r".*betas = \[0\.9, 1\.0\]: must be two numbers in \[0, 1\)$"),
    ("[train]\nglobal_batch = 8\n", ["--train.micro_batch=3"], "--train.micro_batch=3",
     r"train\.global_batch \(8\) must be a multiple of train\.micro_batch \(3\)$"),
    ("[parallel]\npp = 2\n", ["--parallel.pp_schedule=2f2b"], "--parallel.pp_schedule=2f2b",
     r'.*parallel\.pp_schedule = "2f2b": must be one of "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"$'),
    ("", ["--parallel.activation_checkpoint=all"], "--parallel.activation_checkpoint=all",
     r'.*activation_checkpoint = "all": must be one of "none", "full", "selective"$'),
    ("", ["--parallel.pp_boundaries=[0, 2]"], "--parallel.pp_boundaries=[0, 2]",
     r".*pp_boundaries = \[0, 2\]: must be layer indices >= 1$"),
]


@pytest.mark.parametrize(("text", "overrides", "named", "message"), BAD_OVERRIDES,
                         ids=[c[1][0] for c in BAD_OVERRIDES])
def test_error_from_override_names_the_override(tmp_path, text, overrides, named, message):
    with pytest.raises(RecipeError, match="^" + re.escape(f"override '{named}': ") + message):
        load(_write(tmp_path, text), overrides)


# --- 3. overrides -----------------------------------------------------------------------------


@pytest.mark.parametrize(("arg", "expected"), [
    ("--train.steps=50", ("train", "steps", 50)),
    ("--optim.lr=1e-4", ("optim", "lr", 1e-4)),
    ("--model.size=8b", ("model", "size", "8b")),
    ("--train.output_dir=runs/x", ("train", "output_dir", "runs/x")),
    ("--parallel.dp_shard=-1", ("parallel", "dp_shard", -1)),
    ("--optim.betas=[0.9,0.99]", ("optim", "betas", [0.9, 0.99])),
    ("--checkpoint.async=true", ("checkpoint", "async", True)),
    ("--train.output_dir=a=b", ("train", "output_dir", "a=b")),
])
def test_parse_override_reads_toml_values(arg, expected):
    got = parse_override(arg)
    assert got == expected
    assert type(got[2]) is type(expected[2])


@pytest.mark.parametrize("arg", ["train.steps", "--trainsteps=5", "--train.steps", "--=5"])
def test_malformed_override_string(arg):
    with pytest.raises(RecipeError, match="^" + re.escape(f"override '{arg}': expected --section.key=value, "
                                                          "e.g. --train.steps=50") + "$"):
        parse_override(arg)
    with pytest.raises(RecipeError, match=re.escape(f"override '{arg}'")):
        load(None, [arg])


def test_override_values_land_typed_in_the_recipe():
    r = load(None, ["--train.steps=50", "--optim.lr=1e-4", "--model.size=8b", "--train.output_dir=runs/x",
                    "--parallel.dp_shard=-1", "--optim.betas=[0.9,0.99]", "--optim.weight_decay=0"])
    assert (r.train.steps, r.model.size, r.train.output_dir, r.parallel.dp_shard) == (50, "8b", "runs/x", -1)
    assert r.optim.lr == 1e-4 and r.optim.betas == (0.9, 0.99)
    assert type(r.optim.weight_decay) is float  # an int given for a float field becomes a float


def test_override_of_a_string_key_keeps_the_text():
    # A string field takes the text as written: a folder named 2024 is a folder, not an int.
    assert load(None, ["--train.output_dir=2024"]).train.output_dir == "2024"


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = _write(tmp_path, "[train]\nsteps = 20\nseed = 7\n[optim]\nlr = 3e-3\n", "mine.toml")
    r = load(path, ["--train.steps=50", "--optim.lr=1e-4", "--optim.lr=2e-4"])
    assert r.train.steps == 50  # command line
    assert r.optim.lr == 2e-4  # the last of repeated overrides
    assert r.train.seed == 7  # file
    assert r.train.global_batch == recipelib.TrainConfig().global_batch  # default
    assert r.train.output_dir == str(Path("runs") / "mine")


def test_override_adds_a_key_to_a_section_absent_from_the_file(tmp_path):
    path = _write(tmp_path, '[model]\nsize = "debug"\n')
    r = load(path, ["--checkpoint.keep=5", "--data.tokenizer=byte"])
    assert r.checkpoint.keep == 5 and r.data.tokenizer == "byte"


# --- 4. defaults ------------------------------------------------------------------------------


def test_empty_recipe_is_all_defaults(tmp_path):
    r = load(_write(tmp_path, "", "empty.toml"))
    defaults = Recipe()
    assert r == dataclasses.replace(defaults, train=dataclasses.replace(defaults.train, output_dir="runs/empty"))
    assert load(None).train.output_dir == str(Path("runs") / "default")


def test_output_dir_defaults_to_runs_and_recipe_stem(tmp_path):
    assert load(_write(tmp_path, "[train]\nsteps = 3\n", "my_run.toml")).train.output_dir == "runs/my_run"
    given = load(_write(tmp_path, '[train]\noutput_dir = "elsewhere"\n', "x.toml"))
    assert given.train.output_dir == "elsewhere"


def test_async_key_maps_to_async_save(tmp_path):
    r = load(_write(tmp_path, "[checkpoint]\nasync = true\n"))
    assert r.checkpoint.async_save is True
    assert load(None, ["--checkpoint.async=true"]).checkpoint.async_save is True
    section = dumps(r).split("[checkpoint]\n", 1)[1].split("\n\n", 1)[0]
    assert "async = true" in section.splitlines()
    assert "async_save" not in dumps(r)


@pytest.mark.parametrize(("text", "override", "mode"), [
    ("false", "false", None), ("true", "true", "thread"), ('"thread"', "thread", "thread"),
    ('"process"', "process", "process")])
def test_async_is_false_thread_or_process(text, override, mode, tmp_path):
    r = load(_write(tmp_path, f"[checkpoint]\nasync = {text}\n"))
    assert r.checkpoint.async_mode == mode  # true keeps meaning a thread
    assert load(None, [f"--checkpoint.async={override}"]).checkpoint == r.checkpoint
    assert f"async = {text}" in dumps(r).splitlines()
    assert load(_write(tmp_path, dumps(r), "again.toml")).checkpoint == r.checkpoint  # the round trip


# --- 5. describe_keys -------------------------------------------------------------------------


def test_describe_keys_documents_every_field():
    blocks = {b.splitlines()[0]: b for b in recipelib.describe_keys().strip().split("\n\n")}
    assert list(blocks) == [f"[{name}]" for name in SECTIONS]
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f.metadata.get("key") or f.name
            assert f.metadata["doc"], f"{name}.{f.name} has no doc"
            assert f"\n  {key} = " in blocks[f"[{name}]"], f"{name}.{key} missing from describe_keys"
            assert f.metadata["doc"] in blocks[f"[{name}]"]


# --- 6. mesh resolution -----------------------------------------------------------------------


def test_layout_that_does_not_multiply_prints_the_equation():
    cfg = ParallelConfig(pp=2, dp_shard=3, tp=2)
    equation = "[parallel] pp(2) * dp_replicate(1) * dp_shard(3) * cp(1) * tp(2) = 12 != world size 8"
    with pytest.raises(RecipeError, match="^" + re.escape(equation) + "; make the degrees multiply to 8"):
        meshlib.resolve(cfg, 8)


def test_dp_shard_minus_one_takes_the_ranks_left_over():
    layout = meshlib.resolve(ParallelConfig(pp=2, tp=2), 8)
    assert layout == meshlib.Layout(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert (layout.world_size, layout.dp, str(layout)) == (8, 2, "pp 2 x dp_shard 2 x tp 2")
    assert str(meshlib.resolve(ParallelConfig(), 1)) == "single rank"
    assert meshlib.resolve(ParallelConfig(dp_replicate=2, dp_shard=2), 4).dp == 4


def test_dp_shard_minus_one_with_indivisible_world_size():
    message = ("[parallel] dp_shard = -1 takes the ranks left over, but pp(1) * dp_replicate(1) * cp(1) * tp(3) = 3 "
               "does not divide the world size 8; change the degrees or run on a multiple of 3 ranks")
    with pytest.raises(RecipeError, match="^" + re.escape(message) + "$"):
        meshlib.resolve(ParallelConfig(tp=3), 8)


@pytest.mark.parametrize(("cfg", "n"), [
    (ParallelConfig(), 1),
    (ParallelConfig(pp=2, dp_replicate=2, tp=2), 8),
    (ParallelConfig(dp_shard=4, cp=2), 8),
])
def test_local_world_size(cfg, n):
    assert local_world_size(cfg) == n


# --- 7. preflight: checks that need data but no process group --------------------------------


@pytest.fixture
def byte_recipe(tmp_path, monkeypatch):
    """load() of a llama debug recipe on a small text file with the byte tokenizer."""
    monkeypatch.setenv("MESHPAR_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "tiny.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    path = _write(tmp_path, f'[data]\npath = "{text.as_posix()}"\ntokenizer = "byte"\n'
                            f"[train]\nseq_len = 32\nglobal_batch = 8\nmicro_batch = 2\n", "tiny.toml")
    return lambda *overrides: load(path, overrides)


def test_preflight_passes_on_a_good_recipe(byte_recipe):
    checked = preflight(byte_recipe("--model.vocab_size=256"), 1)
    assert (checked.accum, checked.corpus.vocab_size, checked.layout.world_size) == (4, 256, 1)


def test_preflight_default_dp_shard_takes_every_rank(byte_recipe):
    checked = preflight(byte_recipe("--model.vocab_size=256"), 2)  # dp_shard = -1 -> 2: FSDP over both ranks
    assert (checked.layout.dp_shard, checked.layout.dp, checked.accum) == (2, 2, 2)


@pytest.mark.parametrize(("world_size", "overrides", "message"), [
    (2, ["--parallel.dp_replicate=2", "--train.global_batch=6", "--train.micro_batch=2"],
     r"train\.global_batch \(6\) must be a multiple of train\.micro_batch \(2\) x data-parallel degree \(2\); "
     r"micro_batch values that fit: \[1, 3\]$"),
    (2, ["--parallel.dp_replicate=2", "--train.global_batch=3", "--train.micro_batch=1"],
     r"train\.global_batch \(3\) must be a multiple of .*none: raise global_batch to a multiple of 2$"),
    (1, [f"--train.seq_len={FAMILIES['llama'].sizes['debug'].max_seq_len + 1}"],
     rf"train\.seq_len \({FAMILIES['llama'].sizes['debug'].max_seq_len + 1}\) exceeds the model's max_seq_len "
     rf"\({FAMILIES['llama'].sizes['debug'].max_seq_len}\) for llama debug$"),
    (1, ["--data.val_fraction=0"],
     r"train\.eval_every > 0 needs held-out data; set data\.val_fraction > 0 or train\.eval_every = 0$"),
    (1, ["--model.vocab_size=200"],
     r"the data has 256 token ids but model\.vocab_size is 200; set model\.vocab_size = 256"),
    (1, ["--data.path=/nonexistent/meshpar.txt"],
     r"data\.path = '/nonexistent/meshpar\.txt': no such file, folder or glob$"),
    (3, ["--parallel.dp_replicate=2"], r"\[parallel\] dp_shard = -1 takes the ranks left over, but .*= 2 does not "
                                       r"divide the world size 3"),
    (2, ["--model.family=mistral"], r"^model\.family = 'mistral': unknown family; choose one of "),
    (2, ["--parallel.cp=2", "--model.family=gpt2"],
     r"^parallel\.cp = 2: context parallelism is not built yet for model family 'gpt2'"),
    (2, ["--parallel.cp=2", "--train.seq_len=66"],
     r"^parallel\.cp = 2: train\.seq_len \(66\) does not cut into 2 x cp = 4 equal chunks"),
], ids=["batch-dp", "batch-dp-none", "seq-len", "eval-no-val", "vocab", "data-path", "world-indivisible", "family",
        "cp-gpt2", "cp-seq-len"])
def test_preflight_errors(byte_recipe, world_size, overrides, message):
    with pytest.raises(RecipeError, match=message):
        preflight(byte_recipe(*overrides), world_size)


# --- 8. the command line ----------------------------------------------------------------------


def _meshpar(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "meshpar", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshpar: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("command", ["recipe", "train"])
def test_cli_unknown_key_is_one_line_and_exit_2(tmp_path, command):
    path = _write(tmp_path, "[train]\nstpes = 3\n")
    _assert_one_line_error(_meshpar(command, str(path)), str(path), "'stpes'", "did you mean 'steps'")


def test_cli_recipe_prints_resolved_toml():
    proc = _meshpar("recipe", "recipes/llama_debug.toml", "--train.steps=7")
    assert proc.returncode == 0, proc.stderr
    assert "\nsteps = 7\n" in proc.stdout
    resolved = recipelib.tomllib.loads(proc.stdout)
    assert resolved["train"]["steps"] == 7 and resolved["model"]["family"] == "llama"


def test_cli_keys():
    proc = _meshpar("recipe", "--keys")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == recipelib.describe_keys() + "\n"


def test_cli_train_with_bad_overrides():
    proc = _meshpar("train", "recipes/llama_debug.toml", "--trainsteps=5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--trainsteps=5" in proc.stderr and "--section.key=value" in proc.stderr
    _assert_one_line_error(_meshpar("train", "recipes/llama_debug.toml", "--train.steps=0"),
                           "override '--train.steps=0'", "must be >= 1")


def test_cli_recipe_folder_is_one_line_error():
    _assert_one_line_error(_meshpar("recipe", "recipes"), "recipes")


def test_cli_nproc_zero_is_refused():
    # --nproc 0 must not silently mean "the default"; the seq_len error stops any run if it does
    _assert_one_line_error(_meshpar("train", "recipes/llama_debug.toml", "--nproc", "0", "--train.seq_len=100000"),
                           "--nproc 0")


@pytest.mark.parametrize("args", [["--help"], ["data", "prepare", "--help"], ["recipe", "recipes/llama_debug.toml"],
                                  ["recipe", "--keys"], ["train", "recipes/llama_debug.toml", "--train.steps=0"],
                                  ["profile", "summarize", "recipes"], ["profile", "merge", "recipes"]])
def test_cli_answers_without_importing_torch(args):
    """Help, ``meshpar recipe``, a recipe error and the trace reports (here on a folder without
    traces) load no torch (meshpar/cli.py): they answer at once."""
    code = ("import runpy, sys; sys.argv = ['meshpar', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('meshpar', run_name='__main__')\n"
            "finally:\n    print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 2) and proc.stderr.splitlines()[-1] == "False", proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["recipe", "--help"]])
def test_cli_help_mentions_overrides(args):
    proc = _meshpar(*args)
    assert proc.returncode == 0, proc.stderr
    assert "--section.key=value" in proc.stdout and "override" in proc.stdout.lower()
