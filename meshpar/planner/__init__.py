"""The memory and time planner behind ``meshpar plan``: will a recipe fit, and how fast will it run?

    plan = planner.plan(recipe, world_size=64, profile=load_profile("h100_sxm", "cuda"))
    print(planner.report(plan))

For each distinct role (a pipeline stage; with ``pp = 1`` every rank is alike) it takes one
representative rank, joins a fake process group of the target world size as that rank, and
runs meshpar's own parallelize path on a model built on the meta device: pipeline split,
tensor parallel plan, activation checkpointing, ``meshpar.fully_shard``. Nothing is allocated
and no GPU is needed. Then it runs the rank's part of a training step on fake tensors and
measures the live bytes of every tensor it creates (``dry_run.py``), and prices the step's
FLOPs and communication against a hardware profile (``cost.py``). ``report.py`` prints it.

Files, in the order a step is planned: ``dry_run.py`` (fake world, build, parameter table)
-> ``simulate.py`` (the step on fake tensors: peak memory, collectives per mesh dim; a stage of
many blocks as two short ones, ``extrapolate.py``)
-> ``cost.py`` (step time, tokens/s, MFU) -> ``report.py`` (tables, the verdict, advice).
"""

from meshpar.planner.cost import LinkDefaults, StepTime, step_time
from meshpar.planner.dry_run import Plan, RankPlan, plan
from meshpar.planner.report import report, verdict

__all__ = ["LinkDefaults", "Plan", "RankPlan", "StepTime", "plan", "report", "step_time", "verdict"]
