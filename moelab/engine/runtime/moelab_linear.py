"""A decode step's projections outside the FFN (attention's, the LM head) in moelab's native kernel. Part of the
exported runtime (torch only).

At a decode step of a few tokens torch computes an ``nn.Linear`` as a GEMV that reads the weights at about half the
rate the machine allows (on 2 threads of a Zen 4 EPYC 11 GB/s, on one thread or two). A small model's step is dozens
of them: the default model's 30 layers spent 10.4 ms of a 59 ms step in attention's projections and 10.2 ms in the
LM head (49,152 × 576), against 26.7 ms in the FFNs (torch's profiler). The kernel (``moelab_native.linear_decode``)
shares the weight's rows among the threads, a token's dot products 32 floats at a time and, under AVX-512, four
tokens' at once: one token through a 576 × 576 projection 118 → 45 µs, through the LM head 10.0 → 3.4 ms; eight
tokens 210 → 85 µs and 22.1 → 6.7 ms (weights from memory, timed beside torch in one process; docs/runtime.md). A
conversion's FFNs run in moelab's kernels; without this its step kept the dense model's slow projections, a fixed
cost its FFNs' savings were measured against.

``kernel_projections`` gives every plain ``nn.Linear`` outside the decoder layers' FFNs that call at a decode step
(up to ``DECODE_TOKENS`` float32 tokens on the CPU, no gradient, a contiguous weight); anything else runs
``nn.Linear``'s own forward. The module keeps its parameters, keys and printed name. The same function to float32
rounding (the sums run in another order); a token's output has the same bits whichever tokens share its step and
on any thread count.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .moelab_layer import lean_layers, plain_layers
from .moelab_moe import _needs_grad
from .moelab_native import DECODE_TOKENS, library as native_library, linear_decode


class KernelLinear(nn.Linear):
    """``nn.Linear`` whose decode steps run ``moelab_native.linear_decode`` (``kernel_projections`` sets it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (x.dtype == torch.float32 and x.is_cpu and 0 < x.numel() <= DECODE_TOKENS * self.in_features
                and w.dtype == torch.float32 and w.is_cpu and w.is_contiguous()
                and (b is None or (b.dtype == torch.float32 and b.is_cpu and b.is_contiguous()))
                and not _needs_grad(x, w, b) and native_library() is not None):
            y = linear_decode(x.reshape(-1, self.in_features), w, b)
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def _get_name(self) -> str:  # printed as the nn.Linear it is
        return "Linear"


def projections(model: nn.Module, ffns: list[nn.Module]) -> list[nn.Linear]:
    """The plain ``nn.Linear`` modules of ``model`` outside the modules ``ffns`` (its decoder layers' FFNs, which
    moelab's runtime computes in its own calls): attention's projections and the LM head. An adapter's wrapper or a
    quantised linear is another type and is left out."""
    inside = {id(m) for ffn in ffns for m in ffn.modules()}
    return [m for m in model.modules() if type(m) is nn.Linear and id(m) not in inside]


def kernel_projections(model: nn.Module, ffns: list[nn.Module]) -> list[nn.Module]:
    """Give ``projections(model, ffns)`` the native decode call, and the decoder layers around them the lean decode
    step (``moelab_layer``); returns the modules changed."""
    changed = projections(model, ffns)
    for lin in changed:
        lin.__class__ = KernelLinear
    return [*changed, *lean_layers(model)]


@contextmanager
def projections_in_kernels(model: nn.Module, ffns: list[nn.Module]) -> Iterator[None]:
    """``model``'s projections outside ``ffns`` in the native decode call and its decoder layers' lean decode step for
    the time of the block (a baseline timed as moelab's runtime runs a conversion); as they were after it."""
    changed = kernel_projections(model, ffns)
    try:
        yield
    finally:
        for lin in changed:
            if isinstance(lin, KernelLinear):
                lin.__class__ = nn.Linear
        plain_layers(changed)
