"""Pipeline parallelism: split a model built on meta into stages, run them under a schedule.

    stages = split(model, pp_rank, pp, virtual=v, style=SCHEDULES[name].style)  # [(index, module)]
    ... tensor parallel, FSDP per block then per stage root, to_empty, init_weights, per stage ...
    pipe = build_schedule(stages, pp * v, mesh["pp"], device, name, n_microbatches, cross_entropy)
    loss = pipe.step(inputs, targets)  # on the last stage's rank; None elsewhere

``split.py`` decides which blocks and ends each stage holds; ``schedule.py`` wraps
``torch.distributed.pipelining`` so that meshpar's FSDP engine reduce-scatters once per
optimizer step inside a stage. Gradient clipping across stages: ``meshpar.clip_grad_norm_``
with ``extra_groups=[pp group]``.
"""

from meshpar.parallel.pipeline.schedule import SCHEDULES, Pipeline, Stage, build_schedule, check_microbatches
from meshpar.parallel.pipeline.split import split, split_model, stage_ids, stage_layers

__all__ = ["SCHEDULES", "Pipeline", "Stage", "build_schedule", "check_microbatches", "split", "split_model",
           "stage_ids", "stage_layers"]
