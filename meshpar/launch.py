"""Start N local ranks through torch's elastic launcher, so ``meshpar train`` needs no torchrun.

Each rank runs ``python -m meshpar.train RECIPE [overrides]`` with torchrun's environment;
rendezvous is a c10d store on a free localhost port, as ``torchrun --standalone`` does.
A failed rank fails the launch at once (no restarts): its traceback is on stderr and the
launcher's summary names the rank and exit code.
"""

from __future__ import annotations

import logging
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def launch_local(nproc: int, train_argv: list[str]) -> int:
    """Run the training entry point on ``nproc`` local ranks; returns the exit code."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"meshpar-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
        start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "meshpar.train", *train_argv)
    except ChildFailedError as e:
        failures = e.failures
        codes = sorted({f.exitcode for f in failures.values()})
        ranks = ", ".join(str(r) for r in sorted(failures))
        print(f"meshpar: rank(s) {ranks} of {nproc} failed (exit code {', '.join(map(str, codes))}); "
              f"see their output above", file=sys.stderr)
        return 2 if codes == [2] else 1
    return 0
