"""meshpar's progress bar (``meshpar.runtime.progress.Progress``, training's and conversion's) where users
read it: a terminal, a log file, and a log file next to a terminal
([Note: progress bars in terminals and log files])."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

from meshpar.runtime.progress import Progress

# what meshpar train does: the bar on when stderr is a terminal (metrics.progress = "auto")
SCRIPT = """
import sys
from meshpar.runtime.progress import Progress
bar = Progress(10, enabled=sys.stderr.isatty())
for step in range(1, 11):
    bar.update(step)
    if step % 5 == 0:
        bar.print(f"step {step:>6} | loss 1.2345 [rank0]")
bar.close()
"""
LINES = "step      5 | loss 1.2345 [rank0]\nstep     10 | loss 1.2345 [rank0]\n"


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal 100 columns wide: (the side a program writes to, the side read back)."""
    reader, writer = pty.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return writer, reader


def _run(stdout, stderr) -> None:
    subprocess.run([sys.executable, "-c", SCRIPT], stdout=stdout, stderr=stderr, check=True, timeout=60)


def _read(fd: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the writer side is closed and drained
            break
        if not chunk:
            break
        out += chunk
    return out.decode()


def test_on_a_terminal_a_live_bar_under_the_log_lines():
    writer, reader = _terminal()
    _run(writer, writer)
    os.close(writer)
    screen = _read(reader)
    assert "10/10" in screen and "\r" in screen  # redrawn in place, to the end
    for line in LINES.splitlines():
        assert line in screen
    assert screen.rstrip().endswith("step/s]")  # the bar stays under the last log line


def test_a_log_file_gets_the_log_lines_only(tmp_path):
    path = tmp_path / "train.log"
    with path.open("w") as f:  # stdout and stderr into one file, as under SLURM
        _run(f, subprocess.STDOUT)
    assert path.read_text() == LINES


def test_stdout_to_a_file_keeps_the_lines_and_the_bar_on_the_terminal(tmp_path):
    """``meshpar train recipe.toml > train.log`` on a terminal."""
    writer, reader = _terminal()
    path = tmp_path / "train.log"
    with path.open("w") as f:
        _run(f, writer)
    os.close(writer)
    assert path.read_text() == LINES
    screen = _read(reader)
    assert "10/10" in screen and "loss" not in screen


def test_bytes_and_a_resumed_count():
    stream = io.StringIO()
    bar = Progress(3_000_000, enabled=True, unit="B", stream=stream)
    bar.update(1_500_000)
    bar.update(3_000_000)
    bar.close()
    assert "3.00M/3.00M" in stream.getvalue() and "B/s" in stream.getvalue()
    stream = io.StringIO()
    bar = Progress(100, enabled=True, initial=40, stream=stream)  # resumed at step 40
    bar.update(50)
    bar.close()
    assert "40/100" in stream.getvalue() and "50/100" in stream.getvalue()
    silent = io.StringIO()
    Progress(10, enabled=False, stream=silent).update(5)
    assert silent.getvalue() == ""
