"""moelab's sparse block: ``MoeFFN`` (shared expert + router + routed experts), as transformers lays
out its sparse-MoE blocks (Qwen2-MoE, Mixtral), and ``MoeExperts``, the routed experts with the
reference forward. Part of the exported runtime (torch and transformers only).

``MoeFFN`` replaces a dense GLU MLP ``down(act(x W_gate) * x W_up)``: an always-active shared expert
plus ``n_routed`` routed experts of ``expert_size`` neurons each, ``top_k`` of them active per token
(ExpertWeaver Eqs. 7-11, CMoE Eqs. 5, 11, 18-19). Its spec (JSON)::

    {"kind": "moe", "d_model": 576, "act": "silu", "d_shared": 192, "n_routed": 56,
     "expert_size": 24, "top_k": 24, "router": "centroid", "combine": "sum"}

``router``: a kind of ``moelab_routers.ROUTERS`` (``centroid`` EW Eq. 9, ``representative`` CMoE
Eq. 18, ``gate_mass``, ``softmax`` EW Eq. 11, ``ridge``; each class says how it scores). ``combine``:
``sum`` (EW Eq. 10 / CMoE Eq. 11, training-free default), ``weighted`` (each selected expert scaled
by its softmax probability over all experts, EW Eq. 11, D2 §2.1), ``normalized`` (softmax over the
top_k selected scores only, so a token's weights sum to 1, as in Mixtral) or ``scaled`` (CM §3.3 /
AF Eq. 9: ``s' = softmax(s)``, experts selected by ``TopK(s' + b)``, weighted ``1 + s'_i u_i``; ``u``
is the parameter ``router_scale``, ``b`` the load-balancing buffer ``router_bias``, both zero after
``use_scaled_combine()``, which leaves the output of a ``sum`` module unchanged). Optional
``dispatch``: ``auto`` (default: ``moelab_kernels.select_kernel``), ``loop`` (the reference) or
``padded`` (written by older exports for the retired capacity-padded matmul; now ``auto``).
Optional ``expert_groups`` (one int per routed expert): experts of one group are copies of one
another (Dense2MoE's N copies of a block's MLP); a token selects at most one expert per group, the
best-scoring (ties: the lower index), so two copies never add up for one token; ``top_k`` must not
exceed the number of groups. Optional ``skip_mean: true``: the buffer ``skip_mean`` ``[n_routed,
d_model]`` holds each routed expert's mean output over the calibration tokens that skipped it, and a
token adds the means of the experts it skips (``core.fitting``, skipped-expert compensation;
moelab's own). Optional ``down_keep`` (a fraction in (0, 1], default 1): activation sparsity inside
the active experts, as TEAL thresholds the down projection's input: per token, only the
``kept(m, down_keep)`` neurons of largest ``|act(gate) * up|`` of each selected routed expert, and
the ``kept(d_shared, down_keep)`` of the shared expert, run their down projection (a count, not a
threshold, so the cost does not depend on the text; moelab's). The native CPU kernels read only
the kept rows at a decode step (the shared expert's down projection is stored ``[d_shared, d_model]`` for that:
``MoeFFN.use_decode_layout``; at prefill, the rows some token of a block of four kept); the other
kernels zero the rest, so the saving needs such a kernel at every batch size, as TEAL's does. Any other keys are kept and written back by ``MoeFFN.spec``.

Neuron order inside an expert is irrelevant to the result; with ``top_k == n_routed`` and
``combine == "sum"`` a MoeFFN computes exactly the dense GLU it was sliced from (up to float
summation order).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import is_parametrized
from transformers.activations import ACT2FN

from .moelab_compat import load_legacy_expert_keys, register_load_pre_hook
from .moelab_kernels import (EXPERTS_IMPLS, decode_layout, every_expert, keep_largest, normal_in_storage_order, per_expert,
                             row_major_t, run_kernel, select_kernel)
from .moelab_native import (DECODE_TOKENS, FUSED_COMBINES, FUSED_MAX_EXPERTS, FusedDecode, glu_keep, moe_routed,
                            runs_native_prefill, skipped_means)
from .moelab_native import switched_off as native_switched_off, usable as native_usable
from .moelab_routers import COMBINES, ffn_macs, kept, router_kind

DISPATCHES = ("auto", "loop", "padded")
# "padded" (the retired capacity-padded batched matmul, a speed choice) runs the default kernels
_DISPATCH_TO_IMPL = {"auto": "auto", "loop": "loop", "padded": "auto"}


#: counts what may change a kept whole-block decode call (``MoeFFN._fused_decode``) other than a weight's ``.data``:
#: an attribute of a block, of its experts or of its router set or deleted, a module's tensors converted (``.to()``,
#: ``.double()``: ``_WatchedLayout``), and a parameter, buffer or submodule registered on one of them or on a module
#: they hold (torch's global registration hooks: a shared Linear's weight replaced, a parametrisation added to it)
_LAYOUT_EPOCH = [0]


def _layout_changed(module: nn.Module, *_: Any) -> None:
    # only the watched modules: transformers slices its ModuleList of layers at every forward, 30 registrations a step
    if isinstance(module, _WatchedLayout) or module.__dict__.get("_moelab_watched"):
        _LAYOUT_EPOCH[0] += 1  # returns None: the registration goes on unchanged


for _register in (nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook,
                  nn.modules.module.register_module_module_registration_hook):
    _register(_layout_changed)


class _WatchedLayout:
    """Mixin of the modules a kept decode call reads settings of: any attribute set or deleted, or tensors
    converted, counts as a change (``_LAYOUT_EPOCH``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module) and not isinstance(value, _WatchedLayout):
            value.__dict__["_moelab_watched"] = True  # a registration on it (its weight replaced) counts too
        super().__setattr__(name, value)  # type: ignore[misc]
        _LAYOUT_EPOCH[0] += 1

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)  # type: ignore[misc]
        _LAYOUT_EPOCH[0] += 1

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        _LAYOUT_EPOCH[0] += 1
        return out


class _KeptDecode:
    """A block's checked whole-block decode call (``FusedDecode``, or None where it does not apply) and what it was
    checked against: the layout epoch, the native kernels' switch and each weight's data pointer (a ``.data``
    assigned, as ``realign_parameters`` does, moves it; no hook sees that). It holds the weights: while the call
    holds their pointers, no new tensor can take their place. ``current()`` touches a handful of objects: a decode
    step asks once a layer, right after the layer's weights went through the caches, where rebuilding the key of
    settings, types and pointers it was checked on took 40-60 µs a layer on a Xeon (6% of a step)."""

    __slots__ = ("epoch", "native_off", "weights", "ptrs", "call")

    def __init__(self, weights: tuple[torch.Tensor, ...], call: FusedDecode | None) -> None:
        self.epoch, self.native_off = _LAYOUT_EPOCH[0], native_switched_off()
        self.weights, self.ptrs, self.call = weights, tuple(map(torch.Tensor.data_ptr, weights)), call

    def current(self) -> bool:
        return (self.epoch == _LAYOUT_EPOCH[0] and self.native_off == native_switched_off()
                and tuple(map(torch.Tensor.data_ptr, self.weights)) == self.ptrs)


class MoeExperts(_WatchedLayout, nn.Module):
    """The routed experts of one MoE layer, stacked as in transformers 5's MoE experts modules
    (``Qwen2MoeExperts``, ``MixtralExperts``): ``gate_up_proj [E, 2m, d_model]`` (rows ``:m`` the
    gate, ``m:`` the up projection of each expert) and ``down_proj [E, d_model, m]``; expert e is
    ``down_proj[e] (act(gate_up_proj[e, :m] x) * gate_up_proj[e, m:] x)``. Every expert of a layer
    has the same size ``m`` (layers may differ), so no padding is stored or computed.
    ``down_proj`` has the ``[E, d_model, m]`` shape of those modules (and of every checkpoint) but
    ``[E, m, d_model]`` storage (``moelab_kernels.decode_layout``): a decode step multiplies one row
    by the down projections of the selected experts, and with rows of ``m`` contiguous numbers that
    product streams memory at a third of the speed (8B-shaped layer, 32 of 64 experts, one token,
    one thread: 14 ms against 5 ms); prefill GEMMs take either layout at the same speed.
    ``gate_up_proj`` likewise has ``[E, d_model, 2m]`` storage (``column_major=True``, every router
    but gate_mass, whose scores need the gate rows of all experts in one GEMM): then a selected
    expert's gate/up product for one token is a weighted sum of the ``d_model`` contiguous rows
    of its block, which ``embedding_bag`` computes without copying the block (default model's
    layer, 24 of 56 experts, one token: 77 µs against 162 µs for ``index_select`` + GEMM).

    ``forward(hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k] | None,
    gate_act [T, E*m] | None) -> [T, d]``: the sum over each token's k selected experts, each
    scaled by its weight (None: weights of 1, the training-free unweighted sum, EW Eq. 10 /
    CMoE Eq. 11). ``gate_act`` (the gate-mass router) gives ``act(x W_gate)`` of every routed
    neuron, already computed to score the experts; only the up projection is then computed.
    ``top_k_index=None`` runs every expert on every token (``top_k_weights`` then ``[T, E]``).
    A row of ``top_k_index`` names distinct experts, as top-k gives them.

    ``experts_impl`` selects the kernel, as transformers' ``experts_implementation`` does:
    ``loop`` is ``reference`` below (one matmul chain per expert on its tokens); ``grouped_mm``,
    ``sorted``, ``gather``, ``dense`` and ``triton`` (GPU decode, ``moelab_triton``) are the fast kernels of
    ``moelab_kernels``; ``auto`` (the default)
    lets ``moelab_kernels.select_kernel`` choose by device, gradient and sizes (its table).
    """

    def __init__(self, num_experts: int, expert_size: int, d_model: int, act: str = "silu", column_major: bool = True):
        super().__init__()
        self.num_experts, self.expert_size, self.d_model = int(num_experts), int(expert_size), int(d_model)
        self.act_fn, self.act_name = ACT2FN[act], act
        self.column_major = bool(column_major)
        E, m, d = self.num_experts, self.expert_size, self.d_model
        gate_up = torch.empty(E, d, 2 * m).transpose(1, 2) if self.column_major else torch.empty(E, 2 * m, d)
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(decode_layout(torch.empty(E, m, d).transpose(1, 2)))
        self.experts_impl = "auto"
        self.down_keep = m  # neurons of an expert whose down projection runs per token (MoeFFN's down_keep)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for p in self.parameters(recurse=False):
            if p.device.type != "meta":
                normal_in_storage_order(p, std)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, expert_size={self.expert_size}, d_model={self.d_model}, "
                f"experts_impl={self.experts_impl}"
                + (f", down_keep={self.down_keep}" if self.down_keep < self.expert_size else ""))

    def gate_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x W_gate)`` of every routed neuron, ``[T, E*m]`` (expert-major): the gate-mass
        router's scores and, reused, the selected experts' gates."""
        E, m, d = self.num_experts, self.expert_size, self.d_model
        return self.act_fn(F.linear(x, self.gate_up_proj[:, :m].reshape(E * m, d)))

    def resolve_impl(self, x: torch.Tensor, top_k_index: torch.Tensor | None, needs_grad: bool,
                     weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                     gate_act: torch.Tensor | None = None) -> str:
        """The kernel ``forward`` runs for this call (``moelab_kernels.select_kernel``)."""
        return select_kernel(self, x, top_k_index, needs_grad, weights, gate_act)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        gate_act: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = hidden_states
        if top_k_index is not None and top_k_index.numel() == 0:
            return x.new_zeros(x.shape[0], self.d_model)
        # Each weight is read once per call and handed to the kernel: under a LoRA parametrisation
        # (peft ``target_parameters``) every read of ``self.gate_up_proj`` recomputes W + ΔW for
        # all experts and keeps it for backward, so a read per expert cost E full copies a layer
        # (440 s a training step on the default model instead of ~10).
        w = (self.gate_up_proj, self.down_proj)
        if top_k_index is None:
            return every_expert(self, x, w, top_k_weights, gate_act)
        needs_grad = _needs_grad(x, *w, top_k_weights, gate_act)
        impl = self.resolve_impl(x, top_k_index, needs_grad, w, gate_act)
        if impl == "loop":
            return self.reference(x, w, top_k_index, top_k_weights, gate_act)
        return run_kernel(impl, self, x, w, top_k_index, top_k_weights, gate_act, needs_grad)

    def reference(self, x, w, top, weights, gate_act):
        """Reference: one matmul chain per expert on the tokens that selected it (``nonzero`` and a
        host read of the per-expert counts), results scatter-added in expert order."""
        wgu, wd = w
        T, k = top.shape
        E, m = self.num_experts, self.expert_size
        mask_t = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, top, True).t()
        tok = mask_t.nonzero()[:, 1]
        counts = mask_t.sum(dim=1)
        w_sorted = None
        if weights is not None:
            full = torch.zeros(T, E, dtype=weights.dtype, device=x.device).scatter(1, top, weights)
            w_sorted = full.t()[mask_t].unsqueeze(-1)
        gu, dn = per_expert(wgu), per_expert(wd)
        y = x.new_zeros(T, self.d_model)
        s = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            te = tok[s : s + c]
            xe = x.index_select(0, te)
            if gate_act is not None:
                a = gate_act[:, e * m : (e + 1) * m].index_select(0, te)
            else:
                a = self.act_fn(F.linear(xe, gu[e][:m]))
            h = keep_largest(a * F.linear(xe, gu[e][m:]), self.down_keep)
            if w_sorted is not None:
                h = h * w_sorted[s : s + c].to(h.dtype)
            y.index_add_(0, te, F.linear(h, dn[e]))
            s += c
        return y


class MoeRouter(_WatchedLayout, nn.Module):
    """The sparse block's router (``block.router``), a child module as in transformers' sparse-MoE
    blocks (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``): ``forward(x [T, d])`` gives the scores
    ``[T, E]`` that rank the routed experts (its ``kind``'s formula, ``moelab_routers.ROUTERS``) and,
    for gate_mass, the gate activations ``[T, E*m]`` the selected experts reuse; ``select`` picks each
    token's ``top_k`` experts from them, ``weights`` gives their combine weights.

    The router's parameters stay registered on the block, under the names every checkpoint has
    (``router_weight``, ``router_offset``, ``router_gate``/``router_up``, ``router_scale``, buffer
    ``router_bias``; a kind's ``parameters(E, d)``), and the router reads them there (the registry's
    ``scores(block, x)``). So state-dict keys, the native and GGUF exports, fine-tuning's choice of
    router parameters by name and its saved optimizer states are what they were, with nothing to
    remap: keys renamed in state-dict hooks would need transformers weight converters for
    ``from_pretrained`` as well, and named parameters would still differ. The block is therefore a
    plain attribute here, not a submodule (no cycle in ``modules()``), and a weak reference: with a strong one
    every block was a reference cycle, which only Python's cyclic collector frees, so a dropped model's weights stayed
    resident until it ran (timing a grid of 8B-shaped layers one after another held 7 GiB where 2 were live). The
    block links its router (``link``) when it is built and when it is copied (``MoeFFN.__setstate__``); a router
    copied or pickled alone carries no block. ``top_k`` and ``combine``, the block's spec, are read there too.
    ``groups``: the spec's ``expert_groups`` as group ids (None: every expert its own group).
    """

    def __init__(self, kind: str, block: nn.Module, groups: torch.Tensor | None = None):
        super().__init__()
        self.kind = kind
        self.scorer = router_kind(kind)
        self.groups = groups
        self.link(block)

    def link(self, block: nn.Module) -> None:
        """Make ``block`` the block this router reads (not registered: the block owns the router)."""
        object.__setattr__(self, "_block", weakref.ref(block))

    @property
    def block(self) -> nn.Module:
        block = self.__dict__["_block"]() if "_block" in self.__dict__ else None
        if block is None:
            raise RuntimeError("this router's block is gone (a router reads its block's parameters: keep the block)")
        return block

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_block", None)  # a weak reference is neither copied nor pickled: the owning block links its copy
        return state

    def extra_repr(self) -> str:
        return f"kind={self.kind}"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.scorer.scores(self.block, x)

    def select(self, scores: torch.Tensor, sort: bool = False) -> torch.Tensor:
        """Each token's ``top_k`` experts ``[T, k]``, best first only when ``sort`` (unsorted top-k of
        24 of 56 experts for 512 tokens takes 0.27 ms against 0.45 ms)."""
        block = self.block
        key = scores
        if block.combine == "scaled":
            # CM §3.3: TopK(softmax(s) + b). In float64, because a float32 softmax of widely
            # spread scores underflows to ties at 0, and with b = 0 the selection must be TopK(s).
            key = torch.softmax(scores.detach().double(), dim=-1) + block.router_bias.double()
        if self.groups is not None and block.top_k > 1:  # top-1 is the best of its group anyway
            key = _one_per_group(key.detach(), self.groups.to(key.device))
        return torch.topk(key, block.top_k, dim=-1, sorted=sort).indices

    def weights(self, scores: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor | None:
        """Weight of each selected expert, ``[T, k]`` (``[T, E]`` when ``top`` is None: every
        expert); None for the ``sum`` combine (weights of 1, EW Eq. 10 / CMoE Eq. 11)."""
        combine, dt = self.block.combine, scores.dtype
        if combine == "sum":
            return None
        if combine == "normalized":  # softmax over the selected scores only (Mixtral)
            sel = scores if top is None else scores.gather(1, top)
            return torch.softmax(sel.float(), dim=-1).to(dt)
        p = torch.softmax(scores.float(), dim=-1).to(dt)  # EW Eq. 11, D2 §2.1
        if combine == "scaled":  # CM §3.3: g_i = 1 + s'_i u_i (exactly 1 while u = 0)
            p = 1 + p * self.block.router_scale
        return p if top is None else p.gather(1, top)


class MoeFFN(_WatchedLayout, nn.Module):
    """Shared expert + top-k routed experts; ``forward(x[..., d_model]) -> [..., d_model]``.

    Parameters: ``shared_gate``/``shared_up`` (nn.Linear d_model -> d_shared) and
    ``shared_down`` (d_shared -> d_model), absent when ``d_shared == 0``; ``experts`` (a
    ``MoeExperts``: ``gate_up_proj [E, 2m, d_model]``, ``down_proj [E, d_model, m]``); the router
    kind's parameters (``moelab_routers``: ``router_weight`` ``[E, d_model]``, ``router_offset``,
    ``router_gate``/``router_up``; none for gate_mass), registered on the block (``MoeRouter``
    says why).

    Laid out like a transformers sparse-MoE block: ``router`` (a ``MoeRouter``: scores, top-k
    selection, routing weights as a ``[T, k]`` tensor, None for the unweighted sum) and the
    ``experts`` module that runs them. State dicts and checkpoints of earlier runtimes
    (``experts_gate``/``experts_up``/``experts_down``) are converted on load (``moelab_compat``).
    Built from a dense GLU at conversion time by ``core.slicing.moe_from_dense``, not here.

    ``recorder``: optional callable (not a submodule) receiving the selected expert indices,
    shaped ``[..., top_k]`` like the input's leading dims, on every forward.
    """

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "moe")
        if kind != "moe":
            raise ValueError(f"MoeFFN needs a spec of kind 'moe', got {kind!r}")
        self.d_model = int(spec["d_model"])
        self.act = str(spec.get("act", "silu"))
        self.d_shared = int(spec.get("d_shared", 0))
        # ``n_experts`` in exports written before the method registry meant the same (routed) count
        self.n_routed = int(spec.get("n_routed", spec.get("n_experts", 0)))
        self.expert_size = int(spec.get("expert_size", 0))
        self.top_k = int(spec.get("top_k", 0))
        router = str(spec.get("router", "centroid"))
        self.combine = str(spec.get("combine", "sum"))
        dispatch = str(spec.get("dispatch", "auto"))
        E, m, d = self.n_routed, self.expert_size, self.d_model
        scorer = router_kind(router)
        if self.combine not in COMBINES:
            raise ValueError(f"unknown combine {self.combine!r}; one of {COMBINES}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"unknown dispatch {dispatch!r}; one of {DISPATCHES}")
        if min(d, self.d_shared, E, m, self.top_k) < 0 or d == 0:
            raise ValueError(f"invalid MoE sizes in spec {spec}")
        if self.top_k > E:
            raise ValueError(f"top_k={self.top_k} exceeds n_routed={E}")
        if E > 0 and m == 0:
            raise ValueError("expert_size must be positive when there are routed experts")
        self._extra = {k: v for k, v in spec.items() if k not in _MOE_KEYS}
        groups = _expert_groups(spec.get("expert_groups"), E, self.top_k)
        self.act_fn = ACT2FN[self.act]
        if self.d_shared > 0:
            self.shared_gate = nn.Linear(d, self.d_shared, bias=False)
            self.shared_up = nn.Linear(d, self.d_shared, bias=False)
            self.shared_down = nn.Linear(self.d_shared, d, bias=False)
            self.use_decode_layout()
        else:
            self.shared_gate = self.shared_up = self.shared_down = None
        self.experts = MoeExperts(E, m, d, self.act, column_major=scorer.column_major)
        self.router = MoeRouter(router, self, groups)
        self.down_keep = float(spec.get("down_keep", 1.0))
        if not 0 < self.down_keep <= 1:
            raise ValueError(f"down_keep={self.down_keep}: a fraction in (0, 1] of each expert's neurons")
        self.experts.down_keep = kept(m, self.down_keep)
        self.shared_keep = kept(self.d_shared, self.down_keep)
        self.dispatch = dispatch
        for name, shape in scorer.parameters(E, d).items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        if self.combine == "scaled":
            self._add_scaled_gating()
        self.compensated = bool(spec.get("skip_mean", False))
        if self.compensated:  # a buffer: fitted in closed form, saved and loaded, never trained
            self.register_buffer("skip_mean", torch.zeros(E, d))
        self.recorder: Callable[[torch.Tensor], None] | None = None
        register_load_pre_hook(self, load_legacy_expert_keys)
        self.reset_parameters()

    # ..................................................................... layout

    def use_decode_layout(self) -> None:
        """The shared expert's down projection with ``[d_shared, d_model]`` storage (``row_major_t``; the values and
        the checkpoint keys stay): under ``down_keep`` a decode step reads only its kept neurons' rows
        (``moelab_native.moe_ffn_decode``). ``realign_parameters`` calls this after a load."""
        if isinstance(self.shared_down, nn.Linear) and not is_parametrized(self.shared_down):
            self.shared_down.weight.data = row_major_t(self.shared_down.weight.data)

    @property
    def dispatch(self) -> str:
        """The spec's ``dispatch`` (``auto``, ``loop`` or ``padded``); setting it sets
        ``experts_impl`` (``loop`` the reference loop, otherwise ``auto``)."""
        return self._dispatch_mode

    @dispatch.setter
    def dispatch(self, mode: str) -> None:
        if mode not in DISPATCHES:
            raise ValueError(f"unknown dispatch {mode!r}; one of {DISPATCHES}")
        self._dispatch_mode = mode
        self.experts.experts_impl = _DISPATCH_TO_IMPL[mode]

    @property
    def experts_impl(self) -> str:
        """The experts kernel (``MoeExperts.experts_impl``); not part of the spec."""
        return self.experts.experts_impl

    @experts_impl.setter
    def experts_impl(self, impl: str) -> None:
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f"unknown experts_impl {impl!r}; one of {EXPERTS_IMPLS}")
        self.experts.experts_impl = impl

    def _add_scaled_gating(self) -> None:
        # b is a persistent buffer: it is saved and reloaded, but never receives a gradient
        # (CM §3.3 updates it by +-gamma from the expert loads after each training step).
        ref = self.experts.gate_up_proj
        self.router_scale = nn.Parameter(torch.zeros(self.n_routed, device=ref.device, dtype=ref.dtype))
        self.register_buffer("router_bias", torch.zeros(self.n_routed, device=ref.device, dtype=ref.dtype))

    @torch.no_grad()
    def use_scaled_combine(self) -> None:
        """Switch to the ``scaled`` combine (CM §3.3) with ``u = b = 0``: same selections and
        outputs as the ``sum`` combine, but ``u`` now receives gradients and ``b`` can balance."""
        if self.combine == "scaled":
            return
        if self.combine != "sum":
            raise ValueError(f"the scaled combine extends the 'sum' combine; this module combines {self.combine!r}")
        self.combine = "scaled"
        self._add_scaled_gating()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (a fresh model only; converted and loaded models overwrite it)."""
        for p in self.parameters(recurse=False):
            if p.device.type != "meta":
                normal_in_storage_order(p, std)
        self.experts.reset_parameters(std)
        if self.combine == "scaled" and self.router_scale.device.type != "meta":
            self.router_scale.zero_()  # u = b = 0: no perturbation of the sum combine (CM §3.3)
            self.router_bias.zero_()

    @property
    def spec(self) -> dict:
        """The JSON-able spec this module is rebuilt from (``MoeFFN(spec)``)."""
        return {
            "kind": "moe", "d_model": self.d_model, "act": self.act, "d_shared": self.d_shared,
            "n_routed": self.n_routed, "expert_size": self.expert_size, "top_k": self.top_k,
            "router": self.router.kind, "combine": self.combine,
            **({"dispatch": self.dispatch} if self.dispatch != "auto" else {}),
            **({"skip_mean": True} if self.compensated else {}),
            **({"down_keep": self.down_keep} if self.down_keep < 1 else {}), **self._extra,
        }

    def active_param_count(self) -> int:
        """Multiply-adds per token (``moelab_routers.ffn_macs``: shared expert, router, ``top_k`` routed
        experts), the same function the plan's cost is computed with."""
        return ffn_macs(self.d_model, self.d_shared, self.n_routed, self.expert_size, self.top_k, self.router.kind,
                        self.combine, self.down_keep)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_shared={self.d_shared}, n_routed={self.n_routed}, "
            f"expert_size={self.expert_size}, top_k={self.top_k}, combine={self.combine}, act={self.act}"
        )

    # ..................................................................... forward

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.d_shared == 0:
            return x.new_zeros(x.shape[0], self.d_model)
        gate, up = self.shared_gate(x), self.shared_up(x)
        if self.shared_keep < self.d_shared and not gate.requires_grad and native_usable(x, gate, self.act):
            return self.shared_down(glu_keep(gate, up, self.shared_keep, self.act))  # one call, not six
        return self.shared_down(keep_largest(self.act_fn(gate) * up, self.shared_keep))

    def gate_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate)`` of every routed neuron, ``[T, E*m]``. Under LoRA on the stacked experts, peft
        wraps ``experts`` in one ``ParamWrapper`` per adapted parameter and applies the adapters only
        inside the wrapper's forward: they are applied here the same way (its ``_activate_lora``), so
        the gate-mass scores read the same adapted gate rows as the experts' products that reuse them."""
        with contextlib.ExitStack() as adapted:
            experts = self.experts
            while hasattr(experts, "_activate_lora") and hasattr(experts, "base_layer"):
                if not (experts.disable_adapters or experts.merged):
                    adapted.enter_context(experts._activate_lora(experts.active_adapters))
                experts = experts.base_layer
            return experts.gate_activations(x)

    def _record(self, idx: torch.Tensor, lead: torch.Size) -> None:
        if self.recorder is not None:
            self.recorder(idx.reshape(*lead, idx.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        E, k = self.n_routed, self.top_k
        # a decode step first, with no reshape: each torch call costs microseconds with the caches cold
        if (k < E or k == 0) and x.numel() <= DECODE_TOKENS * self.d_model and (fused := self._fused_decode(x)) is not None:
            y, top = fused
            if self.recorder is not None:
                self._record(top, x.shape[:-1])
            if k == 0 and self.compensated and E:
                y = y + self.skip_mean.sum(0)  # every routed expert is skipped
            return y
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.d_model)
        T = xt.shape[0]
        y = self._shared(xt)
        if k == 0 or E == 0:
            self._record(torch.empty(T, 0, dtype=torch.long, device=x.device), lead)
            if self.compensated and E:
                y = y + self.skip_mean.sum(0)  # every routed expert is skipped
            return y.reshape(x.shape)
        if k >= E:
            self._record(torch.arange(E, device=x.device).expand(T, E), lead)
            y = y + self._all_experts(xt)
            return y.reshape(x.shape)
        scores, act_gate = self.router(xt)
        top = self.router.select(scores, sort=self.recorder is not None)  # the recorder's readers rank by it
        self._record(top, lead)
        weights = self.router.weights(scores, top)
        if act_gate is None and self._native_routed(xt, weights):
            wgu, wd = self.experts.gate_up_proj, self.experts.down_proj
            y = y + moe_routed(xt, top, weights, wgu.transpose(1, 2), wd.transpose(1, 2), self.expert_size,
                               self.experts.down_keep, self.act, self.skip_mean if self.compensated else None)
            return y.reshape(x.shape)
        y = y + self.experts(xt, top, weights, act_gate)
        if self.compensated:
            y = y + skipped_means(top, self.skip_mean)
        return y.reshape(x.shape)

    def _fused_decode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole block at a decode step in one native call (``moelab_native.moe_ffn_decode``): ``(output,
        selected experts best first)``, or None where it does not apply: a router whose scores are not linear, the
        scaled combine, expert groups, a shared expert wrapped by an adapter or not in the decode layout, and
        wherever ``_native_routed`` says no. Some ten torch calls and thread-pool forks a layer become one, with
        two barriers: the 30 FFNs of ``--recipe best`` at 0.5, one token, 9.3 ms against 15.0 ms (docs/runtime.md).
        A layer that selects no expert (top-0, or all of it shared) runs its shared expert alone in the same call
        (``FusedDecode.shared_only``): in torch its down projection read the decode layout's transposed storage, and
        every row of it under ``down_keep``. At d 576, D 1,536, all of it shared, 2 threads of a Zen 5 EPYC, over the
        dense MLP's time at decode b1 / b8: torch 0.98× / 1.03× (0.95× / 1.05× with half the rows kept), the call
        0.41× / 0.56× (0.36× / 0.58×, reading the kept rows only).
        The checked call is kept (``_KeptDecode``) until the layout, the native switch or a weight's data changes;
        a gradient is looked for at every call."""
        if x.dtype != torch.float32 or not x.is_cpu:
            return None
        kept = self.__dict__.get("_fused_kept")
        if kept is None or not kept.current():
            with torch.no_grad():  # what is checked once is the layout; a gradient, at every call
                kept = _KeptDecode(self._fused_weights(), self._fused_call(x))
            self.__dict__["_fused_kept"] = kept  # not a setattr: that would count as a change of layout
        call = kept.call
        if call is None or (torch.is_grad_enabled() and _needs_grad(x, *kept.weights)):
            return None
        return call(x)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_fused_kept", None)  # a copy or a pickle would meet the call's ctypes pointers: neither takes them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        router = self._modules["router"]
        if "_block" not in router.__dict__:  # a deep copy's (or an unpickled) router: it reads this copy
            router.link(self)  # (a shallow copy shares its original's router, and so its parameters)

    def _fused_weights(self) -> tuple[torch.Tensor, ...]:
        """The tensors ``_fused_call`` reads, read from the modules' dicts (``nn.Module.__getattr__`` costs more)."""
        modules = self._modules
        experts = modules["experts"]
        lins = [modules["shared_gate"], modules["shared_up"], modules["shared_down"]] if self.d_shared else []
        weights = [*(modules["router"].scorer.linear(self) or ()), *experts._parameters.values(),
                   *(lin._parameters.get("weight") for lin in lins), self._buffers.get("skip_mean")]
        return tuple(w for w in weights if w is not None)

    def _fused_call(self, x: torch.Tensor) -> FusedDecode | None:
        """The checked call of ``_fused_decode``, or None where it does not apply (gradients aside)."""
        routed = self.top_k > 0  # top-0: the shared expert alone (``FusedDecode.shared_only``), no router read
        linear = self.router.scorer.linear(self) if routed else None
        if ((routed and linear is None) or type(self.experts) is not MoeExperts or self.combine not in FUSED_COMBINES
                or self.router.groups is not None or self.n_routed > FUSED_MAX_EXPERTS or not self._native_routed(x, None)):
            return None
        shared = None
        if self.d_shared:
            shared = decode_glu_weights((self.shared_gate, self.shared_up, self.shared_down))
            if shared is None:
                return None
        if not routed:
            return FusedDecode.shared_only(shared, self.shared_keep, self.act, self.d_model)
        rw, rb = linear
        if not rw.is_contiguous() or rw.dtype != torch.float32 or (rb is not None and rb.dtype != torch.float32):
            return None
        wgu, wd = self.experts.gate_up_proj, self.experts.down_proj
        return FusedDecode(shared, self.shared_keep, (rw, rb), self.top_k, self.combine, wgu.transpose(1, 2),
                           wd.transpose(1, 2), self.expert_size, self.experts.down_keep, self.act,
                           self.skip_mean if self.compensated else None)

    def _native_routed(self, x: torch.Tensor, weights: torch.Tensor | None) -> bool:
        """Whether this call's routed experts and compensation run ``moelab_native.moe_routed``: a CPU call
        without gradient, of plain float32 experts (not wrapped by an adapter) in the decode layout, the kernel
        chosen by ``auto``, the kernel built on this machine, and a decode step or a prefill of experts the native
        kernels run (``runs_native_prefill``). Decided before the weights are read: under a parametrisation (LoRA
        on the stacked experts) every read recomputes them."""
        experts = self.experts
        if (not isinstance(experts, MoeExperts) or experts.experts_impl != "auto" or is_parametrized(experts)
                or _needs_grad(x, weights)
                or not runs_native_prefill(x.numel() // max(1, x.shape[-1]), self.expert_size, self.d_model)):
            return False
        wgu, wd = experts.gate_up_proj, experts.down_proj
        return (not _needs_grad(x, wgu, wd, weights) and wgu.transpose(1, 2).is_contiguous() and wd.transpose(1, 2).is_contiguous()
                and native_usable(x, wgu, self.act) and wd.dtype == torch.float32
                and (not self.compensated or self.skip_mean.dtype == torch.float32))

    def _all_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Every routed expert on every token: one GLU over the concatenated experts, or the native kernel with
        every expert selected (under down_keep each expert's kept products are chosen per token, which the one
        GLU does with torch's top-k over all of them)."""
        weights = act_gate = None
        if self.combine != "sum":  # every expert selected: the weighted and normalized combines coincide
            scores, act_gate = self.router(x)
            weights = self.router.weights(scores, None)
        if act_gate is None and self._native_routed(x, weights):
            wgu, wd = self.experts.gate_up_proj, self.experts.down_proj
            every = torch.arange(self.n_routed, device=x.device).expand(x.shape[0], self.n_routed)
            return moe_routed(x, every, weights, wgu.transpose(1, 2), wd.transpose(1, 2), self.expert_size,
                              self.experts.down_keep, self.act)
        return self.experts(x, None, weights, act_gate)


_MOE_KEYS = {"kind", "d_model", "act", "d_shared", "n_routed", "n_experts", "expert_size", "top_k", "router", "combine",
             "dispatch", "skip_mean", "down_keep"}


def decode_glu_weights(lins: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The gate, up and down weights of a GLU's three projections ``lins`` as the whole-block decode call reads them,
    or None where it cannot: a projection that is not a plain ``nn.Linear`` without bias (an adapter's wrapper, a
    parametrisation), a weight not float32, gate or up not contiguous, down not in the decode layout."""
    if any(type(lin) is not nn.Linear or lin.bias is not None for lin in lins):
        return None
    gate, up, down = (lin.weight for lin in lins)
    if not (gate.is_contiguous() and up.is_contiguous() and down.t().is_contiguous()
            and gate.dtype == up.dtype == down.dtype == torch.float32):
        return None
    return gate, up, down


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether a gradient is to flow through any of ``tensors`` (None: absent) in this call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _expert_groups(groups: Any, E: int, k: int) -> torch.Tensor | None:
    """``expert_groups`` as group ids 0 … G-1 (None when absent or when no two experts share a group)."""
    if groups is None or E == 0:
        return None
    if len(groups) != E:
        raise ValueError(f"expert_groups has {len(groups)} entries for {E} routed experts")
    _, ids = torch.unique(torch.tensor([int(g) for g in groups], dtype=torch.long, device="cpu"), return_inverse=True)
    n = int(ids.max()) + 1 if E else 0
    if n == E:
        return None
    if k > n:
        raise ValueError(f"top_k={k} exceeds the {n} expert groups (at most one expert of a group runs per token)")
    return ids


def _one_per_group(key: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``key`` [T, E] with every expert except the best of its group (ties: the lower index) at -inf."""
    T, E = key.shape
    G = int(groups.max()) + 1
    idx = groups.expand(T, E)
    best = key.new_full((T, G), float("-inf")).scatter_reduce(1, idx, key, "amax")
    arange = torch.arange(E, device=key.device).expand(T, E)
    cand = torch.where(key == best.gather(1, idx), arange, E)
    first = torch.full((T, G), E, dtype=torch.long, device=key.device).scatter_reduce(1, idx, cand, "amin")
    return key.masked_fill(first.gather(1, idx) != arange, float("-inf"))
