"""Runtime modules made at conversion time for weights that are copied in right after."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def empty_module(cls: type[M], spec: dict[str, Any], like: torch.Tensor) -> M:
    """``cls(spec)`` with uninitialised storage on ``like``'s device and dtype: built on the ``meta`` device, so no
    random initialisation is paid for weights the caller overwrites (and the caller must write every one)."""
    with torch.device("meta"):
        mod = cls(spec)
    mod.to_empty(device=like.device)
    return mod.to(like.dtype)


@torch.no_grad()
def dense_glu_module(cls: type[M], spec: dict[str, Any], gate_w: torch.Tensor, up_w: torch.Tensor,
                     down_w: torch.Tensor) -> M:
    """A whole-GLU runtime module (``gate_proj``/``up_proj``/``down_proj``: AbsTopK-GLU, TEAL) holding the dense GLU's
    weights as they are."""
    mod = empty_module(cls, spec, gate_w)
    mod.gate_proj.weight.copy_(gate_w)
    mod.up_proj.weight.copy_(up_w)
    mod.down_proj.weight.copy_(down_w)
    return mod
