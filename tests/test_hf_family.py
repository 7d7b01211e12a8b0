"""``model.family = "hf"``: transformers' own models trained by meshpar (meshpar/models/hf).

FSDP on 2 ranks equals one process in float64 for Llama, Qwen2 and two architectures meshpar does
not build itself (Gemma: tied embeddings, (1 + w) norms, scaled embeddings; Phi-3: fused q/k/v and
gate/up projections), and so do HSDP with the loss in chunks and transformers' own tensor-parallel
plan (with FSDP, and with gathered logits), two pipeline stages, and context parallelism (Llama;
Granite, whose attention scale is its own, with FSDP and the ring; Qwen2 with tp); a checkpoint
converts to a folder transformers loads with the same logits; the hf Llama trains as meshpar's own
llama family on the same weights; packed documents attend apart; the planner plans an hf 8B as
meshpar's llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.config.errors import RecipeError
from meshpar.train import train
from tests.distributed import run_distributed
from tests.helpers import ROOT, SMALL, merged_state, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64, must_fail

transformers = pytest.importorskip("transformers")

SMALL_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {  # architecture -> its transformers config, small
    "llama": lambda: transformers.LlamaConfig(**SMALL_DIMS),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL_DIMS),
    "gemma": lambda: transformers.GemmaConfig(**SMALL_DIMS, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**SMALL_DIMS, pad_token_id=0),
    # its attention scaled by attention_multiplier, not 1/sqrt(head_dim); embeddings, residuals and logits scaled
    "granite": lambda: transformers.GraniteConfig(**SMALL_DIMS, attention_multiplier=0.3, embedding_multiplier=2.0,
                                                  residual_multiplier=0.5, logits_scaling=4.0),
    # a sliding window of 16 tokens: shorter than the 32-token sequences of the cp job below
    "mistral": lambda: transformers.MistralConfig(**SMALL_DIMS, sliding_window=16),
}
STEPS = ["--train.steps=2", "--train.eval_every=2", "--data.val_fraction=0.1", "--train.seq_len=64"]


def _folder(tmp: Path, arch: str) -> Path:
    folder = tmp / arch
    CONFIGS[arch]().save_pretrained(folder)
    return folder


def _recipe(out: Path, folder: Path, *extra: str) -> recipelib.Recipe:
    return recipelib.load(ROOT / "recipes" / "llama_debug.toml",
                          [*SMALL, *STEPS, "--model.family=hf", f"--model.hf_path={folder}",
                           f"--train.output_dir={out}", *extra])


def _assert_same(records, state, reference) -> None:
    torch.testing.assert_close(train_losses(records), train_losses(reference.records), rtol=TOL, atol=0)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    torch.testing.assert_close(val, [r["val_loss"] for r in reference.records if "val_loss" in r], rtol=TOL, atol=0)
    assert state.keys() == reference.state_dict.keys()
    for name, want in reference.state_dict.items():
        assert want.dtype == torch.float64, name
        torch.testing.assert_close(state[name], want, rtol=TOL, atol=TOL, msg=name)


LAYOUTS = {  # name: (overrides, world size)
    "fsdp2-full-ac": (["--parallel.dp_shard=2", '--parallel.activation_checkpoint="full"', "--train.micro_batch=2"], 2),
    # replicas of FSDP groups, and the loss applying lm_head in 3 chunks (the head_in_loss slot)
    "hsdp2x2-chunked-loss": (["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.micro_batch=1",
                              "--train.loss_chunks=3"], 4),
    # transformers' own tp plan (meshpar/models/hf/parallelize.py), FSDP over it, logits vocab-sharded
    "fsdp2-tp2": (["--parallel.dp_shard=2", "--parallel.tp=2", "--train.micro_batch=2"], 4),
    "tp2-gathered-logits": (["--parallel.tp=2", "--parallel.loss_parallel=false"], 2),
    # two pipeline stages: transformers' base model on each stage's layers ([Note: a transformers model in
    # pipeline stages]); with FSDP on each stage, and the last stage's head in the chunked loss
    "pp2": (["--parallel.pp=2", "--train.micro_batch=2"], 2),
    "pp2-fsdp2-chunked-loss": (["--parallel.pp=2", "--parallel.dp_shard=2", "--train.micro_batch=1",
                                "--train.loss_chunks=2"], 4),
    # every layer's attention through meshpar's cp attention ([Note: routing a transformers model's attention]);
    # with FSDP over dp_shard x cp and K, V passed around a ring
    "cp2": (["--parallel.cp=2"], 2),
    "cp2-fsdp2-ring": (["--parallel.cp=2", "--parallel.dp_shard=2", "--train.micro_batch=4",
                        '--parallel.cp_attention="ring"'], 4),
    # the routed attention on each tp rank's heads, K and V gathered over cp
    "cp2-tp2": (["--parallel.cp=2", "--parallel.tp=2"], 4),
}


@pytest.mark.parity
@pytest.mark.parametrize(("arch", "layout"), [*[(a, "fsdp2-full-ac") for a in ("llama", "qwen2", "gemma", "phi3")],
                                              ("llama", "hsdp2x2-chunked-loss"), ("qwen2", "fsdp2-tp2"),
                                              ("phi3", "tp2-gathered-logits"), ("llama", "pp2"),
                                              ("phi3", "pp2-fsdp2-chunked-loss"), ("llama", "cp2"),
                                              ("granite", "cp2-fsdp2-ring"), ("qwen2", "cp2-tp2")])
def test_fsdp_matches_one_process(arch, layout, tmp_path, data_cache):
    """A random model of each architecture (meshpar's layout-independent init of its linear and
    embedding weights, transformers' of the rest), 2 steps on 2 FSDP ranks with full activation
    checkpointing (and Llama under HSDP with a chunked loss), equals one process in float64: losses,
    validation loss, every parameter to TOL."""
    folder = _folder(tmp_path, arch)
    with default_dtype():
        reference = train(_recipe(tmp_path / "one", folder), return_state=True)
    assert train_losses(reference.records)[0] == pytest.approx(5.545, abs=0.2)  # about ln 256: a fresh model
    overrides, world = LAYOUTS[layout]
    recipe = _recipe(tmp_path / "two", folder, *overrides)
    results = run_distributed(in_float64, world, train_on_rank, recipe, timeout=300, init_process_group=False)
    _assert_same(results[0][0], merged_state(results), reference)
    if layout == "fsdp2-full-ac" and arch == "llama":  # the comparison bites: a 1e-7 change in one layer fails it
        state = {k: v * (1 + 1e-7) if "layers.0" in k else v for k, v in merged_state(results).items()}
        must_fail(lambda: _assert_same(results[0][0], state, reference), "one layer scaled by 1e-7")


def test_checkpoint_converts_to_a_folder_transformers_loads(tmp_path, data_cache):
    """A float64 run's checkpoint (Gemma: tied embeddings) -> `meshpar convert --to hf` -> transformers'
    from_pretrained gives the trained model's logits exactly (same code, same weights, same order),
    and the folder loads back into family hf bit for bit."""
    from meshpar.convert import convert

    folder = _folder(tmp_path, "gemma")
    with default_dtype():
        run = train(_recipe(tmp_path / "run", folder, "--checkpoint.every=2"), return_state=True)
    convert(tmp_path / "run" / "checkpoints" / "step_2", tmp_path / "hf", to="hf", progress=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gemma" and config["dtype"] == "float64"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    ours = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "hf"),
                                                         dtype=torch.float64)
    ours.load_state_dict(run.state_dict, strict=False)
    ours.tie_weights()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, ours(tokens).logits)
    assert torch.equal(loaded.lm_head.weight, run.state_dict["model.embed_tokens.weight"])
    # and back: the folder loads into family hf (checkpoint.hf_weights' path) with every tensor as trained
    from meshpar.convert import load_hf_weights
    from meshpar.models.hf import HFArgs, HFCausalLM

    args = HFArgs.from_folder(str(tmp_path / "hf"))
    with default_dtype():
        back = HFCausalLM(args)
    load_hf_weights(back.state_dict(), tmp_path / "hf", "hf", args)
    for name, value in back.state_dict().items():
        assert torch.equal(value, run.state_dict[name]), name


def test_hf_llama_trains_as_meshpar_llama(tmp_path, data_cache):
    """The same Llama weights (a transformers folder) trained 2 steps by family hf and by meshpar's own
    llama, float64: the losses agree to 1e-6 relative. Not 1e-9: the implementations differ in RoPE,
    transformers' inverse frequencies being float32 (1e-7 relative on each angle) and meshpar's
    float64, and in summation orders; a wrong weight mapping or mask would move the loss by 1e-2."""
    from meshpar.models.llama import LLAMA_SIZES
    from meshpar.models.llama import convert as llama_convert

    args = LLAMA_SIZES["debug"].__class__(**{**LLAMA_SIZES["debug"].__dict__, "n_layers": 2, "vocab_size": 256})
    config = llama_convert.hf_config("llama", args, torch.float64)
    folder = tmp_path / "llama"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=torch.float64)
    model.save_pretrained(folder)
    start = [f"--checkpoint.hf_weights={folder}"]
    with default_dtype():
        theirs = train(_recipe(tmp_path / "hf", folder, *start)).records
        ours = train(recipelib.load(ROOT / "recipes" / "llama_debug.toml",
                                    [*SMALL, *STEPS, *start, f"--train.output_dir={tmp_path / 'ours'}"])).records
    torch.testing.assert_close(train_losses(theirs), train_losses(ours), rtol=1e-6, atol=0)


def test_recipe_errors(tmp_path):
    folder = _folder(tmp_path, "llama")
    from meshpar.models import get_family

    bare = recipelib.load(ROOT / "recipes" / "llama_debug.toml", ["--model.family=hf"])
    with pytest.raises(RecipeError, match="needs the model's folder: set model.hf_path"):
        get_family("hf").model_args(bare.model)
    with pytest.raises(RecipeError, match='model.hf_path .* is read only by model.family = "hf"'):
        recipelib.load(ROOT / "recipes" / "llama_debug.toml", [f"--model.hf_path={folder}"])
    from meshpar.training.preflight import check_layout

    with pytest.raises(RecipeError, match="parallel.compile = true with parallel.cp = 2 is not built for model.fam"):
        check_layout(_recipe(tmp_path, folder, "--parallel.cp=2", "--parallel.compile=true"), 2)
    with pytest.raises(RecipeError, match="parallel.pp = 2: gemma ties its output to its embedding"):
        check_layout(_recipe(tmp_path, _folder(tmp_path, "gemma"), "--parallel.pp=2", "--train.micro_batch=2"), 2)
    with pytest.raises(RecipeError, match="parallel.tp = 2: gemma ties its output to its embedding"):
        check_layout(_recipe(tmp_path, _folder(tmp_path, "gemma"), "--parallel.tp=2"), 2)
    with pytest.raises(RecipeError, match=r"parallel.tp = 8: num_attention_heads \(4\) is not divisible by 8"):
        check_layout(_recipe(tmp_path, folder, "--parallel.tp=8"), 8)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_document_attention_packs_like_separate_documents(arch, tmp_path):
    """With document_eos set, a packed row's logits equal each document run alone (float64), so
    fine-tuning on packed conversations (data.format = "chat") works for any architecture."""
    import dataclasses

    from meshpar.models.hf import HFArgs, HFCausalLM

    args = dataclasses.replace(HFArgs.from_folder(str(_folder(tmp_path, arch))), document_eos=7)
    with default_dtype():
        torch.manual_seed(0)
        model = HFCausalLM(args)
        model.init_weights()
        first = torch.randint(8, 256, (11,), generator=torch.Generator().manual_seed(1))
        first[-1] = 7
        second = torch.randint(8, 256, (9,), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            packed = model(torch.cat([first, second])[None])[0]
            alone = [model(d[None])[0] for d in (first, second)]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=TOL, atol=TOL)
    with torch.no_grad():
        plain = model.hf(torch.cat([first, second])[None]).logits[0]
    assert (plain[11:] - alone[1]).abs().max() > 1e-3  # without the mask the second document sees the first


@pytest.mark.slow  # a target-size plan
def test_plan_of_an_hf_llama_8b_matches_meshpars_llama(tmp_path):
    """`meshpar plan recipes/llama3_8b.toml` with family hf on the same architecture's config.json: the
    same parameters, FLOPs and step time, and a peak within 1% of meshpar's own llama (transformers'
    blocks keep other activations for backward); the simulation builds two blocks of the 32
    (``copy_with_layers``) and extrapolates."""
    from meshpar.models.llama import LLAMA_SIZES
    from meshpar.models.llama import convert as llama_convert
    from tests.test_plan import _run

    folder = tmp_path / "l8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama_convert.hf_config("llama", LLAMA_SIZES["8b"],
                                                                           torch.bfloat16)))
    recipe = str(ROOT / "recipes" / "llama3_8b.toml")
    code, out, err, hf, _ = _run(recipe, "--model.family=hf", f"--model.hf_path={folder}")
    assert code == 0, err
    own = _run(recipe)[3]
    assert hf.n_params == own.n_params == 8_030_261_248
    assert hf.time.tokens_per_s == pytest.approx(own.time.tokens_per_s, rel=1e-3)
    assert hf.ranks[0].peak_bytes == pytest.approx(own.ranks[0].peak_bytes, rel=0.01)


def test_pipeline_stages_refuse_a_model_that_changes_its_embeddings(tmp_path):
    """GPT-2 adds its position embeddings inside its base model's forward, after the token embedding:
    a later pipeline stage handed hidden states would add them again. Untied (so the split itself is
    allowed), the stage refuses at its first forward ([Note: a transformers model in pipeline stages]);
    Llama's two stages give the whole model's logits exactly."""
    from meshpar.models.hf import HFArgs, HFCausalLM

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    gpt2 = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                   tie_word_embeddings=False)
    for arch, config in (("gpt2", gpt2),
                         ("llama", transformers.LlamaConfig(**SMALL_DIMS))):
        config.save_pretrained(tmp_path / arch)
        torch.manual_seed(0)
        model = HFCausalLM(HFArgs.from_folder(str(tmp_path / arch)))
        model.init_weights()
        first = model.copy_with_layers([0], first=True, last=False)
        last = model.copy_with_layers([1], first=False, last=True)
        assert any(".1." in k for k in last.state_dict()) and not any(".0." in k for k in last.state_dict())
        with torch.no_grad():
            if arch == "gpt2":
                with pytest.raises(RecipeError, match="changes its embeddings before its first decoder layer"):
                    last(first(tokens))
            else:
                assert torch.equal(last(first(tokens)), model(tokens))


def test_tensors_the_model_does_not_read_are_named(tmp_path):
    """A folder holding tensors no parameter is read from (an MTP head, a stray export) loads, and the
    returned line (which the run prints) names them: nothing is skipped silently."""
    from safetensors.torch import load_file, save_file

    from meshpar.convert import load_hf_weights
    from meshpar.models.hf import HFArgs, HFCausalLM

    folder = tmp_path / "llama"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(folder)
    args = HFArgs.from_folder(str(folder))
    assert load_hf_weights(HFCausalLM(args).state_dict(), folder, "hf", args) == ""
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "model.mtp.eh_proj.weight": torch.zeros(4, 4)}, folder / "model.safetensors",
              metadata={"format": "pt"})
    note = load_hf_weights(HFCausalLM(args).state_dict(), folder, "hf", args)
    assert "1 tensors not read (model.mtp.eh_proj.weight)" in note and "has no place for them" in note


def _documents_under_cp(folders: dict[str, Path]) -> dict:
    """On 2 cp ranks in float64, each model against one process: logits of the rank's tokens and every
    gradient (averaged over the ranks), as the largest difference relative to the largest magnitude.
    Llama on packed documents with each cp attention (and with its documents dropped, which must differ);
    Mistral with a window as long as the sequence, and one shorter (refused)."""
    import copy
    import dataclasses

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from meshpar.models.hf import HFArgs, HFCausalLM
    from meshpar.parallel.context_parallel.apply import ATTENTIONS, apply_context_parallel
    from meshpar.parallel.context_parallel.layout import sequence_indices, shard_sequence
    from tests.test_document_attention import EOS, packed_documents

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.set_default_dtype(torch.float64)

    def compare(args, tokens, attention="allgather", causal=False) -> dict[str, float]:
        torch.manual_seed(0)
        model = HFCausalLM(args)
        model.init_weights()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        cp = copy.deepcopy(model)
        if causal:  # the cp model's documents dropped
            cp.args = dataclasses.replace(args, document_eos=-1)
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        apply_context_parallel(cp, mesh, attention=attention)
        local = cp(shard_sequence(inputs, mesh))
        F.cross_entropy(local.flatten(0, 1), shard_sequence(targets, mesh).flatten()).backward()
        idx = sequence_indices(inputs.shape[1], 2, mesh.get_local_rank())
        diff = {"logits": ((local - logits[:, idx]).abs().max() / logits.abs().max()).item()}
        for (name, p), q in zip(cp.named_parameters(), model.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            diff[name] = ((grad / 2 - q.grad).abs().max() / q.grad.abs().max()).item()
        return diff

    out = {}
    llama = dataclasses.replace(HFArgs.from_folder(str(folders["llama"])), document_eos=EOS)
    tokens, _ = packed_documents(256)  # [2, 33]: documents whose boundaries fall inside the ranks' chunks
    for attention in ATTENTIONS:
        out[attention] = compare(llama, tokens, attention)
    out["documents dropped"] = compare(llama, tokens, causal=True)
    random = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    config = json.loads((folders["mistral"] / "config.json").read_text())
    out["window = sequence"] = compare(HFArgs.from_config({**config, "sliding_window": 32}), random)
    try:
        compare(HFArgs.from_config(config), random)
    except RecipeError as e:
        out["window < sequence"] = str(e)
    return out


@pytest.mark.parity
@pytest.mark.timeout(300)
def test_context_parallel_attends_as_one_process(tmp_path):
    """[Note: routing a transformers model's attention]: packed documents over 2 cp ranks, with the
    all-gather, the ring and Ulysses, give one process's document-causal logits and gradients to TOL
    (and do not with the documents dropped); a sliding window as long as the sequence is plain causal
    attention and runs, a shorter one is refused at the first forward, naming it."""
    folders = {arch: _folder(tmp_path, arch) for arch in ("llama", "mistral")}
    r = run_distributed(_documents_under_cp, 2, folders, timeout=240)[0]
    for case in ("allgather", "ring", "ulysses", "window = sequence"):
        assert max(r[case].values()) <= TOL, (case, {k: v for k, v in r[case].items() if v > TOL})
    assert r["documents dropped"]["logits"] > 1e-3, r["documents dropped"]
    assert "MistralAttention asks for sliding-window attention" in r["window < sequence"], r["window < sequence"]
