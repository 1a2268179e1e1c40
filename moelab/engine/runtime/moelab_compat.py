"""Loading what earlier runtimes wrote: their expert keys (``experts_gate``/``experts_up``
``[E, m, d]`` and ``experts_down`` ``[E, d, m]``) become the stacked ``experts.gate_up_proj`` and
``experts.down_proj`` of ``MoeExperts``, in a ``load_state_dict`` pre-hook and, for
``from_pretrained``, as transformers weight converters. Part of the exported runtime."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch import nn


def register_load_pre_hook(module: nn.Module, hook: Callable) -> None:
    if hasattr(module, "register_load_state_dict_pre_hook"):  # torch >= 2.5
        module.register_load_state_dict_pre_hook(hook)
    else:  # pragma: no cover - older torch
        module._register_load_state_dict_pre_hook(hook, with_module=True)


def load_legacy_expert_keys(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the previous runtime's ``experts_gate``/``experts_up``
    ``[E, m, d]`` and ``experts_down`` ``[E, d, m]`` become ``experts.gate_up_proj`` (gate rows
    then up rows of each expert) and ``experts.down_proj``."""
    g, u, dn = (prefix + n for n in ("experts_gate", "experts_up", "experts_down"))
    if g in state_dict or u in state_dict:
        m = module.expert_size
        current = state_dict.get(prefix + "experts.gate_up_proj", module.experts.gate_up_proj.detach())
        gate, up = state_dict.pop(g, current[:, :m]), state_dict.pop(u, current[:, m:])
        state_dict[prefix + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    if dn in state_dict:
        state_dict[prefix + "experts.down_proj"] = state_dict.pop(dn)


def is_legacy_expert_conversion(conv: Any) -> bool:
    sources = getattr(conv, "_original_source_patterns", None) or getattr(conv, "source_patterns", [])
    return any(str(p).startswith(("experts_gate", "experts_up", "experts_down")) for p in sources)


_LEGACY_LOCK = threading.Lock()


@contextlib.contextmanager
def legacy_expert_conversion(class_name: str):
    """While loading a checkpoint: convert the previous runtime's expert keys (``…experts_gate``
    and ``…experts_up`` concatenated into ``…experts.gate_up_proj``, ``…experts_down`` renamed
    ``…experts.down_proj``) with transformers' weight converters. They are registered under this
    class's name only for the duration of one ``from_pretrained`` call: an old export's own
    bundled class has the same name and must load its keys unconverted."""
    try:
        from transformers import conversion_mapping as cm
        from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming
    except ImportError:  # pragma: no cover - transformers without weight converters
        yield []
        return
    if not hasattr(cm, "register_checkpoint_conversion_mapping"):  # pragma: no cover - older transformers 5
        yield []
        return
    convs = [
        WeightConverter(source_patterns=["experts_gate", "experts_up"], target_patterns="experts.gate_up_proj",
                        operations=[Concatenate(dim=1)]),
        WeightRenaming(source_patterns="experts_down", target_patterns="experts.down_proj"),
    ]
    with _LEGACY_LOCK:
        cm.register_checkpoint_conversion_mapping(class_name, convs, overwrite=True)
        try:
            yield convs
        finally:
            cache = getattr(cm, "_checkpoint_conversion_mapping_cache", None)
            if isinstance(cache, dict):
                cache.pop(class_name, None)
            getattr(cm, "USER_REGISTERED_MAPPINGS", set()).discard(class_name)
