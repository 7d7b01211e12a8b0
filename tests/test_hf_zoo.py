"""The transformers zoo under ``model.family = "hf"``: every model type of transformers'
``AutoModelForCausalLM`` mapping (tests/hf_zoo.py makes a tiny random model of each) is in exactly
one state of docs/huggingface.md's table, and this file holds each type to its row:

- **trains**: a folder transformers saved imports (``checkpoint.hf_weights``), and meshpar's first
  loss on 1 rank equals the cross-entropy of transformers' own logits on the same batch (eager
  attention, to ``LOSS_BOUND``); 2 steps under FSDP on 2 ranks, and under tp 2 and with the loss in
  2 chunks where the row says meshpar accepts them, give 1 rank's losses, in float64 to ``TOL`` (in
  float32 to ``FP32_TOL`` where the model's code computes in float32: ``one_rank_reference``). Where the row
  says tp or the chunks are refused, meshpar refuses them before launch with the row's reason. Over 2 cp
  ranks each rank's logits and every gradient equal one process's (``CP_TOL``), or meshpar refuses as the
  row says, before launch or at the first forward.
- **refused**: meshpar refuses the type before launch, with the row's reason.
- **known failing**: it fails as the row says (a bug to fix; the test fails once it no longer does,
  so the row must move to trains).
- **skipped**: tests/hf_zoo.py's ``skip_rule`` (multimodal, encoders, encoder-decoders).

A dozen types (``FAST``) run in the inner loop; the rest of the one-rank sweep is in the slow tier.
The layout sweeps and the cp one (one spawned job each; the layouts take a fresh rendezvous port per
type: [Note: ports under pytest-xdist] in tests/distributed.py) cover ``FAST`` in the suite and every type under
``MESHPAR_HF_ZOO=all`` (``rest``: all but ``FAST``, what .ci/run sets in a step of its own after the
suite: 12 minutes of two busy ranks beside the suite's other worker starved that worker's spawned jobs
past their deadlines).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

from meshpar.config import recipe as recipelib
from meshpar.config.errors import RecipeError
from tests.distributed import free_port, run_distributed
from tests.helpers import ROOT, SMALL, train_losses
from tests.hf_zoo import causal_lm_types, skip_rule, tiny_config
from tests.parity import TOL, default_dtype

transformers = pytest.importorskip("transformers")

# The same weights, one batch of 8 x 64 tokens, in the run's dtype (``one_rank_reference``): meshpar's
# forward (sdpa or the model's own attention) against transformers' eager one, whose softmax is float32
# whatever the dtype, differs by float32 rounding at most, each logit to a few float32 ulps of
# |logit| < 10 (~1e-6), so the mean loss (~5.5) to ~1e-6 relative; 2e-5 leaves 20x room. Granite's
# head without its logits_scaling moved the loss by 3e-3 relative.
LOSS_BOUND = 2e-5
FAST = ("llama", "qwen3", "gpt2", "gpt_neox", "granite", "gemma2", "olmoe", "mixtral", "phi3", "falcon_mamba",
        "deepseek_v3", "bamba")
# A model whose own code computes in float32 whatever the default dtype (Mamba's and RWKV's kernels, XLNet's
# attention) is compared across layouts in float32: its losses differ by summation order, ~1e-7 relative
# in the first (measured up to 9e-8 here), and after one AdamW step a parameter whose gradient is near
# zero may step either way, by lr = 1.5e-3 at most; 1e-5 relative leaves 100x room. It is loose: a
# gradient missing a rank's part moved Apertus's second loss under tp by only 1.3e-6 relative, which
# is why float64 (TOL) is the default and this bound only the fallback.
FP32_TOL = 1e-5
LAYOUTS = {  # name: (overrides, world size)
    "fsdp2": (["--parallel.dp_shard=2", "--train.micro_batch=4"], 2),
    "tp2": (["--parallel.tp=2"], 2),
    "chunks2": (["--train.loss_chunks=2"], 1),
}
DOC = ROOT / "docs" / "huggingface.md"
COLUMNS = ("state", "fsdp", "tp", "chunks", "pp", "cp", "reason")
# cp 2 against one process, model against model (``_cp_case``), in the dtype of ``one_rank_reference``: in
# float64 the routed attention's numbers equal the model's own to ~1e-15, but models whose own code computes
# parts in float32 whatever the dtype (routers, Gemma's and Cohere's norms) give their gradients to float32
# rounding, measured up to 4.4e-7 relative (glm4_moe's router); 1e-5 leaves 20x room. A real defect is far
# larger: the tokens' local positions in place of their global ones moved Llama's logits by 7e-3 relative and
# its gradients by 1.1.
CP_TOL = 1e-5


@functools.cache
def table() -> dict[str, dict[str, str]]:
    """docs/huggingface.md's zoo table: model type -> {column: cell} (``COLUMNS``)."""
    text = DOC.read_text()
    section = text[text.index("## The transformers zoo"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = dict(zip(COLUMNS, cells[1:], strict=True))
    return rows


def types_in(state: str, among: tuple[str, ...] | None = None) -> list:
    """pytest params of the table's types in ``state``, FAST ones in the inner loop, others slow."""
    return [pytest.param(t, marks=() if t in FAST else pytest.mark.slow) for t, row in table().items()
            if row["state"] == state and (among is None or t in among)]


def swept(model_type: str) -> bool:
    """Whether the spawned sweeps take ``model_type``: the ``FAST`` ones, or with MESHPAR_HF_ZOO=all every
    type, with MESHPAR_HF_ZOO=rest every other (.ci/run's step after the suite, which ran ``FAST``)."""
    which = os.environ.get("MESHPAR_HF_ZOO", "")
    return which == "all" or (model_type in FAST) != (which == "rest")


@functools.cache
def folder(model_type: str) -> Path:
    """A tiny random ``model_type`` saved by transformers (its own init, seed 0): what a user downloads."""
    path = Path(tempfile.mkdtemp(prefix=f"zoo-{model_type}-"))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(path)
    return path


def recipe(model_type: str, out: Path, *extra: str, path: Path | None = None) -> recipelib.Recipe:
    """2 steps from the folder's weights (``path``, else ``folder``), one microbatch of 8 x 64 byte
    tokens, the folder's own sizes."""
    path = path or folder(model_type)
    return recipelib.load(ROOT / "recipes" / "llama_debug.toml",
                          [*SMALL, "--train.steps=2", "--train.micro_batch=8", "--model.n_layers=0",
                           "--model.vocab_size=0", "--model.family=hf", f"--model.hf_path={path}",
                           f"--checkpoint.hf_weights={path}", f"--train.output_dir={out}", "--fault.timeout=20",
                           *extra])


def first_batch(r: recipelib.Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The first step's one microbatch (inputs, targets) of a one-rank run of ``r``."""
    from meshpar.data.loader import BatchLoader
    from meshpar.training.preflight import preflight

    t, corpus = r.train, preflight(r, 1).corpus
    loader = BatchLoader(corpus.train, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=t.micro_batch,
                         dp_rank=0, dp_size=1, seed=t.seed)
    (x, y), = loader.next_step()
    return torch.as_tensor(x), torch.as_tensor(y)


def transformers_loss(model_type: str, dtype: torch.dtype) -> float:
    """The mean cross-entropy of transformers' own logits (``from_pretrained`` in ``dtype``, eager
    attention; in float64 its eager experts, as meshpar's) of the folder's model on the first batch.
    Computed here from the logits: some causal LMs' own losses (CPM-Ant, TrOCR, XLNet) ignore
    ``shift_labels``."""
    x, y = first_batch(recipe(model_type, Path(tempfile.mkdtemp())))
    kernels = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder(model_type), attn_implementation="eager",
                                                              dtype=dtype, **kernels)
    try:
        with torch.no_grad():
            logits = model(input_ids=x).logits
    except RuntimeError:  # transformers' own code in float64 (XGLM's float32 mask constant): its float32 run
        if dtype == torch.float32:
            raise
        return transformers_loss(model_type, torch.float32)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


def train_here(r: recipelib.Recipe) -> list[float]:
    from meshpar.train import train

    return train_losses(train(r).records)


@functools.cache
def one_rank_reference(model_type: str) -> tuple[torch.dtype, list[float]]:
    """(the dtype the layouts compare in, one rank's 2 losses in it): float64, or float32 where the
    model's own code cannot run float64 or computes in float32 anyway (its float64 losses are float32
    numbers)."""
    try:
        with default_dtype():
            losses = train_here(recipe(model_type, Path(tempfile.mkdtemp())))
        if any(x != float(torch.tensor(x, dtype=torch.float32)) for x in losses):
            return torch.float64, losses
    except Exception:  # noqa: BLE001 - the model's code cannot run float64 (XLNet): float32, where it fails again if not
        pass
    with default_dtype(torch.float32):
        return torch.float32, train_here(recipe(model_type, Path(tempfile.mkdtemp())))


def refusal(model_type: str, *extra: str) -> str | None:
    """The RecipeError meshpar raises before launch for ``model_type`` with ``extra``, or None."""
    from meshpar.training.preflight import check_layout

    r = recipe(model_type, Path(tempfile.mkdtemp()), *extra)
    try:
        check_layout(r, 2 if {"--parallel.tp=2", "--parallel.pp=2", "--parallel.cp=2"} & set(extra) else 1)
    except RecipeError as e:
        return str(e)
    return None


def pipeline_refusal(model_type: str) -> str | None:
    """Why meshpar refuses 2 pipeline stages of ``model_type`` (before launch, or at the stages' first
    forward), how they fail loudly otherwise ("fails: ..."), or None when the two stages run in one
    process give the whole model's logits exactly: the same layers on the same inputs ([Note: a
    transformers model in pipeline stages])."""
    from meshpar.models.hf import HFArgs, HFCausalLM

    refused = refusal(model_type, "--parallel.pp=2", "--train.micro_batch=4")
    if refused:
        return refused
    args = HFArgs.from_folder(str(folder(model_type)))
    torch.manual_seed(0)
    model = HFCausalLM(args)
    model.init_weights()
    half = args.n_layers // 2
    first = model.copy_with_layers(range(half), first=True, last=False)
    last = model.copy_with_layers(range(half, args.n_layers), first=False, last=True)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            piped = last(first(tokens))
    except RecipeError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a stage that fails loudly (not a refusal): the row quotes it
        return f"fails: {type(e).__name__}: {e}"
    with torch.no_grad():
        whole = model(tokens)
    assert torch.equal(piped, whole), f"{model_type}: 2 stages differ from the whole by {(piped - whole).abs().max()}"
    return None


def _cp_on_rank(cases: list[tuple[str, Path, torch.dtype]]) -> dict[str, dict[str, float] | str]:
    """Each (type, folder, dtype) over 2 cp ranks (``_cp_case``); a type that fails is recorded, not
    raised: its refusal's words, or "fails: " and its error."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    results: dict[str, dict[str, float] | str] = {}
    for model_type, path, dtype in cases:
        try:
            with default_dtype(dtype):
                results[model_type] = _cp_case(path, mesh)
        except RecipeError as e:
            results[model_type] = str(e)
        except Exception as e:  # noqa: BLE001 - reported by the test, per type
            results[model_type] = f"fails: {type(e).__name__}: {str(e)[:300]}"
    return results


def _cp_case(path: Path, mesh) -> dict[str, float]:
    """The model of ``path`` (meshpar's init, seed 0) on 2 sequences of 32 tokens: one process's logits
    and gradients, and the same model's over cp ([Note: routing a transformers model's attention]) on
    this rank's tokens, its gradients averaged over the ranks as FSDP over cp does. Returns each one's
    largest difference, relative to the largest magnitude of the whole run's."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F

    from meshpar.models.hf import HFArgs, HFCausalLM
    from meshpar.parallel.context_parallel.apply import apply_context_parallel
    from meshpar.parallel.context_parallel.layout import sequence_indices, shard_sequence

    args = HFArgs.from_folder(str(path))
    torch.manual_seed(0)
    model = HFCausalLM(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    cp = copy.deepcopy(model)
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    apply_context_parallel(cp, mesh)
    local = cp(shard_sequence(inputs, mesh))
    F.cross_entropy(local.flatten(0, 1), shard_sequence(targets, mesh).flatten()).backward()
    idx = sequence_indices(32, mesh.size(), mesh.get_local_rank())
    diff = {"logits": ((local - logits[:, idx]).abs().max() / logits.abs().max()).item()}
    # a gradient that is zero but for rounding (a key bias: softmax ignores a constant added to every score)
    # is compared against the largest one's scale
    floor = max(q.grad.abs().max() for q in model.parameters() if q.grad is not None) * 1e-6
    for (name, p), q in zip(cp.named_parameters(), model.parameters(), strict=True):
        if q.grad is None:
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        diff[name] = ((grad / mesh.size() - q.grad).abs().max() / q.grad.abs().max().clamp_min(floor)).item()
    return diff


def cp_outcomes(types: list[str]) -> dict[str, float | str]:
    """Each type over 2 cp ranks: its largest relative difference from one process (``_cp_case``), or its
    refusal (before launch, or at the first forward), or "fails: " and its error."""
    out: dict[str, float | str] = {}
    cases = []
    for t in types:
        why = refusal(t, "--parallel.cp=2")
        if why:
            out[t] = why
        else:
            cases.append((t, folder(t), one_rank_reference(t)[0]))
    got = run_distributed(_cp_on_rank, 2, cases, timeout=600)[0] if cases else {}
    out.update({t: r if isinstance(r, str) else max(r.values()) for t, r in got.items()})
    return out


def test_the_table_lists_every_registered_type_once_with_the_skip_rule():
    """Every type of the installed transformers' mapping has a row, no row names another, and the
    skipped rows are exactly the ones ``skip_rule`` skips, for its reason."""
    rows = table()
    assert sorted(rows) == causal_lm_types(), "docs/huggingface.md's zoo table is not the mapping's types"
    for model_type, row in rows.items():
        assert row["state"] in ("trains", "refused", "known failing", "skipped"), (model_type, row)
        why = skip_rule(model_type)
        assert (row["state"] == "skipped") == (why is not None), (model_type, row, why)
        if why:
            assert row["reason"] == why, model_type
    trains = sum(row["state"] == "trains" for row in rows.values())
    text_only = sum(row["state"] != "skipped" for row in rows.values())
    assert trains >= 0.9 * text_only, f"{trains} of {text_only} text-only types train and match"


@pytest.mark.parametrize("model_type", types_in("trains"))
def test_one_rank_equals_transformers(model_type):
    """The folder imports, the first loss is transformers' own (``LOSS_BOUND``), and the row's tp,
    chunks and pp columns say what meshpar accepts: "yes", or the refusal's words."""
    row = table()[model_type]
    dtype, losses = one_rank_reference(model_type)
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
    want = transformers_loss(model_type, dtype)
    assert losses[0] == pytest.approx(want, rel=LOSS_BOUND), (losses[0], want)
    for column, why in (("tp", refusal(model_type, "--parallel.tp=2")),
                        ("chunks", refusal(model_type, "--train.loss_chunks=2")), ("pp", pipeline_refusal(model_type))):
        if row[column] == "yes":
            assert why is None, f"{model_type}: {column} is refused: {why}"
        else:
            assert why is not None and row[column] in why, (model_type, column, why)


@pytest.mark.parametrize("model_type", types_in("refused"))
def test_refused_before_launch_naming_the_reason(model_type):
    why = refusal(model_type)
    assert why is not None and table()[model_type]["reason"] in why, why


@pytest.mark.slow
def test_known_failures_still_fail_as_written(tmp_path):
    """Each known failure (none today) still fails, with its row's words in its error: when one is
    fixed, this fails until its row moves to trains."""
    for model_type, row in table().items():
        if row["state"] != "known failing":
            continue
        with pytest.raises(Exception) as failure:  # noqa: PT011 - the row names what it is
            train_here(recipe(model_type, tmp_path / model_type))
        assert row["reason"] in f"{type(failure.value).__name__}: {failure.value}", model_type


def _sweep_on_rank(cases: list[tuple[str, Path, list[str], torch.dtype, int | None]],
                   out: str) -> dict[str, list[float] | str]:
    """Each (type, folder, overrides, dtype, port), on its own rendezvous port on spawned ranks; a type
    that fails is recorded, not raised, so the job goes on (fault.timeout bounds a peer left waiting)."""
    results: dict[str, list[float] | str] = {}
    for model_type, path, extra, dtype, port in cases:
        if port is not None:
            os.environ["MASTER_PORT"] = str(port)
        try:
            with default_dtype(dtype):
                results[model_type] = train_here(recipe(model_type, Path(out) / model_type, *extra, path=path))
        except Exception as e:  # noqa: BLE001 - reported by the test, per type
            results[model_type] = f"{type(e).__name__}: {str(e)[:500]}"
    return results


@pytest.mark.slow  # not marked parity: .ci/run's reruns on other kernel paths take test_hf_family.py's cases
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_rank(layout, tmp_path):
    """Every type that trains: 2 steps on ``layout`` (where its row accepts it) give one rank's losses,
    in float64 to TOL (or in float32 to FP32_TOL, ``one_rank_reference``). One spawned job runs them all."""
    column = {"fsdp2": "fsdp", "tp2": "tp", "chunks2": "chunks"}[layout]
    rows = table()
    # fsdp: every type that trains runs, and one whose row quotes a failure must fail with it; tp, chunks:
    # the ones meshpar accepts (the others' refusals are checked before launch in the one-rank test)
    types = [t for t, row in rows.items() if row["state"] == "trains" and (layout == "fsdp2" or row[column] == "yes")
             and swept(t)]
    overrides, world = LAYOUTS[layout]
    want = {t: one_rank_reference(t) for t in types}
    cases = [(t, folder(t), overrides, want[t][0], free_port() if world > 1 else None) for t in types]
    if world == 1:
        got = _sweep_on_rank(cases, str(tmp_path))
    else:
        got = run_distributed(_sweep_on_rank, world, cases, str(tmp_path), timeout=600,
                              init_process_group=False)[0]
    wrong = {}
    for t in types:
        dtype, losses = want[t]
        tol = TOL if dtype == torch.float64 else FP32_TOL
        if rows[t][column] != "yes":
            if not (isinstance(got[t], str) and rows[t][column] in got[t]):
                wrong[t] = (got[t], rows[t][column])
            continue
        if isinstance(got[t], str) or not torch.allclose(torch.tensor(got[t]), torch.tensor(losses), rtol=tol, atol=0):
            wrong[t] = (got[t], losses, str(dtype))
    assert not wrong, f"{len(wrong)} of {len(types)} types differ from one rank under {layout}: {wrong}"


@pytest.mark.slow  # as test_layouts_equal_one_rank
@pytest.mark.timeout(900)
def test_context_parallel_equals_one_process():
    """Every type that trains, over 2 cp ranks where its row accepts it: each rank's logits and every
    gradient (averaged over the ranks) equal one process's to CP_TOL; where its row quotes a refusal, meshpar
    refuses with it (before launch, or at the first forward: [Note: routing a transformers model's
    attention]). One spawned job runs them all."""
    rows = table()
    types = [t for t, row in rows.items() if row["state"] == "trains"
             and swept(t)]
    got = cp_outcomes(types)
    wrong = {t: (got[t], rows[t]["cp"]) for t in types
             if not (got[t] <= CP_TOL if rows[t]["cp"] == "yes" and isinstance(got[t], float)
                     else isinstance(got[t], str) and rows[t]["cp"] in got[t])}
    assert not wrong, f"{len(wrong)} of {len(types)} types are not as their cp cell says: {wrong}"
    assert any(rows[t]["cp"] == "yes" for t in types) and any(rows[t]["cp"] != "yes" for t in types)


def _cell(why: str) -> str:
    """A refusal as the table quotes it: its first clause after the key (a substring of the message);
    a failure: its first 100 characters."""
    if why.startswith("fails: "):
        return why.splitlines()[0][:100].replace("|", "/")
    return re.split(r"[;(]|, and |, or |, which ", why.split(": ", 1)[1])[0].strip().replace("|", "/")


def row(model_type: str, fsdp: str = "yes", cp: str = "yes") -> str:
    """``model_type``'s table row as this checkout and the installed transformers give it (a failure
    that is not a refusal is written as known failing, for a person to read and file); ``fsdp``, ``cp``:
    its cells from the 2-rank jobs (``fsdp_cells``, ``cp_cell``)."""
    import contextlib
    import io

    why = skip_rule(model_type)
    if why:
        return f"| `{model_type}` | skipped | - | - | - | - | - | {why} |"
    refused = refusal(model_type)
    if refused:
        return f"| `{model_type}` | refused | - | - | - | - | - | {_cell(refused)} |"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            dtype, losses = one_rank_reference(model_type)
        want = transformers_loss(model_type, dtype)
    except Exception as e:  # noqa: BLE001 - the row says what failed
        text = f"{type(e).__name__}: {e}".splitlines()[0][:120].replace("|", "/")
        return f"| `{model_type}` | known failing | - | - | - | - | - | {text} |"
    if losses[0] != pytest.approx(want, rel=LOSS_BOUND):
        return f"| `{model_type}` | known failing | - | - | - | - | - | a wrong loss: {losses[0]} against {want} |"
    cells = [_cell(w) if w else "yes" for w in (refusal(model_type, "--parallel.tp=2"),
                                                  refusal(model_type, "--train.loss_chunks=2"),
                                                  pipeline_refusal(model_type))]
    return f"| `{model_type}` | trains | {fsdp} | {' | '.join(cells)} | {cp} |  |"


def fsdp_cells(types: list[str]) -> dict[str, str]:
    """The fsdp cell of each type: "yes" where 2 FSDP ranks give one rank's losses, else its error."""
    want = {t: one_rank_reference(t) for t in types}
    cases = [(t, folder(t), LAYOUTS["fsdp2"][0], want[t][0], free_port()) for t in types]
    got = run_distributed(_sweep_on_rank, 2, cases, tempfile.mkdtemp(), timeout=600, init_process_group=False)[0]
    tol = {torch.float64: TOL, torch.float32: FP32_TOL}
    return {t: got[t].splitlines()[0][:100].replace("|", "/") if isinstance(got[t], str) else
            "yes" if torch.allclose(torch.tensor(got[t]), torch.tensor(want[t][1]), rtol=tol[want[t][0]], atol=0)
            else f"a wrong loss: {got[t]} against {want[t][1]}" for t in types}


def cp_cell(outcome: float | str) -> str:
    """The cp cell of a ``cp_outcomes`` value."""
    if isinstance(outcome, float):
        return "yes" if outcome <= CP_TOL else f"a wrong number: {outcome:.1e} relative"
    return _cell(outcome)


if __name__ == "__main__":  # python -m tests.test_hf_zoo [TYPE ...]: the table's rows after the runs' logs
    import sys

    import transformers as _transformers

    _transformers.logging.set_verbosity_error()
    types = sys.argv[1:] or causal_lm_types()
    trained = [t for t in types if not skip_rule(t) and not refusal(t)]
    fsdp = fsdp_cells(trained)
    cp = {t: cp_cell(o) for t, o in cp_outcomes(trained).items()}
    rows = [row(model_type, fsdp.get(model_type, "yes"), cp.get(model_type, "yes")) for model_type in types]
    print("--- the table's rows ---", *rows, sep="\n", flush=True)
