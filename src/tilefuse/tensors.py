"""torch <-> NumPy without losing bf16 (NumPy holds it through ml_dtypes)."""
from __future__ import annotations

import numpy as np
import torch

from . import dtypes


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtypes.to_numpy("bf16"))
    return t.numpy()


def to_torch(a: np.ndarray, device=None) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == dtypes.to_numpy("bf16"):
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t.to(device) if device is not None else t
