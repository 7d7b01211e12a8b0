"""Every recipe key: its section, default, documentation and allowed values.

One frozen dataclass per TOML section; ``option`` declares a field with what
``meshpar recipe --keys`` prints and what meshpar/config/recipe.py checks. Reading, overriding,
validating across keys and printing recipes is meshpar/config/recipe.py's (which re-exports these
names: import them from ``meshpar.config.recipe``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def option(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, choices: Sequence[Any] | None = None,
           valid: tuple[Callable[[Any], bool], str] | None = None, key: str | None = None) -> Any:
    """Declare a recipe field: its default, its documentation and the values it allows.

    ``choices`` applies to each item of a list field. ``valid`` is ``(predicate, "what is
    allowed")`` for rules the bounds cannot say. ``key`` is the TOML spelling where it cannot
    be a Python name (``async``).
    """
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "valid": valid, "key": key}
    return field(default=default, metadata=meta)


MOE_KEYS = ("aux_loss_coef", "capacity_factor", "aux_free_bias", "bias_update_rate")  # [model] keys for experts


@dataclass(frozen=True)
class ModelConfig:
    family: str = option("llama", "Model family: llama, qwen2, qwen3, gpt2, the mixture-of-experts qwen3_moe, "
                                         "mixtral, deepseek_v3 or gpt_oss (see meshpar/models/), or hf: any Hugging "
                                         "Face causal LM, built by transformers from model.hf_path's config.json (pip "
                                         "install 'meshpar[hf]').")
    size: str = option("debug", "Named size of the family, e.g. debug, 1b, 8b, 70b, 405b for llama (unused by hf).")
    hf_path: str = option("", "With family = hf: the Hugging Face model folder whose config.json is the architecture; "
                              "empty means checkpoint.hf_weights.")
    n_layers: int = option(0, "Override the size's number of transformer blocks; 0 keeps the size's own.", ge=0)
    vocab_size: int = option(0, "Override the size's vocabulary; 0 keeps the size's own. Must hold every "
                                "token id the data produces.", ge=0)
    attention: str = option("causal", "causal, or document: packed sequences attend only within each document "
                                      "(documents end with the tokenizer's EOS) and positions restart at each.",
                            choices=("causal", "document"))
    float8: str = option("none", "Float8 matmuls through torchao (pip install 'meshpar[float8]'): tensorwise (one "
                                 "scale per tensor; under FSDP the weights are all-gathered in float8), rowwise, "
                                 "or rowwise_with_gw_hp (rowwise, weight gradient in high precision). The output "
                                 "projection and layers whose dims are not multiples of 16 stay in high precision "
                                 "(named at start). Needs a float8 GPU (H100 and later) or float8_emulate; slow "
                                 "without parallel.compile.",
                         choices=("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"))
    float8_emulate: bool = option(False, "With model.float8: emulate the float8 casts and matmuls in high "
                                         "precision (the same numbers, on any device: CPU tests), as torchao's "
                                         "emulate=True.")
    # mixture-of-experts families only (qwen3_moe, mixtral, deepseek_v3): they set MoEArgs' fields of the same names
    # (router_aux_loss_coef for aux_loss_coef); meshpar.models refuses other values on a dense family
    aux_loss_coef: float = option(-1.0, "Mixture of experts: weight of the load-balancing loss added to the "
                                        "cross-entropy (logged apart as aux_loss); 0 turns it off; -1 keeps the "
                                        "size's own (qwen3_moe 0.001, mixtral 0.02, debug sizes 0.01 / 0.02).",
                                  valid=(lambda v: v == -1 or v >= 0, "-1 (the size's own) or >= 0 (0 turns it off)"))
    capacity_factor: float = option(0.0, "Mixture of experts: 0 drops no token; C >= 1 lets an expert take at most "
                                         "ceil(C x tokens x top_k / n_experts) token slots per forward (C times an "
                                         "even share; the latest tokens over it are dropped, counted as "
                                         "moe_dropped in metrics.jsonl). Below 1 even a perfectly balanced router "
                                         "would drop slots, so 0 < C < 1 is refused.",
                                    valid=(lambda v: v == 0 or v >= 1, "0 (no token dropped) or >= 1 (1.25 is usual)"))
    aux_free_bias: bool = option(False, "Mixture of experts: auxiliary-loss-free balancing (DeepSeek-V3): a "
                                        "per-expert routing bias moved after each optimizer step against the "
                                        "step's expert loads summed over data-parallel ranks.")
    bias_update_rate: float = option(1e-3, "Mixture of experts, aux_free_bias: the bias step per optimizer step "
                                           "(DeepSeek-V3's gamma).", gt=0)


# The parallel dims, outermost first: the device mesh's order (meshpar/distributed/mesh.py).
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def local_world_size(cfg: ParallelConfig) -> int:
    """Ranks a recipe asks for when nothing else says: the product, with ``dp_shard = -1`` as 1."""
    return math.prod(max(getattr(cfg, d), 1) for d in DIMS)


def replica_jobs(recipe: Recipe) -> int:
    """Jobs a run is made of: one per replica group under ``fault.replicas = "torchft"``
    (``parallel.dp_replicate`` of them, each with ``world / dp_replicate`` ranks), else one."""
    return recipe.parallel.dp_replicate if recipe.fault.replicas == "torchft" else 1


@dataclass(frozen=True)
class ParallelConfig:
    pp: int = option(1, "Pipeline-parallel degree (outermost mesh dim).", ge=1)
    dp_replicate: int = option(1, "Data-parallel replicas: parameters replicated, gradients all-reduced.", ge=1)
    dp_shard: int = option(-1, "Data-parallel sharding degree (FSDP); -1 takes the ranks left over.",
                           valid=(lambda v: v == -1 or v >= 1, "-1 (the ranks left over) or >= 1"))
    cp: int = option(1, "Context-parallel degree (sequence split across ranks).", ge=1)
    cp_attention: str = option("allgather", "Context parallel attention: allgather (K and V gathered over cp, "
                                            "one attention over all T keys), ring (K/V chunks passed rank to "
                                            "rank, each hop beside a chunk's attention; two chunks held at a time; "
                                            "meshpar/parallel/context_parallel/ring.py) or ulysses (an all-to-all "
                                            "splits the heads over cp for one whole-sequence attention per rank; "
                                            "the query heads per tp rank must divide by cp; "
                                            "meshpar/parallel/context_parallel/ulysses.py).",
                                            choices=("allgather", "ring", "ulysses"))
    cp_flex: bool = option(False, "With cp > 1 on CUDA: the gather's and the ring's attention on compiled "
                                  "flex_attention (block masks, no [n, keys] mask; the ring one flex call per "
                                  "step: meshpar/parallel/context_parallel/flex.py, ring_flex.py), where each "
                                  "rank's tokens are whole tiles of 128. Off by default until a GPU run has "
                                  "checked it (scripts/gpu_checks.sh cp); CPU runs keep their kernels.")
    tp: int = option(1, "Tensor-parallel degree (innermost mesh dim, fastest links).", ge=1)
    ep: int = option(1, "Expert-parallel degree for mixture-of-experts models: experts split over ep ranks "
                        "borrowed from dp_shard (which it must divide); FSDP shards the experts over the "
                        "dp_shard / ep ranks left over.", ge=1)
    reshard_after_forward: bool = option(True, "FSDP: free unsharded parameters after forward and all-gather "
                                               "again in backward (ZeRO-3); false keeps them until after "
                                               "backward (ZeRO-2: less communication, more memory). Under "
                                               "pipeline parallelism (pp > 1) units always keep them: one "
                                               "all-gather per step, not one per microbatch.")
    grad_reduce: str = option("step", "FSDP with several microbatches per step: step reduce-scatters each "
                                      "unit's gradients once, after the last microbatch (each unit holds its "
                                      "unsharded gradient across the microbatches); microbatch reduce-scatters "
                                      "after every microbatch's backward (gradients stay sharded: less memory, "
                                      "data-parallel gradient traffic x the microbatches).",
                              choices=("step", "microbatch"))
    param_dtype: str = option("float32", "FSDP compute and all-gather dtype; sharded parameters and optimizer "
                                         "state stay float32.", choices=("float32", "bfloat16", "float16"))
    reduce_dtype: str = option("float32", "FSDP gradient reduce-scatter dtype.",
                               choices=("float32", "bfloat16", "float16"))
    shard_threshold: int = option(0, "FSDP: parameters with fewer elements stay replicated (one all-reduce "
                                     "for all of them instead of tiny shards).", ge=0)
    loss_parallel: bool = option(True, "Tensor parallel: keep the logits sharded over the vocabulary and "
                                       "compute the loss on the shards (no all-gather of [B, T, V] logits).")
    pp_schedule: str = option("1f1b", "Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble "
                                      "(interleaved, backward split into input and weight passes) or zbv "
                                      "(zero bubble, V placement, 2 stages per rank). Microbatches per step are "
                                      "train.global_batch / (dp x train.micro_batch).",
                              choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"))
    pp_virtual_stages: int = option(1, "Pipeline stages per rank: 1 for gpipe / 1f1b, >= 2 for the "
                                       "interleaved schedules, 2 for zbv.", ge=1)
    pp_boundaries: tuple[int, ...] = option((), "Pipeline split: the first layer of each stage after the first "
                                                "(pp x pp_virtual_stages - 1 increasing indices); empty splits "
                                                "the layers evenly.", valid=(lambda b: all(x >= 1 for x in b),
                                                                             "layer indices >= 1"))
    activation_checkpoint: str = option("none", "Recompute activations in backward: none, full (keep only each "
                                                "block's input) or selective (keep matmul and attention outputs, "
                                                "recompute the elementwise work).",
                                        choices=("none", "full", "selective"))
    ac_every: int = option(1, "Checkpoint every this many blocks (blocks whose index is a multiple of it).", ge=1)
    compile: bool = option(False, "torch.compile each transformer block (inductor; the first step compiles).")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(100, "Optimizer steps to run.", ge=1)
    output_dir: str = option("", "Where metrics.jsonl, recipe.toml and traces go; empty means runs/<recipe name>.")
    log_every: int = option(10, "Log a line and a metrics.jsonl record every this many steps.", ge=1)
    seed: int = option(0, "Seed for initialization and data order; a run is deterministic given it.", ge=0)
    global_batch: int = option(16, "Sequences per optimizer step across all data-parallel ranks. Global, so "
                                    "tokens per step and the losses do not depend on the layout.", ge=1)
    micro_batch: int = option(4, "Sequences per forward/backward on one data-parallel rank; gradient "
                                  "accumulation (or, with pp > 1, the pipeline's microbatches) covers the "
                                  "rest of global_batch.", ge=1)
    seq_len: int = option(256, "Tokens per sequence.", ge=2)
    eval_every: int = option(50, "Validation loss every this many steps (and after the last); 0 turns it off.", ge=0)
    eval_batches: int = option(4, "Global batches of held-out data per validation.", ge=1)
    sample_every: int = option(0, "Print (and write to <output_dir>/samples.jsonl) the model's greedy continuation "
                                  "of train.sample_prompt every this many steps (and after the last); 0 turns it "
                                  "off. Every rank runs it (pp = 1, cp = 1, without parallel.compile).", ge=0)
    sample_prompt: str = option("\n", "With train.sample_every: the text the sample continues.")
    sample_tokens: int = option(48, "With train.sample_every: tokens generated per sample.", ge=1)
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu or cuda.", choices=("auto", "cpu", "cuda"))
    on_nonfinite: str = option("stop", "A non-finite loss or gradient norm: stop (an error naming the step and the "
                               "first parameter with a non-finite gradient; no checkpoint of the bad state) or "
                               "skip (no optimizer step; counted in metrics.jsonl as skipped_steps).",
                               choices=("stop", "skip"))
    max_skips: int = option(3, "on_nonfinite = skip: stop after this many consecutive skipped steps.", ge=1)
    loss_chunks: int = option(1, "Compute the output projection and the loss this many chunks of tokens at a time, "
                                 "so no [tokens, vocabulary] logits tensor lives across the loss (each chunk's "
                                 "logits are recomputed in backward: one more forward of the output layer). 1: the "
                                 "whole microbatch at once; 0: chunks sized from the vocabulary and the tokens.",
                              ge=0)


@dataclass(frozen=True)
class OptimConfig:
    name: str = option("adamw", "Optimizer.", choices=("adamw",))
    lr: float = option(1e-3, "Peak learning rate.", gt=0)
    min_lr_ratio: float = option(0.1, "Final learning rate as a fraction of lr.", ge=0, le=1)
    warmup_steps: int = option(10, "Linear warmup steps from 0 to lr.", ge=0)
    schedule: str = option("cosine", "Decay after warmup.", choices=("cosine", "linear", "constant"))
    betas: tuple[float, ...] = option((0.9, 0.95), "AdamW (beta1, beta2).",
                                      valid=(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                                             "two numbers in [0, 1)"))
    eps: float = option(1e-8, "AdamW epsilon.", gt=0)
    weight_decay: float = option(0.1, "Decoupled weight decay on matrices (not on norms, biases).", ge=0)
    grad_clip: float = option(1.0, "Clip the global gradient norm to this; 0 turns clipping off.", ge=0)


@dataclass(frozen=True)
class DataSource:
    path: str = option("", "Files of this source: as data.path (a file, a folder, a glob, or a folder made by "
                           "`meshpar data prepare`).")
    weight: float = option(1.0, "Share of the training samples drawn from this source (weights are normalized).",
                           gt=0)


@dataclass(frozen=True)
class DataConfig:
    path: str = option("", "Training data: empty for the built-in Shakespeare corpus; a file, a folder (recursive) "
                           "or a glob of .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet or .arrow files; a folder "
                           "made by `meshpar data prepare`; or a file of token ids (see format).")
    format: str = option("auto", "auto: by each file's extension (documents, .npy token arrays, prepared folders); "
                                 "text (the same, kept for older recipes); uint16 / uint32 for a pre-tokenized file "
                                 "of raw little-endian token ids (memory-mapped); chat: supervised fine-tuning on "
                                 "conversations (.jsonl / .parquet / .arrow rows of messages, or prompt and "
                                 "completion; empty path: dialogues of the built-in plays), the loss on the "
                                 "assistant's tokens only, whole conversations packed per sequence (needs "
                                 "model.attention = \"document\").",
                         choices=("auto", "text", "uint16", "uint32", "chat"))
    chat_template: str = option("", "With format = chat: a Jinja chat template file; empty means the tokenizer "
                                    "folder's own (tokenizer_config.json), or meshpar's plain role-marker template "
                                    "for the bpe tokenizer.")
    text_field: str = option("text", "The document's field in .jsonl objects and its column in Parquet / Arrow.")
    tokenizer: str = option("auto", "For documents: bpe (byte-level BPE trained on the data and cached), byte, or a "
                                    "Hugging Face tokenizer (a tokenizer.json, or a folder holding one). auto: the "
                                    "tokenizer of checkpoint.hf_weights' folder when set, else bpe.")
    vocab_size: int = option(2048, "Vocabulary of the trained BPE tokenizer.", ge=260, le=65536)
    val_fraction: float = option(0.05, "Share of the tokens (the tail) held out for validation; unused when "
                                       "val_path is set.", ge=0, lt=0.5)
    val_path: str = option("", "Validation data from its own source (as path), instead of the held-out tail.")
    sources: tuple[DataSource, ...] = option((), "A mixture instead of path: [[data.sources]] tables of path and "
                                                  "weight, each sample drawn from one source in proportion, in an "
                                                  "order fixed by train.seed and independent of the layout.")
    cache_dir: str = option("", "Tokenizer and token cache; empty means $MESHPAR_CACHE or ~/.cache/meshpar.")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = option("", "Checkpoint folder (holds step_<N>/ folders); empty means <train.output_dir>/checkpoints. "
                          "A run whose dir holds a complete checkpoint resumes from the newest.")
    every: int = option(0, "Save every this many steps; 0 turns saving off.", ge=0)
    keep: int = option(3, "Keep the newest this many checkpoints.", ge=1)
    async_save: bool | str = option(
        False, "Save in the background while training continues: false (the step waits for the whole save), "
               "\"thread\" (copy to host memory, then write on a thread of the training process) or \"process\" "
               "(copy to shared memory, pinned on a GPU, then write in one background process per rank, which "
               "competes less with training for the interpreter). true means \"thread\". Either way the step "
               "waits only for the copy, and for the previous save before the next; a stop signal saves "
               "synchronously.",
        choices=(False, True, "thread", "process"), key="async")
    load_from: str = option("", "Start from this checkpoint (a step_<N> folder, or a checkpoint dir: its newest) "
                                "instead of the newest in dir.")
    hf_weights: str = option("", "Start from the weights in this Hugging Face folder (config.json + safetensors) "
                                 "instead of random initialization; a checkpoint to resume from takes precedence.")
    exclude: tuple[str, ...] = option((), "State to leave out when loading: optimizer, lr_schedule, data, rng.",
                                      choices=("optimizer", "lr_schedule", "data", "rng"))

    @property
    def async_mode(self) -> str | None:
        """``async`` as None (synchronous), "thread" or "process" (``true`` is "thread")."""
        return {False: None, True: "thread"}.get(self.async_save, self.async_save)


@dataclass(frozen=True)
class ProfileConfig:
    enable: bool = option(False, "Trace steps with torch.profiler.")
    wait: int = option(1, "Profiler schedule: steps skipped before warmup.", ge=0)
    warmup: int = option(1, "Profiler schedule: steps traced but discarded.", ge=0)
    active: int = option(2, "Profiler schedule: steps recorded.", ge=1)
    repeat: int = option(1, "Profiler schedule: cycles of wait/warmup/active.", ge=1)
    ranks: str = option("all", "Ranks to trace: all, rank0, stages (the first rank of each pipeline stage) or a "
                               "list such as \"0,3\".")
    record_shapes: bool = option(False, "Record operator input shapes.")
    profile_memory: bool = option(False, "Record tensor allocations and frees.")
    with_stack: bool = option(False, "Record Python stacks (large traces).")
    max_trace_mb: float = option(200.0, "Cap on each trace file (uncompressed JSON): the shortest events are "
                                        "dropped first.", gt=0)


@dataclass(frozen=True)
class MetricsConfig:
    hardware: str = option("auto", "Hardware profile for MFU: a name in profiles/ (cpu, a100_80gb, h100_sxm, "
                                    "h200) or a path to one; auto picks by the device.")
    progress: str = option("auto", "Progress bar on rank 0: auto (when stderr is a terminal), on or off.",
                           choices=("auto", "on", "off"))
    tensorboard: bool = option(False, "Also write TensorBoard event files to <train.output_dir>/tensorboard "
                                      "(needs the tensorboard package).")
    wandb: bool = option(False, "Also log what metrics.jsonl logs to Weights & Biases, from rank 0, with the "
                                "resolved recipe as the run's config (pip install 'meshpar[wandb]'); a run resumed "
                                "from a checkpoint continues the same W&B run.")
    wandb_project: str = option("meshpar", "With metrics.wandb: the W&B project.")
    wandb_name: str = option("", "With metrics.wandb: the run's display name; empty means train.output_dir's name.")
    wandb_entity: str = option("", "With metrics.wandb: the W&B entity (team or user); empty means W&B's default.")
    wandb_mode: str = option("online", "With metrics.wandb: online, or offline (written under "
                                       "<train.output_dir>/wandb, uploaded later with `wandb sync`; needs no network).",
                             choices=("online", "offline"))


PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


@dataclass(frozen=True)
class FaultConfig:
    signals: tuple[str, ...] = option(("SIGTERM", "SIGUSR1"), "Signals that stop the run cleanly: every rank "
                                      "finishes its step, the ranks agree on the last step, a checkpoint is saved "
                                      "and the run exits with code 75 (SLURM sends SIGUSR1 before the time limit "
                                      "with --signal=USR1@120). [] keeps Python's defaults.",
                                      choices=PREEMPTION_SIGNALS)
    agree_every: int = option(1, "Steps between the ranks' agreement on a stop signal (one all-reduce of one "
                              "number over every rank); a signal waits at most this many steps.", ge=1)
    timeout: float = option(0.0, "Seconds a collective may wait for its peers before the run fails naming it "
                            "(and the ranks that did not arrive); 0 means 300 on gloo, 600 on NCCL.", ge=0)
    flight_recorder: int = option(32, "Collectives each rank remembers (op, mesh dim, bytes, step), printed when "
                                  "one fails or times out.", ge=1)
    replicas: str = option("none", "Who manages parallel.dp_replicate: none (one job, every replica restarts with the "
                                   "others) or torchft (each replica group is its own job, one `meshpar train` per "
                                   "group; a group that dies heals from a live one while the others keep training: "
                                   "docs/cluster.md; pip install 'meshpar[ft]').", choices=("none", "torchft"))
    replica_id: int = option(0, "With replicas = torchft: this job's replica group, 0 to parallel.dp_replicate - 1.",
                             ge=0)
    lighthouse: str = option("", "With replicas = torchft: the lighthouse's address (http://host:port, from `meshpar "
                                 "lighthouse`); empty means the TORCHFT_LIGHTHOUSE environment variable.")
    min_replicas: int = option(1, "With replicas = torchft: replica groups a step needs to commit; with fewer alive "
                                  "the step waits for one to join.", ge=1)
    replica_wait: float = option(300.0, "With replicas = torchft: seconds a group, at its start, waits for every "
                                        "replica group to join its first quorum before it trains with those there "
                                        "(groups then start together instead of one healing from another).", ge=0)
    quorum_timeout: float = option(0.0, "With replicas = torchft: seconds a group waits for a step's quorum (the "
                                        "lighthouse's answer) before it saves its last committed step and exits 75; "
                                        "more than 2 x fault.timeout (a rank whose peer died sits in its all-reduce "
                                        "that long while the others vote). 0 means 2 x fault.timeout + 60.", ge=0)


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
