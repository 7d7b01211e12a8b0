"""Hardware profiles (``profiles/*.toml``): peak FLOP/s per dtype, memory and link bandwidths.

Used for MFU in the training log and, later, by the planner. A profile is chosen by name
(``cpu``, ``a100_80gb``, ``h100_sxm``, ``h200``), by path, or with ``auto`` from the device
the run is on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from meshpar.config.recipe import RecipeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str  # "cpu" or "cuda"
    devices_per_node: int
    memory_gb: float
    memory_bandwidth_gbps: float
    peak_tflops: dict[str, float]  # dense, per device, by torch dtype name ("bfloat16")
    intra_node_gbps: float  # per device per direction
    inter_node_gbps: float
    # a collective's fixed cost, whatever its size ([links] latency_us; 0 where a profile has none)
    latency_s: float = 0.0

    def peak_flops(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        name = "float8" if name.startswith("float8") else name  # one float8 peak (e4m3 and e5m2 alike)
        if name not in self.peak_tflops:
            raise RecipeError(f"hardware profile '{self.name}' has no peak for {name}; "
                              f"add it under [peak_tflops] (has: {', '.join(self.peak_tflops)})")
        return self.peak_tflops[name] * 1e12


def _auto_name(device_type: str) -> str:
    if device_type != "cuda":
        return "cpu"
    gpu = torch.cuda.get_device_name().lower()
    for key, name in (("h200", "h200"), ("h100", "h100_sxm"), ("a100", "a100_80gb")):
        if key in gpu:
            return name
    return "h100_sxm"  # an unknown GPU is measured against a current flagship, never flattered


def load_profile(spec: str, device_type: str) -> HardwareProfile:
    """``spec`` is ``auto``, a profile name in profiles/, or a path to a profile TOML."""
    name = _auto_name(device_type) if spec == "auto" else spec
    path = Path(name) if name.endswith(".toml") else PROFILES_DIR / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))
        raise RecipeError(f"metrics.hardware = '{spec}': no profile at {path}; use auto, one of {known}, "
                          f"or a path to a .toml profile")
    raw = tomllib.loads(path.read_text())
    try:
        return HardwareProfile(
            name=raw["name"], device=raw["device"], devices_per_node=raw["devices_per_node"],
            memory_gb=raw["memory_gb"], memory_bandwidth_gbps=raw["memory_bandwidth_gbps"],
            peak_tflops=dict(raw["peak_tflops"]), intra_node_gbps=raw["links"]["intra_node_gbps"],
            inter_node_gbps=raw["links"]["inter_node_gbps"], latency_s=raw["links"].get("latency_us", 0.0) / 1e6)
    except KeyError as e:
        raise RecipeError(f"{path}: hardware profile lacks {e}; see profiles/h100_sxm.toml for the format") from None
