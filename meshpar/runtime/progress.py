"""A progress bar on rank 0 under the log lines, for long work: training, ``meshpar convert``,
corpus preparation.

[Note: progress bars in terminals and log files]
What a user sees: on a terminal, a live bar with the ETA under the log lines; in a log file
(stdout and stderr redirected, as under SLURM, read with ``tail -f``), the log lines only.
``metrics.progress = "auto"`` turns the bar on when stderr is a terminal. The bar is tqdm's:
with stdout a file and stderr a terminal (``> train.log``), ``tqdm.write`` lifts the bar, writes
the line to the file and redraws the bar, and it writes lines as they are. rich's Live would
redirect stdout into its console (the log file would stay empty), read ``[...]`` in a line as
markup and wrap lines at the terminal's width.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


class Progress:
    """A live progress bar on ``stream`` (tqdm's) under the log lines ``print`` writes to stdout:
    [Note: progress bars in terminals and log files]. Disabled, it draws nothing and ``print``
    is a plain print. ``unit="B"`` counts bytes (1000-based prefixes)."""

    def __init__(self, total: int, enabled: bool, *, initial: int = 0, unit: str = "step",
                 stream: TextIO | None = None):
        self.done = initial
        self._bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=unit == "B", disable=not enabled,
                         file=stream if stream is not None else sys.stderr, dynamic_ncols=True)

    def update(self, done: int) -> None:
        """``done`` steps (or bytes) of ``total`` are done."""
        self._bar.update(done - self.done)
        self.done = done

    def postfix(self, **values) -> None:
        """Figures shown after the bar (``tokens=1234``), drawn with its next update."""
        self._bar.set_postfix(values, refresh=False)

    def print(self, line: str) -> None:
        print_line(line)

    def close(self) -> None:
        self._bar.close()


def print_line(line: str) -> None:
    """``line`` on stdout, above any live progress bar (lifted and redrawn when both share a terminal)."""
    with tqdm.external_write_mode():
        print(line, flush=True)
