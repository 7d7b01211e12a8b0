"""What a conversion reports about itself: its peak memory ([Note: measuring peak memory]) and
sizes in bytes for people (its progress bar is ``meshpar.runtime.progress.Progress``, counting bytes)."""

from __future__ import annotations

import resource
from pathlib import Path

# [Note: measuring peak memory]
# Summary.peak_bytes is the kernel's RSS high-water mark (VmHWM) during the conversion minus
# the RSS at its start: before converting, "5" is written to /proc/self/clear_refs, which
# resets VmHWM to the current RSS (Linux >= 4.0). It counts everything the process touches:
# tensors, allocator slack, pages of mapped files. Where /proc is unavailable it falls back
# to getrusage's ru_maxrss, a lifetime peak (Summary.peak_method says which).


def _rss() -> tuple[int, int] | None:
    """(current RSS, high-water mark) in bytes from /proc/self/status, or None off Linux."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


class _PeakMemory:
    """Peak RSS above the start of a conversion: [Note: measuring peak memory]."""

    def __init__(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.method, self.start = "VmHWM", _rss()[0]
        except (OSError, TypeError):
            self.method, self.start = "ru_maxrss (lifetime)", 0

    def peak(self) -> int:
        if self.method == "VmHWM":
            return max(_rss()[1] - self.start, 0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    raise AssertionError
