"""Every check of a run that needs no process group, so bad input stops before any rank starts.

    checked = preflight(recipe, world_size)   # raises RecipeError naming the key and the fix
    checked.layout, checked.accum, checked.family, checked.args, checked.corpus

``meshpar train`` runs ``preflight`` before starting ranks, and each rank again before it
joins; ``meshpar plan`` runs ``check_layout`` (everything but the data) at the target size.
The checks against the model registry live here, not in meshpar.config.recipe, which imports
nothing else of meshpar; ``check_model`` is the part that needs no world size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from meshpar.config.keys import MOE_KEYS, ModelConfig
from meshpar.config.recipe import Recipe, RecipeError
from meshpar.data import BPETokenizer, ByteTokenizer, Corpus, prepare
from meshpar.data.tokenizer import load_tokenizer
from meshpar.distributed import mesh as meshlib
from meshpar.models import MOE_FAMILIES, Family, get_family
from meshpar.parallel.context_parallel.ulysses import check_heads
from meshpar.parallel.parallelize import check_mixed_precision
from meshpar.parallel.pipeline import SCHEDULES, check_microbatches, stage_layers
from meshpar.parallel.tensor_parallel.checks import check_seq_len
from meshpar.profiling.capture import check as check_profile


def _check_batch(recipe: Recipe, layout: meshlib.Layout) -> int:
    """Gradient-accumulation depth, or a RecipeError naming the batch keys and working values."""
    t = recipe.train
    per_step = t.micro_batch * layout.dp
    if t.global_batch % per_step:
        fits = [m for m in range(1, t.global_batch + 1) if t.global_batch % (m * layout.dp) == 0]
        raise RecipeError(f"train.global_batch ({t.global_batch}) must be a multiple of train.micro_batch "
                          f"({t.micro_batch}) x data-parallel degree ({layout.dp}); micro_batch values that fit: "
                          f"{fits or 'none: raise global_batch to a multiple of ' + str(layout.dp)}")
    return t.global_batch // per_step


@dataclass(frozen=True)
class Preflight:
    """What a run is made of, found before any process group exists."""

    layout: meshlib.Layout
    accum: int  # microbatches per optimizer step on each rank
    family: Family
    args: Any  # the family's model args
    corpus: Corpus


def _attention(recipe: Recipe, layout: meshlib.Layout, args: Any, corpus: Corpus) -> Any:
    """The model args with document-causal attention's EOS id when ``model.attention = "document"``."""
    if recipe.model.attention == "causal":
        return args
    if corpus.eos_id is None:
        raise RecipeError(f"model.attention = 'document' needs documents that end with an EOS token id, and "
                          f"{corpus.name} has none (the byte tokenizer and token files mark no documents); use "
                          f"data.tokenizer = 'bpe' or a Hugging Face tokenizer, or model.attention = 'causal'",
                          "model.attention")
    return dataclasses.replace(args, document_eos=corpus.eos_id)


def check_document_attention(recipe: Recipe, layout: meshlib.Layout) -> None:
    """``model.attention = "document"`` against the layout (what needs no data); chat data needs it."""
    if recipe.data.format == "chat" and recipe.model.attention != "document":
        raise RecipeError("data.format = 'chat' packs whole conversations into each sequence, and with "
                          "model.attention = 'causal' each would see the ones packed before it; set "
                          "model.attention = \"document\" ([Note: packing conversations])", "model.attention")
    if recipe.model.attention == "document" and layout.pp > 1:
        raise RecipeError("model.attention = 'document' with parallel.pp > 1 is not built yet: the stages after "
                          "the first do not see the token ids the mask comes from; use parallel.pp = 1 or "
                          "model.attention = 'causal'", "model.attention")


def check_model(recipe: Recipe) -> tuple[Family, Any]:
    """The recipe's model against the registry, before any world size: (family, model args).
    Raises RecipeError naming the families, the sizes, or a parallel dim the family cannot run yet."""
    family = get_family(recipe.model.family)  # raises naming the families
    family.check_degrees({dim: getattr(recipe.parallel, dim) for dim in meshlib.DIMS})
    if family.moe is None:
        for key in MOE_KEYS:
            value = getattr(recipe.model, key)
            if value != getattr(ModelConfig, key):
                raise RecipeError(f"model.{key} = {json.dumps(value)}: model family '{family.name}' has no experts "
                                  f"(it applies to {', '.join(MOE_FAMILIES)}); remove it", f"model.{key}")
    args = family.model_args(recipe.model)  # raises naming the sizes
    return family, args


def check_float8_device(recipe: Recipe) -> None:
    """``meshpar train``'s check that this machine runs ``model.float8`` (``meshpar plan`` plans any)."""
    m = recipe.model
    if m.float8 == "none" or m.float8_emulate:
        return
    import torch

    spec = recipe.train.device
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        raise RecipeError(f"model.float8 = {m.float8!r} on CPU runs only emulated: set model.float8_emulate = true "
                          f"(the same numbers, for tests), or train on a float8 GPU", "model.float8_emulate")
    if torch.cuda.get_device_capability() < (8, 9):
        raise RecipeError(f"model.float8 = {m.float8!r} needs a GPU with float8 matmuls (compute capability 8.9: "
                          f"L4, H100 and later); this {torch.cuda.get_device_name()} has "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability()))}; set model.float8 = \"none\"",
                          "model.float8")


def check_layout(recipe: Recipe, world_size: int) -> tuple[meshlib.Layout, int, Family, Any]:
    """The checks of a recipe's layout against its model at ``world_size`` that need neither data
    nor a process group (``meshpar plan`` runs them too): (layout, microbatches per step,
    family, model args); raises RecipeError naming the key to change."""
    t = recipe.train
    family, args = check_model(recipe)
    layout = meshlib.resolve(recipe.parallel, world_size)
    family.check_degrees(dataclasses.asdict(layout))  # dp_shard = -1 resolved
    accum = _check_batch(recipe, layout)
    family.check_layout(args, layout)
    if t.loss_chunks > 1 and (why := family.chunked_loss_refusal(args)):
        raise RecipeError(f"train.loss_chunks = {t.loss_chunks}: {why}; the loss in chunks applies the head alone, "
                          "a chunk at a time; set train.loss_chunks = 1", "train.loss_chunks")
    if layout.cp > 1:
        check_context_parallel(recipe, layout, args)
    else:
        check_seq_len(t.seq_len, layout.tp)
    check_document_attention(recipe, layout)
    check_mixed_precision(recipe.parallel, layout)
    check_profile(recipe.profile, world_size)
    if layout.pp > 1:
        p = recipe.parallel
        stage_layers(args.n_layers, layout.pp * p.pp_virtual_stages, p.pp_boundaries)  # raises naming the key
        check_microbatches(p.pp_schedule, accum, layout.pp, p.pp_virtual_stages,
                           local_batch=t.global_batch // layout.dp, key="train.micro_batch")
        if p.grad_reduce == "microbatch" and SCHEDULES[p.pp_schedule].split_backward:
            raise RecipeError(f"parallel.grad_reduce = 'microbatch' with parallel.pp_schedule = {p.pp_schedule!r}: "
                              f"the zero-bubble schedules split backward into input and weight passes and reduce "
                              f"once per step; use grad_reduce = 'step', or a 1f1b / gpipe / interleaved_1f1b "
                              f"schedule", key="parallel.grad_reduce")
    if 0 < args.max_seq_len < t.seq_len:  # 0: no limit the config states (recurrent models)
        raise RecipeError(f"train.seq_len ({t.seq_len}) exceeds the model's max_seq_len ({args.max_seq_len}) "
                          f"for {family.label(recipe.model, args)}")
    return layout, accum, family, args


def check_context_parallel(recipe: Recipe, layout, args: Any) -> None:
    """cp > 1: the sequence cuts into 2cp chunks ([Note: balanced sequence split]) and each rank's
    T/cp tokens split again over tp; what context parallelism does not run yet is refused."""
    t, cp, tp = recipe.train, layout.cp, layout.tp
    if t.seq_len % (2 * cp):
        raise RecipeError(f"parallel.cp = {cp}: train.seq_len ({t.seq_len}) does not cut into 2 x cp = {2 * cp} "
                          f"equal chunks (each cp rank holds one from the front and its mirror from the back); "
                          f"use a multiple of {2 * cp}", key="parallel.cp")
    check_seq_len(t.seq_len // cp, tp)
    if recipe.model.family == "hf" and recipe.parallel.compile:
        raise RecipeError(f"parallel.compile = true with parallel.cp = {cp} is not built for model.family = 'hf' "
                          "(transformers' layers call meshpar's cp attention from inside the compiled block, which "
                          "[Note: compiling a block under cp] splits only for meshpar's own blocks); set "
                          "parallel.compile = false or parallel.cp = 1", key="parallel.compile")
    if recipe.parallel.cp_attention == "ulysses":
        why = check_heads(args.n_heads, args.n_kv_heads, cp, tp)
        if why is not None:
            raise RecipeError(why, key="parallel.cp")


def _check_tokenizer_vocabulary(name: str, vocab_size: int, args: Any) -> None:
    if vocab_size > args.vocab_size:
        raise RecipeError(f"data.tokenizer: {name} has a vocabulary of {vocab_size} tokens but the model's is "
                          f"{args.vocab_size}; use the model's own tokenizer, or set model.vocab_size >= {vocab_size}",
                          "data.tokenizer")


def _check_sampling(recipe: Recipe) -> None:
    """train.sample_every: what the sampler in the loop (meshpar/inference/generate.py) runs on."""
    p = recipe.parallel
    for key, value, why in (("pp", p.pp, "a pipeline stage holds part of the model"),
                            ("cp", p.cp, "its attention fills the slot the KV cache takes"),
                            ("tp", p.tp, "one-token forwards under sequence parallelism are not checked"),
                            ("ep", p.ep, "one-token forwards through the experts' all-to-alls are not checked")):
        if value > 1:
            raise RecipeError(f"train.sample_every with parallel.{key} = {value} is not built ({why}); set "
                              f"train.sample_every = 0, or sample from a checkpoint with `meshpar generate`",
                              "train.sample_every")
    if p.compile:
        raise RecipeError("train.sample_every with parallel.compile = true is not built (each new length would "
                          "recompile the blocks); set train.sample_every = 0, or sample from a checkpoint with "
                          "`meshpar generate`", "train.sample_every")
    family = get_family(recipe.model.family)
    if family.sample_refusal is not None:
        raise RecipeError(f"train.sample_every with model family '{family.name}' is not built "
                          f"({family.sample_refusal}); set train.sample_every = 0", "train.sample_every")


def preflight(recipe: Recipe, world_size: int) -> Preflight:
    """Every check that needs no process group; raises RecipeError naming the key to change.

    ``meshpar train`` runs it before starting ranks, and each rank again before it joins.
    """
    t = recipe.train
    layout, accum, family, args = check_layout(recipe, world_size)
    check_float8_device(recipe)
    if t.eval_every and recipe.data.val_fraction == 0:
        raise RecipeError("train.eval_every > 0 needs held-out data; set data.val_fraction > 0 or "
                          "train.eval_every = 0")
    if t.sample_every:
        _check_sampling(recipe)
    if recipe.data.tokenizer not in ("bpe", "byte", "auto"):  # a tokenizer file: its vocabulary before tokenizing
        _check_tokenizer_vocabulary(recipe.data.tokenizer, load_tokenizer(recipe.data.tokenizer).vocab_size, args)
    corpus = prepare(recipe.data, recipe.checkpoint.hf_weights)
    if t.sample_every and corpus.tokenizer is None:
        raise RecipeError("train.sample_every needs a tokenizer to write text; token files have none: set "
                          "train.sample_every = 0", "train.sample_every")
    if corpus.vocab_size > args.vocab_size:
        if recipe.data.tokenizer not in ("bpe", "byte") and corpus.tokenizer is not None \
                and not isinstance(corpus.tokenizer, (BPETokenizer, ByteTokenizer)):
            _check_tokenizer_vocabulary(corpus.name, corpus.vocab_size, args)
        raise RecipeError(f"the data has {corpus.vocab_size} token ids but model.vocab_size is {args.vocab_size}; "
                          f"set model.vocab_size = {corpus.vocab_size} (or a smaller data.vocab_size)")
    args = _attention(recipe, layout, args, corpus)
    return Preflight(layout, accum, family, args, corpus)
