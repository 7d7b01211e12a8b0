"""Supervised fine-tuning through the training step: only the assistant's tokens train, and the loss
is normalised by the global batch's trained tokens, so the gradient does not depend on the layout
([Note: the loss over trained tokens] in meshpar/training/loss.py). Data preparation and packing:
tests/test_sft_data.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from meshpar.config import recipe as recipelib
from meshpar.data.packing import IGNORE
from meshpar.train import train
from meshpar.training import step as steplib
from meshpar.training.loss import TokenLoss
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, build_model, merged_state, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64, must_fail

# recipes/sft_debug.toml made small: 2 blocks, a 512-token BPE (the byte tokenizer has no separator),
# sequences of 256 (the dialogues average about 200 tokens, so rows hold one or two conversations)
SFT = [*SMALL, "--data.tokenizer=bpe", "--data.vocab_size=512", "--model.vocab_size=512", "--train.seq_len=256",
       "--train.steps=3", "--train.eval_every=3", "--train.eval_batches=1", "--data.val_fraction=0.05",
       "--train.sample_every=0"]


def _recipe(out, *extra: str) -> recipelib.Recipe:
    return recipelib.load(ROOT / "recipes" / "sft_debug.toml", [*SFT, f"--train.output_dir={out}", *extra])


def _batch(tmp_path, micro_batch: int = 8):
    """One step of the built-in dialogues as the loader gives it, and the tokenizer's vocabulary."""
    from meshpar.data import BatchLoader, prepare

    recipe = _recipe(tmp_path)
    corpus = prepare(recipe.data)
    loader = BatchLoader(corpus.train, seq_len=256, global_batch=8, micro_batch=micro_batch, dp_rank=0, dp_size=1,
                         seed=0)
    return loader.next_step(), corpus


def test_prompt_tokens_get_no_gradient(tmp_path, data_cache):
    """The logits of every position whose target is a prompt token (or padding) get exactly zero
    gradient, every assistant target a non-zero one, and the step's gradient is that of the summed
    loss of the assistant targets over their count, computed here by hand (float64)."""
    step, corpus = _batch(tmp_path)
    (inputs, targets), = step
    trained = targets != IGNORE
    assert 0 < trained.sum() < trained.numel() and step.trained == int(trained.sum())
    with default_dtype():
        model = build_model("llama", n_layers=2, vocab_size=512, document_eos=corpus.eos_id)
        logits = model(inputs)
        logits.retain_grad()
        loss_fn = TokenLoss()
        with loss_fn.weight(1 / step.trained):  # one rank, one microbatch: accum * D / N
            loss = loss_fn(logits, targets)
        loss.backward()
    grad = logits.grad.abs().sum(-1)
    assert torch.all(grad[~trained] == 0), "a prompt or padding target got a gradient"
    assert torch.all(grad[trained] > 0)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    with default_dtype():
        model.zero_grad()
        logits = model(inputs)
        logp = torch.log_softmax(logits, -1)
        picked = logp[trained].gather(-1, targets[trained][:, None])
        (-picked.sum() / trained.sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=TOL, atol=TOL, msg=name)


def test_weight_is_the_global_count(tmp_path, data_cache):
    """``token_weight``: accum x (dp x cp) / N, None for pretraining, 0 for a batch with nothing to train."""

    class Ranks:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    sync = steplib.GradSync(None, False, False, 1.0, dp=Ranks(4), cp=Ranks(2))
    assert steplib.token_weight(1000, 3, sync) == 3 * 8 / 1000
    assert steplib.token_weight(None, 3, sync) is None
    assert steplib.token_weight(0, 3, sync) == 0.0
    # and a plain mean over the trained targets outside a step (validation)
    logits, targets = torch.randn(2, 5, 7, dtype=torch.float64), torch.tensor([[1, IGNORE, 2, 3, IGNORE]] * 2)
    keep = targets != IGNORE
    want = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(TokenLoss()(logits, targets), want, rtol=TOL, atol=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """recipes/sft_debug.toml on one rank, the whole global batch in one microbatch (float64)."""
    with default_dtype():
        return train(_recipe(tmp_path_factory.mktemp("ref"), "--parallel.dp_shard=1", "--train.micro_batch=8"),
                     return_state=True)


def _assert_matches(records, state, reference) -> None:
    got, want = train_losses(records), train_losses(reference.records)
    assert len(got) == len(want) == 3
    torch.testing.assert_close(got, want, rtol=TOL, atol=0)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    torch.testing.assert_close(val, [r["val_loss"] for r in reference.records if "val_loss" in r], rtol=TOL, atol=0)
    assert [r["trained_frac"] for r in records if "loss" in r] == [r["trained_frac"] for r in reference.records
                                                                   if "loss" in r]
    assert state.keys() == reference.state_dict.keys()
    for name, want_p in reference.state_dict.items():
        torch.testing.assert_close(state[name], want_p, rtol=TOL, atol=TOL, msg=name)


LAYOUTS = {  # name: (overrides, world size); each splits the global batch's trained tokens differently
    "dp_shard2-accum2": (["--train.micro_batch=2"], 2),
    "dp_shard2-cp2": (["--train.micro_batch=4", "--parallel.cp=2"], 4),  # documents under the all-gather
    "replicate2": (["--parallel.dp_shard=1", "--parallel.dp_replicate=2", "--train.micro_batch=1"], 2),
}


@pytest.mark.parity
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layouts_match_one_rank(layout, reference, tmp_path):
    """Fine-tuning on 2 and 4 ranks, other microbatch splits, equals one rank in float64: losses,
    validation loss and every parameter to TOL after 3 steps."""
    overrides, world = LAYOUTS[layout]
    recipe = _recipe(tmp_path, *overrides)
    results = run_distributed(in_float64, world, train_on_rank, recipe, timeout=300, init_process_group=False)
    _assert_matches(results[0][0], merged_state(results), reference)


def test_a_per_microbatch_mean_depends_on_the_layout(reference, tmp_path, monkeypatch):
    """The comparison above bites: with each microbatch's own mean (the weight off), 4 microbatches
    of 2 rows weigh tokens differently from one of 8, and the parameters leave TOL."""
    monkeypatch.setattr(steplib, "token_weight", lambda trained, accum, sync: None)
    with default_dtype():
        run = train(_recipe(tmp_path, "--parallel.dp_shard=1", "--train.micro_batch=2"), return_state=True)
    must_fail(lambda: _assert_matches(run.records, run.state_dict, reference), "a mean per microbatch")


def test_meshpar_train_sft_debug(tmp_path, data_cache):
    """`meshpar train recipes/sft_debug.toml` (2 ranks, as shipped but shorter): the log shows the
    share of trained tokens, metrics.jsonl has it, and a sample is written."""
    args = ["--train.steps=2", "--train.log_every=1", "--train.eval_every=2", "--train.eval_batches=1",
            "--train.sample_every=2",
            "--train.seq_len=256", "--model.n_layers=2", "--data.vocab_size=512", "--model.vocab_size=512",
            "--metrics.progress=off", f"--train.output_dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "meshpar", "train", "recipes/sft_debug.toml", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks on cpu" in proc.stdout and "| trained " in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fractions = [r["trained_frac"] for r in records if "loss" in r]
    assert len(fractions) == 2 and all(0.05 < f < 0.95 for f in fractions), fractions
    sample = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[-1])
    assert sample["step"] == 2 and sample["prompt"].startswith("<|user|>")


def test_data_prepare_chat_folder_trains_as_the_rows(tmp_path, capsys):
    """`meshpar data prepare --chat` writes a chat folder that reads back as the same conversations as
    the rows tokenized through the cache; the separator is a special token the template never writes
    (its EOS ends every turn here)."""
    from meshpar.cli import main
    from meshpar.config.keys import DataConfig
    from meshpar.data.corpus import prepare
    from tests.test_chat import CHATML, _tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    _tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
            for i in range(20)] + [{"prompt": "2 + 2?", "completion": "4"}]
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(SystemExit) as done:
        main(["data", "prepare", str(tmp_path / "chats.jsonl"), "--chat", "--tokenizer", str(folder),
              "--out", str(tmp_path / "prepared"), "--progress=off"])
    assert done.value.code == 0
    assert "--data.format=chat" in capsys.readouterr().out
    kw = {"format": "chat", "tokenizer": str(folder), "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache")}
    ready = prepare(DataConfig(path=str(tmp_path / "prepared"), **kw))
    direct = prepare(DataConfig(path=str(tmp_path / "chats.jsonl"), **kw))
    assert ready.eos_id == direct.eos_id not in (None, ready.tokenizer.eos_id)
    for got, want in ((ready.train.tokens, direct.train.tokens), (ready.train.trained, direct.train.trained),
                      (ready.train.ends, direct.train.ends)):
        assert list(got) == list(want)
    last = slice(int(ready.train.ends[-2]), int(ready.train.ends[-1]))
    ids = [int(i) for i in ready.train.tokens[last]]
    trained = [i for i, t in zip(ids, ready.train.trained[last], strict=True) if t]
    assert ready.tokenizer.decode(trained) == "4<|im_end|>\n" and ids[-1] == ready.eos_id


def test_fine_tune_an_hf_model_on_a_chat_file(tmp_path, data_cache):
    """The issue's whole path in one process: a transformers Llama folder (family hf) with a ChatML
    tokenizer, fine-tuned 2 steps on a chat file written here; the loss falls on the assistant's
    tokens and the checkpoint converts back to a Hugging Face folder with its tokenizer."""
    transformers = pytest.importorskip("transformers")
    from meshpar.convert import convert
    from tests.test_chat import CHATML, _tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    _tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256).save_pretrained(folder)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(200)]
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = recipelib.load(ROOT / "recipes" / "sft_debug.toml", [
        "--model.family=hf", f"--model.hf_path={folder}", f"--data.path={tmp_path / 'chats.jsonl'}",
        f"--data.tokenizer={folder}", "--parallel.dp_shard=1", "--train.seq_len=128", "--train.global_batch=4",
        "--train.micro_batch=2", "--train.steps=4", "--train.log_every=1", "--train.eval_every=0",
        "--train.sample_every=0", "--checkpoint.every=4", "--metrics.progress=off", "--optim.warmup_steps=1",
        f"--train.output_dir={tmp_path / 'run'}"])
    with default_dtype():
        records = train(recipe).records
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert all(0 < r["trained_frac"] < 0.5 for r in records if "loss" in r)
    convert(tmp_path / "run" / "checkpoints" / "step_4", tmp_path / "hf", to="hf", progress=False)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.vocab_size == 400 and loaded.dtype == torch.float64
