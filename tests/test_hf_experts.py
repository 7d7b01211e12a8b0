"""Family hf's sparse layers in a Hugging Face folder's layout, both ways (issue 58): transformers 5
keeps a sparse layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2F, D]) and
``save_pretrained`` writes them, as published checkpoints hold them, one tensor per expert, renaming
modules on the way for some types; meshpar runs transformers' own conversion mapping on lazy stand-ins
(meshpar/models/hf/experts.py). For each mapping transformers 5.25 has for a sparse causal LM (the
qwen2_moe one: OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; Mixtral's: w1/w3/w2 under block_sparse_moe;
PhiMoE's: its router renamed too; GraniteMoE's: fused tensors under other names; GPT-OSS: none, saved
fused), a random model's save_pretrained folder loads into family hf with from_pretrained's every
parameter and logits, bit for bit (float32 both, the same code on the same weights); so does a folder
of the fused in-memory names; a rank reads only the experts and rows of its box; ``meshpar convert
--to hf`` writes the very tensors save_pretrained wrote, which from_pretrained loads with the trained
model's logits; a folder missing an expert, and a layout the export cannot stream, are refused naming
the tensor."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from meshpar.convert import ConvertError, convert, load_hf_weights
from meshpar.models.hf import HFArgs, HFCausalLM, meta_model
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402 - a dependency of transformers
from safetensors.torch import save_file  # noqa: E402

DIMS = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
# 4 experts, top 2, each F = 24 wide: D = 64, 2F = 48 and F differ, so a wrong orientation or order of
# gate and up changes a shape or the logits
MOE = dict(num_experts_per_tok=2)
CONFIGS = {  # model type -> a tiny config of it
    "olmoe": lambda: transformers.OlmoeConfig(**DIMS, **MOE, intermediate_size=24, num_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**DIMS, **MOE, head_dim=16, intermediate_size=48,
                                                     moe_intermediate_size=24, num_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**DIMS, **MOE, intermediate_size=48, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=40, num_experts=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(  # layer 0 dense, layer 1 sparse with a shared expert
        **DIMS, **MOE, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=1, n_group=1, topk_group=1, rope_scaling=None),
    "mixtral": lambda: transformers.MixtralConfig(**DIMS, **MOE, intermediate_size=24, num_local_experts=4),
    "phimoe": lambda: transformers.PhimoeConfig(**DIMS, **MOE, intermediate_size=24, num_local_experts=4),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**DIMS, **MOE, intermediate_size=24, num_local_experts=4),
    "gpt_oss": lambda: transformers.GptOssConfig(**DIMS, **MOE, head_dim=16, intermediate_size=24,
                                                 num_local_experts=4, sliding_window=32),
}
NO_SDPA = {"gpt_oss"}  # transformers refuses sdpa for it (attention sinks): parameters compared, not logits
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _save(tmp: Path, arch: str) -> Path:
    """save_pretrained of a random float32 model of ``arch``: the layout transformers writes."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    model.save_pretrained(tmp / arch)
    return tmp / arch


def _pretrained(folder: Path, arch: str):
    attention = "eager" if arch in NO_SDPA else "sdpa"
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation=attention)


def _ours(folder: Path) -> HFCausalLM:
    args = HFArgs.from_folder(str(folder))
    model = HFCausalLM(args)
    load_hf_weights(model.state_dict(), folder, "hf", args)
    return model


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - safe_open has no iter
    return out


def _assert_same_model(ours: HFCausalLM, theirs, arch: str) -> None:
    want = theirs.state_dict()
    got = ours.state_dict()
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name]), name
    if arch not in NO_SDPA:
        with torch.no_grad():  # eval: PhiMoE's router jitters its logits in training mode
            assert torch.equal(ours.eval()(TOKENS), theirs.eval()(TOKENS).logits)


@pytest.mark.parametrize("arch", CONFIGS)
def test_saved_and_fused_folders_load_as_from_pretrained(arch, tmp_path):
    folder = _save(tmp_path, arch)
    theirs = _pretrained(folder, arch)
    _assert_same_model(_ours(folder), theirs, arch)
    # a folder of the in-memory names (fused experts), as some tools save it, loads as it is
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused)
    save_file({n: v.clone() for n, v in theirs.state_dict().items()}, fused / "model.safetensors")
    _assert_same_model(_ours(fused), theirs, arch)


def test_a_rank_reads_only_the_experts_and_rows_of_its_box(tmp_path):
    """Reading a box of OLMoE's gate_up_proj (experts 2..3, rows 20..27 across the gate/up seam at
    F = 24) reads experts 2 and 3's gate rows 20..23 and up rows 0..3 and nothing else."""
    from meshpar.models.hf import experts

    folder = _save(tmp_path, "olmoe")
    theirs = _pretrained(folder, "olmoe")
    args = HFArgs.from_folder(str(folder))
    reads = []
    with safe_open(folder / "model.safetensors", "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118

        def read(name, box):
            reads.append((name, [(s.start, s.stop) for s in box]))
            return f.get_slice(name)[box]

        made = experts.FromFolder(meta_model(args.config).hf, shapes, read)
        name = "model.layers.1.mlp.experts.gate_up_proj"
        box = (slice(2, 4), slice(20, 28), slice(8, 40))
        assert torch.equal(made[name].read(box), theirs.state_dict()[name][box])
    layer = "model.layers.1.mlp.experts"
    assert sorted(reads) == [(f"{layer}.{j}.{proj}_proj.weight", rows) for j in (2, 3)
                             for proj, rows in (("gate", [(20, 24), (8, 40)]), ("up", [(0, 4), (8, 40)]))]


def _load_fsdp_job(folders: dict[str, str]) -> dict:
    """load_hf_weights into family hf FSDP-sharded over 2 ranks (each rank holds 2 of the 4 experts of
    every fused tensor, and half the rows of the rest), gathered back, against from_pretrained's."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshpar.fsdp import fully_shard

    errors = {}
    for arch, folder in folders.items():
        args = HFArgs.from_folder(folder)
        with torch.device("meta"):
            model = HFCausalLM(args)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        load_hf_weights(model.state_dict(), folder, "hf", args)
        want = _pretrained(Path(folder), arch).state_dict()
        for name, p in model.state_dict().items():
            if not torch.equal(p.full_tensor(), want[name]):
                errors[arch, name] = str(p.placements)
    return errors


def test_fsdp_ranks_load_their_experts(tmp_path):
    folders = {arch: str(_save(tmp_path, arch)) for arch in ("olmoe", "mixtral")}
    assert run_distributed(_load_fsdp_job, 2, folders, timeout=120) == [{}, {}]


@pytest.mark.parametrize("arch", CONFIGS)
def test_export_writes_what_save_pretrained_writes(arch, tmp_path):
    """A family-hf checkpoint (a torch file with its meshpar.json) -> `meshpar convert --to hf`: every
    tensor save_pretrained wrote, under its name, bit for bit, and no other; from_pretrained loads it."""
    folder = _save(tmp_path, arch)
    ours = _ours(folder)
    args = HFArgs.from_folder(str(folder))
    torch.save({"model." + k: v for k, v in ours.state_dict().items()}, tmp_path / "w.pt")  # checkpoint keys
    (tmp_path / "w.meshpar.json").write_text(json.dumps({"format": 1, "step": 0, "family": "hf", "size": "custom",
                                                         "model_args": dataclasses.asdict(args), "layout": {}}))
    convert(tmp_path / "w.pt", tmp_path / "out", to="hf", progress=False, shard_size=100_000)
    written, want = _tensors(tmp_path / "out"), _tensors(folder)
    assert sorted(written) == sorted(want)
    for name, value in want.items():
        assert torch.equal(written[name], value), name
    _assert_same_model(ours, _pretrained(tmp_path / "out", arch), arch)


def test_trained_checkpoint_converts_to_a_folder_transformers_loads(tmp_path, data_cache):
    """One training step of family hf from an OLMoE save_pretrained folder (float32: transformers' expert
    kernel, torch._grouped_mm, takes no float64), its checkpoint -> `meshpar convert --to hf`:
    save_pretrained's names, and from_pretrained gives the trained model's logits exactly (same code,
    same weights)."""
    from meshpar.config import recipe as recipelib
    from meshpar.train import train
    from tests.helpers import ROOT, SMALL

    folder = _save(tmp_path, "olmoe")
    recipe = recipelib.load(ROOT / "recipes" / "llama_debug.toml",
                            [*SMALL, "--train.steps=1", "--train.seq_len=32", "--checkpoint.every=1",
                             "--model.family=hf", f"--model.hf_path={folder}", f"--checkpoint.hf_weights={folder}",
                             f"--train.output_dir={tmp_path / 'run'}"])
    run = train(recipe, return_state=True)
    convert(tmp_path / "run" / "checkpoints" / "step_1", tmp_path / "hf", to="hf", progress=False)
    assert sorted(_tensors(tmp_path / "hf")) == sorted(_tensors(folder))
    loaded = _pretrained(tmp_path / "hf", "olmoe")
    trained = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    trained.load_state_dict(run.state_dict)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    # trained from the folder's weights: one AdamW step moves each by about the learning rate (<= 3e-3)
    moved = (trained.state_dict()[name] - _pretrained(folder, "olmoe").state_dict()[name]).abs().max()
    assert 0 < moved < 1e-2
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained.eval()(TOKENS).logits)


def test_refusals_name_the_tensor(tmp_path):
    folder = _save(tmp_path, "mixtral")
    state = _tensors(folder)
    layer = "model.layers.0.block_sparse_moe.experts"
    for drop, match in [
        ([f"{layer}.3.w3.weight"],  # expert 3's up projection: gate and up no longer concatenate
         r"tensor 'model.layers.0.mlp.experts.gate_up_proj' \(made from .*w1.weight.*\) cannot be made as "
         r"transformers' conversion mapping for mixtral makes it \(torch.cat of tensors of shapes \[4, 24, 64\], "
         r"\[3, 24, 64\]\)"),
        ([f"{layer}.3.w1.weight", f"{layer}.3.w3.weight"],  # a whole expert: 3 of the 4
         r"tensor 'model.layers.0.mlp.experts.gate_up_proj' \(made from .*\) has shape \[3, 48, 64\], but the "
         r"model .* needs \[4, 48, 64\]"),
        ([f"{layer}.{j}.w2.weight" for j in range(4)],  # every down projection of layer 0
         r"no tensor 'model.layers.0.mlp.experts.down_proj' in its safetensors, .* makes it from none of the "
         r"folder's tensors; it holds model.layers.0.block_sparse_moe.experts.0.w1.weight, .* there"),
    ]:
        (tmp_path / "cut").mkdir(exist_ok=True)
        shutil.copy(folder / "config.json", tmp_path / "cut")
        save_file({n: v for n, v in state.items() if n not in drop}, tmp_path / "cut" / "model.safetensors")
        with pytest.raises(ConvertError, match=match):
            _ours(tmp_path / "cut")
    # SarvamMoE's mapping saves q, k and v as one query_key_value: three model tensors into one file tensor
    from meshpar.models.hf import convert as hf_convert

    config = transformers.SarvamMoEConfig(**DIMS, **MOE, intermediate_size=48, moe_intermediate_size=24,
                                          num_experts=4, head_dim=16).to_dict()
    assert hf_convert.hf_export_error(HFArgs.from_config(config)) == (
        "sarvam_moe: transformers saves 'model.layers.0.attention.query_key_value.weight' by a conversion of "
        "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.q_proj.weight, "
        "model.layers.0.self_attn.v_proj.weight that is not one piece of one model tensor; meshpar's "
        "one-tensor-at-a-time export does not write that")
