"""``meshpar generate`` (meshpar/inference/generate.py, meshpar/models/decode.py): the KV cache
against recomputing the whole sequence at every token, sampling, loading a checkpoint or a Hugging
Face folder, greedy tokens against transformers' ``generate`` on the same folder, and samples
during training (``train.sample_every``).

Parity in float64: the cached forward and the whole-sequence forward compute the same rows in
another summation order (~1e-15 relative), so their logits agree to 1e-10 and their greedy tokens
are equal; a cache that misplaced one position (RoPE or the mask) would move logits by O(1e-2).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from meshpar import convert as cv
from meshpar.config.recipe import RecipeError
from meshpar.inference.generate import load_model
from meshpar.models import decode as genlib
from meshpar.models import get_family
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import SMALL, load_recipe, train_on_rank
from tests.test_convert import random_model, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save(no_dist=True)

PROMPT = [5, 17, 99, 3, 250, 12, 7]


def _model(family: str):
    torch.manual_seed(0)
    args = dataclasses.replace(get_family(family).sizes["debug"], n_layers=2, max_seq_len=64)
    model = get_family(family).model_cls(args)
    model.init_weights()
    return model.double().eval()


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_kv_cache_gives_the_whole_sequence_logits_and_tokens(family):
    ref = _model(family)
    cached = copy.deepcopy(ref)
    cache = genlib.use_cache(cached, len(PROMPT) + 12)
    tokens, new = list(PROMPT), torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(12):
            got = cached(new)[0, -1]
            cache.advance(new.shape[1])
            want = ref(torch.tensor([tokens]))[0, -1]
            assert (got - want).abs().max().item() <= 1e-10 * want.abs().max().item(), len(tokens)
            tokens.append(int(want.argmax()))
            new = torch.tensor([[tokens[-1]]])
    assert genlib.generate(copy.deepcopy(ref), PROMPT, 12) == tokens[len(PROMPT):]


def test_a_misplaced_cache_position_is_far_off():
    """Mutation: the positions slot one token behind (RoPE at the wrong offset) changes the logits."""
    ref = _model("llama")
    cached = copy.deepcopy(ref)
    cache = genlib.use_cache(cached, len(PROMPT) + 1)
    with torch.no_grad():
        cached(torch.tensor([PROMPT]))
        cache.advance(len(PROMPT) - 1)  # one short
        got = cached(torch.tensor([[1]]))[0, -1]
        want = ref(torch.tensor([[*PROMPT, 1]]))[0, -1]
    assert (got - want).abs().max().item() > 1e-4


def test_sampling_is_seeded_and_a_tiny_top_p_is_greedy():
    model = _model("llama")
    greedy = genlib.generate(copy.deepcopy(model), PROMPT, 8)
    a = genlib.generate(copy.deepcopy(model), PROMPT, 8, temperature=1.0, seed=3)
    assert a == genlib.generate(copy.deepcopy(model), PROMPT, 8, temperature=1.0, seed=3)
    assert a != genlib.generate(copy.deepcopy(model), PROMPT, 8, temperature=1.0, seed=4)
    assert genlib.generate(copy.deepcopy(model), PROMPT, 8, temperature=1.0, top_p=1e-9, seed=3) == greedy
    stop = greedy[2]
    assert genlib.generate(copy.deepcopy(model), PROMPT, 8, stop=stop) == greedy[:greedy.index(stop) + 1]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="max_seq_len 64"):
        genlib.generate(_model("llama"), PROMPT, 100)
    with pytest.raises(ValueError, match="GPT-2's learned positions"):
        genlib.use_cache(get_family("gpt2").model_cls(get_family("gpt2").sizes["debug"]), 8)
    with pytest.raises(ValueError, match="empty prompt"):
        genlib.generate(_model("llama"), [], 4)


def test_a_checkpoint_and_its_hugging_face_folder_load_the_same_model(tmp_path):
    save_checkpoint(tmp_path / "step_3", "llama")
    cv.convert(tmp_path / "step_3", tmp_path / "hf", "hf", progress=False)
    want = random_model("llama").state_dict()
    for path in (tmp_path / "step_3", tmp_path / "hf"):
        got = load_model(path).state_dict()
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert torch.equal(got[name], value), (path.name, name)


@pytest.mark.slow  # imports transformers (seconds)
def test_greedy_tokens_equal_transformers_generate(tmp_path):
    """On the same Hugging Face folder, meshpar's greedy tokens are transformers' (both in float64;
    transformers computes RoPE's angles in float32, ~1e-6 on the logits: no near tie at this seed)."""
    transformers = pytest.importorskip("transformers")
    save_checkpoint(tmp_path / "step_3", "llama")
    cv.convert(tmp_path / "step_3", tmp_path / "hf", "hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").double().eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(PROMPT):].tolist()
    ours = genlib.generate(load_model(tmp_path / "hf", dtype=torch.float64), PROMPT, 24)
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_cli_continues_a_prompt_from_a_trained_checkpoint(tmp_path, data_cache, capsys):
    """``meshpar generate`` on a byte-tokenizer run's checkpoint: the prompt and its continuation."""
    from meshpar.cli import main

    train(load_recipe("llama_debug.toml", tmp_path, *SMALL, "--train.steps=2", "--checkpoint.every=2"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["generate", str(tmp_path / "checkpoints" / "step_2"), "--prompt", "To be", "--max-new-tokens", "5"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    assert out.startswith("To be") and len(out.rstrip("\n")) > len("To be") and "5 tokens in" in err


SAMPLING = ["--train.sample_every=2", '--train.sample_prompt="To be"', "--train.sample_tokens=12"]


def _samples_match_the_checkpoints(out) -> list[dict]:
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4] and all(s["text"] for s in samples)
    for s in samples:  # the greedy tokens of the checkpoint saved at that step, in one process
        model = load_model(out / "checkpoints" / f"step_{s['step']}")
        assert genlib.generate(model, list(b"To be"), 12) == s["tokens"], s["step"]
    return samples


def test_samples_during_training_leave_it_unchanged(tmp_path, data_cache):
    """train.sample_every on one rank: each sample is the greedy continuation the checkpoint of its
    step gives ``meshpar generate``, and the run's losses equal a run without samples bit for bit
    (the slots and the mode are put back)."""
    base = [*SMALL, "--train.steps=4", "--checkpoint.every=2"]
    sampled = train(load_recipe("llama_debug.toml", tmp_path / "sampled", *base, *SAMPLING)).records
    plain = train(load_recipe("llama_debug.toml", tmp_path / "plain", *base)).records
    assert [r for r in sampled if "loss" in r] and _strip(sampled) == _strip(plain)
    _samples_match_the_checkpoints(tmp_path / "sampled")


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "mem_gb")} for r in records]


@pytest.mark.timeout(240)
def test_samples_under_fsdp_are_one_process_greedy_tokens(tmp_path, data_cache):
    """train.sample_every at dp_shard 2: both ranks run the sample (each forward gathers the
    parameters); it is what one process generates from the checkpoint of that step."""
    recipe = load_recipe("llama_debug_fsdp.toml", tmp_path, *SMALL, "--train.steps=4", "--checkpoint.every=2",
                         *SAMPLING)
    run_distributed(train_on_rank, 2, recipe, timeout=200, init_process_group=False)
    _samples_match_the_checkpoints(tmp_path)


@pytest.mark.parametrize("override, named", [("--parallel.cp=2", "parallel.cp = 2"), ("--parallel.tp=2", "parallel.tp"),
                                             ("--parallel.compile=true", "parallel.compile")])
def test_sampling_refuses_what_it_does_not_run_on(tmp_path, override, named):
    from meshpar.training.preflight import preflight

    recipe = load_recipe("llama_debug.toml", tmp_path, *SAMPLING, override, "--parallel.dp_shard=1")
    with pytest.raises(RecipeError, match=named):
        preflight(recipe, 2 if "cp" in override or "tp" in override else 1)


def test_cli_errors_name_the_path_and_the_fix(tmp_path, capsys):
    from meshpar.inference.generate import main

    assert main([str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text"}')
    assert main([str(tmp_path), "--prompt", "hi"]) == 2
    assert "not a family meshpar converts" in capsys.readouterr().err
