"""The dense model in moelab's own kernels: the baseline that splits a conversion's speed-up over dense into the
kernels' part and the sparsity's.

A conversion runs in moelab's runtime, where a decode step's whole MoE block is one native call
(``moelab_native.moe_ffn_decode``); transformers runs the dense MLP it replaces as five torch calls (three GEMVs, the
activation, the product), each a fork of the thread pool. On a small model those calls' fixed costs are a large part
of a step, so the *same dense weights* in moelab's call decode faster already: the default model, 2 threads of a
Zen 5 EPYC, 1.39–1.48× at batch 1 and 1.25–1.28× at batch 8, prefill 0.98–1.07× (the same torch GEMMs; six runs). A
conversion's speed over dense is then that of the kernels times that of its sparsity, and its speed over this
baseline is the sparsity's alone: what converting bought beyond running the dense model in the same kernels.

Each layer becomes an ``MoeFFN`` whose shared expert is the whole FFN and that has no routed expert (top-0: the
decode call runs the shared expert alone): the same function, to float32 rounding (the sums run in another order).
Its gate and up weights are the dense model's own tensors (no copy); its down projection is a copy in the decode
layout (``[d_ffn, d_model]`` storage), a third of the FFN's bytes, so it is built only for the time of a timing. A
layer a conversion keeps dense runs the same call once loaded (``runtime.moelab_dense``, which keeps the base MLP's
keys); this baseline takes the ``MoeFFN`` form, which Phi-3's fused gate/up projection fits too. Swapped into the dense
model (``metrics.swapped_mlps``), its projections outside the FFNs take the native decode call as a conversion's do
(``runtime.moelab_linear``): on the default model that took this baseline from 1.30× to 1.86× dense at batch 1.
"""

from __future__ import annotations

import psutil
import torch
from torch import nn

from ..models import ModelAdapter
from ..sizes import format_size
from ..runtime import moelab_native
from ..runtime.moelab_kernels import row_major_t
from ..runtime.moelab_moe import MoeFFN


def kernel_dense_problem(adapter: ModelAdapter) -> str | None:
    """Why the dense model cannot run in moelab's decode call here (None: it can), its copy of the down projections
    included: more than half the memory free is refused."""
    if adapter.device.type != "cpu" or adapter.dtype != torch.float32:
        return f"moelab's kernels run float32 on the CPU; this model is {str(adapter.dtype).removeprefix('torch.')} on {adapter.device.type}"
    if adapter.activation not in moelab_native.ACTIVATIONS:
        return f"moelab's kernels have no {adapter.activation!r} activation"
    if moelab_native.library() is None:
        return "moelab's native kernels are not built on this machine (or MOELAB_NATIVE_KERNELS=0)"
    if any(lay.gate_bias() is not None or lay.up_bias() is not None or lay.down_proj.bias is not None
           for lay in adapter.layers):
        return "its MLPs have biases, which moelab's kernels do not add"
    copy = sum(lay.down_weight().numel() * lay.down_weight().element_size() for lay in adapter.layers)
    if copy > psutil.virtual_memory().available // 2:  # a timing is not worth the machine's last free memory
        return (f"its down projections' copy in the decode layout ({format_size(copy)}) would take more than half "
                f"the memory free ({format_size(psutil.virtual_memory().available)})")
    return None


@torch.no_grad()
def kernel_dense_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> MoeFFN:
    """The dense GLU ``down · (act(gate · x) ⊙ up · x)`` (``gate``, ``up`` ``[d_ffn, d_model]``, ``down``
    ``[d_model, d_ffn]``, as ``nn.Linear`` stores them) as an all-shared ``MoeFFN``: gate and up shared with the
    caller, down copied into the decode layout."""
    d_ffn, d_model = gate.shape
    with torch.device("meta"):  # nothing drawn: every weight is replaced below
        ffn = MoeFFN({"kind": "moe", "d_model": d_model, "d_shared": d_ffn, "n_routed": 0, "expert_size": 0,
                      "top_k": 0, "act": act})
    ffn.to_empty(device=gate.device)
    ffn.shared_gate.weight = nn.Parameter(gate, requires_grad=False)
    ffn.shared_up.weight = nn.Parameter(up, requires_grad=False)
    ffn.shared_down.weight = nn.Parameter(row_major_t(down), requires_grad=False)
    return ffn.eval()


def kernel_dense_mlps(adapter: ModelAdapter) -> dict[int, nn.Module]:
    """Every layer's MLP as ``kernel_dense_mlp`` builds it, for ``metrics.swapped_mlps``. ValueError (the
    ``kernel_dense_problem``) where the model cannot run in the kernels."""
    if (problem := kernel_dense_problem(adapter)) is not None:
        raise ValueError(problem)
    return {lay.index: kernel_dense_mlp(lay.gate_weight().detach(), lay.up_weight().detach(),
                                        lay.down_weight().detach(), adapter.activation)
            for lay in adapter.layers}
