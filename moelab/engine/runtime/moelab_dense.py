"""The layers a conversion keeps dense, at a decode step in the MoE layers' whole-block call.

A plan keeps some layers as the base architecture's own MLP (``{"kind": "dense"}``). transformers runs that MLP as
five torch calls (three GEMVs, the activation, the product), each a fork of the thread pool; at a decode step of a
small model their fixed costs are a large part of the layer's time, and the MoE layers beside it run as one native
call (``moelab_native.moe_ffn_decode``). ``kernel_decode`` gives a dense MLP that call too, with its whole FFN as
the shared expert and no routed expert: the same function to float32 rounding (the sums run in another order), at
d 576 / D 1,536 on 2 threads of a Zen 5 EPYC 0.41× the torch MLP's time for one token and 0.56× for eight.

The module stays what it is: its class becomes a subclass of its own (``isinstance`` holds), its keys, parameters,
prefill and training forward are unchanged, and its down projection's weight takes the decode layout
(``[d_ffn, d_model]`` storage, the values and the checkpoint's bytes the same). Where the call does not apply (a
gradient to compute, an adapter around a projection, bias, another dtype or device, no kernels on this machine) the
module's own forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from .moelab_kernels import row_major_t
from .moelab_moe import _KeptDecode, _needs_grad, decode_glu_weights
from .moelab_native import ACTIVATIONS, DECODE_TOKENS, FusedDecode, usable as native_usable

#: the projections a kept MLP needs (Llama-style gated MLPs: Llama, Mistral, Qwen, Gemma, OLMo …)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class KernelDecode:
    """The mixin ``kernel_decode`` puts before a dense MLP's class: a decode step in the whole-block call."""

    _decode_act: str

    def forward(self, x: torch.Tensor) -> Any:
        if x.dtype == torch.float32 and x.is_cpu and x.numel() <= DECODE_TOKENS * x.shape[-1]:
            kept = self.__dict__.get("_fused_kept")
            if kept is None or not kept.current():
                with torch.no_grad():
                    kept = _KeptDecode(self._decode_weights(), self._decode_call(x))
                self.__dict__["_fused_kept"] = kept
            if kept.call is not None and not (torch.is_grad_enabled() and _needs_grad(x, *kept.weights)):
                return kept.call(x)[0]
        return super().forward(x)  # type: ignore[misc]

    def use_decode_layout(self) -> None:
        """The down projection's weight with ``[d_ffn, d_model]`` storage (``realign_parameters`` calls this after a
        load, which arrives contiguous)."""
        down = self._modules["down_proj"]
        if type(down) is nn.Linear:
            down.weight.data = row_major_t(down.weight.data)

    def _decode_weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(lin.weight for lin in map(self._modules.get, PROJECTIONS) if isinstance(lin, nn.Linear))

    def _decode_call(self, x: torch.Tensor) -> FusedDecode | None:
        """The checked call, or None where it does not apply (gradients aside)."""
        weights = decode_glu_weights([self._modules.get(name) for name in PROJECTIONS])
        if weights is None or not native_usable(x, weights[0], self._decode_act):
            return None
        return FusedDecode.shared_only(weights, weights[0].shape[0], self._decode_act, x.shape[-1])


_SUBCLASSES: dict[type, type] = {}


def kernel_decode(mlp: nn.Module, act: str) -> bool:
    """Give the dense MLP ``mlp`` (plain ``gate_proj``, ``up_proj`` and ``down_proj`` without bias, its ``act_fn``
    the activation named ``act``) the whole-block decode call and its down projection the decode layout; returns
    whether it did (an MLP of another shape, or an activation the kernels lack or the MLP does not run, is left as it
    is)."""
    lins = [getattr(mlp, name, None) for name in PROJECTIONS]
    if (act not in ACTIVATIONS or any(type(lin) is not nn.Linear or lin.bias is not None for lin in lins)
            or type(getattr(mlp, "act_fn", None)) is not type(ACT2FN[act])):  # the config's name is what the MLP runs
        return False
    cls = type(mlp)
    if not issubclass(cls, KernelDecode):
        if cls not in _SUBCLASSES:  # named as its base, so that a printed model reads as before
            _SUBCLASSES[cls] = type(cls.__name__, (KernelDecode, cls), {"__module__": cls.__module__})
        mlp.__class__ = _SUBCLASSES[cls]
    mlp._decode_act = act
    mlp.use_decode_layout()
    return True
