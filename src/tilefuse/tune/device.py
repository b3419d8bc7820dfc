"""Which GPU and toolkit a tuned schedule was measured on: part of every cache key."""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str        # e.g. "NVIDIA H100 80GB HBM3"
    capability: str  # e.g. "9.0"
    toolkit: str     # NVRTC version, e.g. "13.0"

    @property
    def arch(self) -> str:
        from ..runtime.nvrtc import normalize_arch

        major, minor = self.capability.split(".")
        return normalize_arch(f"sm_{major}{minor}")

    def __str__(self):
        return f"{self.name} (sm {self.capability}, NVRTC {self.toolkit})"


def toolkit_version() -> str:
    from ..runtime.nvrtc import version

    return ".".join(map(str, version()))


@functools.lru_cache(maxsize=None)
def cuda_device(index: int = 0) -> Device | None:
    """The CUDA device `index` as torch sees it, or None without a GPU."""
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return Device(torch.cuda.get_device_name(index), f"{major}.{minor}", toolkit_version())
