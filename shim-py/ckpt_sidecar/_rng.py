"""The RNG states a save with rng=True carries, and their restore."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ._tree import torch_module


def capture_rng() -> dict[str, Any]:
    """RNG states: Python random, numpy's global RandomState, torch CPU and each CUDA device."""
    st = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = torch_module()
    if torch is not None:
        st["torch"] = torch.get_rng_state()
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                st["cuda"] = torch.cuda.get_rng_state_all()
        except Exception:
            pass
    return st


def restore_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "torch" in st:
        import torch

        torch.set_rng_state(st["torch"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])
