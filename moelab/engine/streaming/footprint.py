"""How much a model needs: weight bytes of the whole model, of each decoder layer and of the decoder's
own weights, in the dtype a job runs it in; the least ``max_memory`` a streamed step can run in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..models import ModelAdapter
from ..sizes import format_size


class MemoryBudgetError(ValueError):
    """``max_memory`` cannot hold what one streamed step needs; raised before any work starts."""



@dataclass
class Footprint:
    """Weight bytes of a model in the dtype a job runs it in."""

    total_bytes: int
    layer_bytes: list[int]  # per decoder layer
    resident_bytes: int  # the decoder's own weights (embeddings, final norm): loaded for step 2

    @property
    def floor_bytes(self) -> int:
        """The least ``max_memory`` a streamed pass can run in: one layer, or the embeddings."""
        return max(max(self.layer_bytes), self.resident_bytes)

    def floor_reason(self) -> str:
        i = int(np.argmax(self.layer_bytes))
        if self.layer_bytes[i] >= self.resident_bytes:
            return f"decoder layer {i} alone holds {format_size(self.layer_bytes[i])} of weights"
        return f"the embeddings and other non-layer weights hold {format_size(self.resident_bytes)}"

    def check(self, max_memory: int) -> None:
        if max_memory < self.floor_bytes:
            raise MemoryBudgetError(
                f"memory budget (--max-memory / max_memory) {format_size(max_memory)} is too small: {self.floor_reason()}; "
                f"give at least {format_size(self.floor_bytes)} ({self.floor_bytes} bytes)"
            )

    def to_dict(self) -> dict[str, int]:
        return {"total_bytes": self.total_bytes, "max_layer_bytes": max(self.layer_bytes),
                "resident_bytes": self.resident_bytes, "min_max_memory": self.floor_bytes}


def _param_bytes(params: Any, dtype: torch.dtype | None) -> int:
    # On a meta skeleton the parameters carry the dtype they will be loaded in, but
    # ``dtype`` overrides it where the caller knows better.
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        size = (dtype or p.dtype).itemsize if p.is_floating_point() else p.dtype.itemsize
        total += p.numel() * size
    return total


def footprint(adapter: ModelAdapter, dtype: torch.dtype | None = None) -> Footprint:
    """Bytes of the whole model, of each decoder layer and of the decoder's non-layer weights."""
    layer_ids = {id(p) for lay in adapter.layers for p in lay.block.parameters()}
    decoder = adapter.decoder()
    resident = [p for p in decoder.parameters() if id(p) not in layer_ids]
    return Footprint(
        total_bytes=_param_bytes(adapter.model.parameters(), dtype),
        layer_bytes=[_param_bytes(lay.block.parameters(), dtype) for lay in adapter.layers],
        resident_bytes=_param_bytes(resident, dtype),
    )
