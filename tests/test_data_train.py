"""Training a Hugging Face model folder, with its own tokenizer, on corpora in
the formats they come in (JSON Lines gzip, Parquet), as a mixture, on 2 FSDP ranks, resumed on 4;
``meshpar data prepare``; and the one-line errors before any process starts."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.config.recipe import RecipeError
from meshpar.data import prepare
from meshpar.data.prepared import builtin_text, open_prepared
from meshpar.data.tokenizer import load_tokenizer
from meshpar.train import train
from meshpar.training.preflight import preflight
from tests.distributed import run_distributed
from tests.helpers import ROOT, load_recipe, train_losses

pa = pytest.importorskip("pyarrow")  # the data extra, installed by scripts/setup.sh (dev)
import pyarrow.parquet as pq  # noqa: E402


def _documents() -> list[str]:
    """The built-in corpus cut into its scenes: a few thousand documents of ~1-5 KB."""
    text = builtin_text()
    return [d for d in text.split("\n\n\n") if d.strip()]


def write_corpora(folder: Path) -> tuple[Path, Path]:
    """The built-in text as a .jsonl.gz corpus (even documents) and a Parquet one (odd)."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = _documents()
    jsonl = folder / "plays.jsonl.gz"
    with gzip.open(jsonl, "wt", encoding="utf-8") as f:
        for d in docs[0::2]:
            f.write(json.dumps({"id": len(d), "text": d}) + "\n")
    parquet = folder / "plays.parquet"
    pq.write_table(pa.table({"text": docs[1::2]}), parquet, row_group_size=200)
    return jsonl, parquet


def _on_rank(recipe):
    return train(recipe).records


def _run(world: int, recipe) -> list[dict]:
    if world == 1:
        return train(recipe).records
    return run_distributed(_on_rank, world, recipe, timeout=300, init_process_group=False)[0]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A Hugging Face folder made by ``meshpar convert --to hf`` from a short bpe run: weights, config and
    the run's tokenizer."""
    from meshpar.convert import convert

    out = tmp_path_factory.mktemp("hf_source")
    recipe = load_recipe("llama_debug.toml", out / "run", "--train.steps=2", "--checkpoint.every=2",
                         "--data.tokenizer=bpe", "--data.vocab_size=512", "--model.vocab_size=512",
                         f"--data.cache_dir={out / 'cache'}")
    train(recipe)
    convert(out / "run" / "checkpoints" / "step_2", out / "hf", "hf", progress=False)
    return out / "hf"


@pytest.mark.parity
def test_hf_folder_tokenizer_mixture_on_2_ranks_resumes_on_4(hf_folder, tmp_path):
    tok = load_tokenizer(str(hf_folder))
    jsonl, parquet = write_corpora(tmp_path / "corpus")
    data = [f"--checkpoint.hf_weights={hf_folder}", "--data.tokenizer=auto", "--model.vocab_size=512",
            f"--data.sources=[{{path = \"{jsonl}\", weight = 0.6}}, {{path = \"{parquet}\", weight = 0.4}}]",
            f"--data.cache_dir={tmp_path / 'cache'}", "--parallel.dp_shard=-1"]
    straight = _run(2, load_recipe("llama_debug.toml", tmp_path / "two", *data, "--train.steps=4",
                                   "--checkpoint.every=2"))
    step2 = tmp_path / "two" / "checkpoints" / "step_2"
    resumed = _run(4, load_recipe("llama_debug.toml", tmp_path / "four", *data, "--train.steps=4",
                                  f"--checkpoint.load_from={step2}"))
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4]
    # float32 across layouts: the derivation of tests/test_checkpoint.py's
    # test_data_position_reshards_from_dp4_to_dp2 (rtol 1e-5 is 100x the summation noise; a
    # skipped or repeated sample moves a loss by > 1e-3, asserted below)
    torch.testing.assert_close(train_losses(resumed), train_losses(straight)[2:], rtol=1e-5, atol=0)
    assert abs(train_losses(straight)[0] - train_losses(resumed)[0]) > 1e-3
    # the tokens are the folder's tokenizer's: the first document of the jsonl source, encoded by tokenizers itself
    corpus = prepare(load_recipe("llama_debug.toml", tmp_path / "x", *data).data, str(hf_folder))
    with gzip.open(jsonl, "rt") as f:
        first = json.loads(f.readline())["text"]
    want = tok.tok.encode(first, add_special_tokens=False).ids + [tok.eos_id]
    assert np.asarray(corpus.sources[0][np.arange(len(want))]).tolist() == want
    assert corpus.eos_id == tok.eos_id and corpus.weights == (0.6, 0.4)


def test_prepare_command_and_training_from_the_folder(hf_folder, tmp_path):
    jsonl, parquet = write_corpora(tmp_path / "corpus")
    out = tmp_path / "prepared"
    cmd = [sys.executable, "-m", "meshpar.cli", "data", "prepare", str(jsonl), str(parquet), "--tokenizer",
           str(hf_folder), "--out", str(out), "--workers", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout and "peak RSS" in done.stdout, done.stdout
    prepared = open_prepared(out)
    docs = _documents()
    assert prepared.meta["documents"] == len(docs)
    tok = load_tokenizer(str(hf_folder))
    ids = [i for d in docs[0::2] + docs[1::2] for i in tok.encode(d) + [tok.eos_id]]
    assert np.asarray(prepared.tokens).tolist() == ids
    # a second run finds it done; a run killed mid-way redoes only the missing shard
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already prepared" in again.stdout
    (out / "meta.json").unlink()
    (out / "shards" / "00001.json").unlink()
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0 and "1 file(s) kept from an interrupted run" in resumed.stdout, resumed.stdout
    assert np.asarray(open_prepared(out).tokens).tolist() == ids
    # data.path = the folder trains (1 rank, 2 steps), with the folder's tokenizer and document-causal attention
    recipe = load_recipe("llama_debug.toml", tmp_path / "run", f"--data.path={out}", "--model.vocab_size=512",
                         "--train.steps=2", "--data.tokenizer=auto", "--model.attention=document")
    assert preflight(recipe, 1).args.document_eos == tok.eos_id
    records = train(recipe).records
    assert len(train_losses(records)) == 2 and all(np.isfinite(train_losses(records)))


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """A folder holding only a byte-level BPE's tokenizer.json (vocabulary up to 512, with an EOS), trained
    on a slice of the built-in text: what the recipe errors below read of a Hugging Face folder."""
    from meshpar.data.tokenizer import BPETokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    for name, data in BPETokenizer.train(_documents()[:40], 512).hf_files().items():
        (out / name).write_bytes(data)
    return out


@pytest.mark.parametrize("case, overrides, key, message", [
    ("unknown tokenizer", ["--data.tokenizer={d}/nope.json"], "data.tokenizer", "no such file"),
    ("missing text field", ["--data.path={d}/plays.jsonl.gz", "--data.text_field=body"], "data.text_field", "body"),
    ("empty source", ["--data.path={d}/empty.jsonl"], "data.path", "no tokens"),
    ("vocabulary too large", ["--data.tokenizer={hf}", "--model.vocab_size=256"], "data.tokenizer", "vocabulary"),
    ("document attention without EOS", ["--model.attention=document"], "model.attention", "EOS"),
    ("document attention under pp", ["--model.attention=document", "--data.tokenizer={hf}", "--model.vocab_size=512",
                                     "--parallel.pp=2", "--train.micro_batch=1"], "model.attention", "pp > 1"),
    ("auto without a tokenizer", ["--checkpoint.hf_weights={d}", "--data.tokenizer=auto"], "data.tokenizer",
     "no tokenizer.json"),
])
def test_errors_before_any_process(tokenizer_folder, tmp_path, case, overrides, key, message):
    write_corpora(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    args = [o.format(d=tmp_path, hf=tokenizer_folder) for o in overrides]
    recipe = load_recipe("llama_debug.toml", tmp_path / "run", f"--data.cache_dir={tmp_path / 'cache'}", *args)
    with pytest.raises(RecipeError, match=message) as err:
        preflight(recipe, 2 if "--parallel.pp=2" in args else 1)
    assert err.value.key == key and "\n" not in str(err.value)


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "meshpar.cli", "train", str(ROOT / "recipes" / "llama_debug_fsdp.toml"),
           f"--data.tokenizer={tmp_path / 'nope.json'}", f"--train.output_dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("meshpar: error:") and "data.tokenizer" in done.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_sources_round_trip_through_the_resolved_recipe(tmp_path):
    recipe = recipelib.load(None, ['--data.sources=[{path = "a.jsonl", weight = 2}, {path = "b.parquet"}]'])
    assert [(s.path, s.weight) for s in recipe.data.sources] == [("a.jsonl", 2.0), ("b.parquet", 1.0)]
    path = tmp_path / "r.toml"
    path.write_text(recipelib.dumps(recipe))
    assert recipelib.load(path).data == recipe.data
    with pytest.raises(RecipeError, match=r"data\.sources\[0\]\.weight = 0\.0: must be > 0"):
        recipelib.load(None, ['--data.sources=[{path = "a", weight = 0}]'])
    with pytest.raises(RecipeError, match=r"unknown key in \[data\.sources\[0\]\] 'wieght'"):
        recipelib.load(None, ['--data.sources=[{path = "a", wieght = 1}]'])
