"""Total and per-token active parameter counts of a (converted) model.

A module replacing an MLP reports how many of its own parameters one token uses through
``active_param_count()``; everything else (attention, norms, embeddings, dense MLPs) is used by
every token. Tied tensors are counted once. The LM head and the input embedding are both
counted in ``total``; ``active`` counts the embedding too (a lookup), as model cards usually do.
"""

from __future__ import annotations

from torch import nn


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``{"total": …, "active": …}`` for ``model``: ``active`` replaces each module that defines
    ``active_param_count()`` by that count (outermost such module wins)."""
    seen: set[int] = set()

    def unique(params) -> int:
        n = 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    inactive = 0
    claimed: set[str] = set()
    for name, mod in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        count = getattr(mod, "active_param_count", None)
        if callable(count):
            claimed.add(name)
            own = sum(p.numel() for p in mod.parameters())
            inactive += own - int(count())
    total = unique(model.parameters())
    return {"total": int(total), "active": int(total - inactive)}
