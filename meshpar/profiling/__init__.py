"""Profiling: where a step's time and memory go.

- ``capture.py``: ``[profile]`` in a recipe, torch.profiler traces per rank with mesh
  coordinates and the engine's communication accounting, memory records.
- ``labels.py``: ``meshpar::`` ranges around the communication PyTorch issues for meshpar
  (tensor-parallel hooks, pipeline send / receive), so a trace names every collective's dim.
- ``memory.py``: live tensor bytes by category over time (``AllocationTracker``), on any device.
- ``report/``: ``meshpar profile summarize | merge``: per-rank step breakdown, one timeline, the
  size cap; no torch.

Nothing is imported here: the training path imports ``labels`` alone, and the tracker and the
report load only when a run or a command asks for them.
"""
