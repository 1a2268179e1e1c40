"""moelab Mixture-of-Experts runtime: the modules and the model class of an exported MoE.

This file is SELF-CONTAINED (torch, transformers and the standard library only): it is copied
verbatim next to the weights of every exported model and loaded from there through the
``auto_map`` of its config.json::

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)

Contents
--------
``MoeExperts``    the routed experts of a layer, stacked like transformers 5's MoE experts
                  (``gate_up_proj [E, 2m, d]``, ``down_proj [E, d, m]``), with selectable
                  kernels: reference loop, grouped_mm, sorted segments, gather (decode).
``MoeFFN``        drop-in replacement of a dense GLU MLP ``down(act(x W_gate) * x W_up)``:
                  an always-active shared expert plus ``n_routed`` routed experts of
                  ``expert_size`` neurons each, ``top_k`` of them active per token
                  (ExpertWeaver Eqs. 7-11, CMoE Eqs. 5, 11, 18-19).
``AbsTopKGLU``    ExpertWeaver Eq. 2 baseline: per token only the k neurons with the largest
                  ``|act(x W_gate)|`` are kept.
``HierarchicalExperts``  AF Eq. 10: replaces the ``experts`` of an existing sparse-MoE block
                  (Mixtral, Qwen2/3-MoE); every expert becomes a ``MoeFFN`` of sub-experts.
``LowRankMoeFFN`` MIDAS (MI §3.2): low-rank factorised copies of the dense GLU, one per
                  calibration set, behind a softmax top-k gating network.
``MoelabConfig``  ``base_config`` (the dense model's config) + ``moe_layers`` (one dict a layer).
``MoelabForCausalLM``  the base architecture built from ``base_config`` with each decoder
                  layer's ``mlp`` replaced as its ``moe_layers`` entry says.

Layer specs (JSON)
------------------
MoE layer::

    {"kind": "moe", "d_model": 576, "act": "silu", "d_shared": 192, "n_routed": 56,
     "expert_size": 24, "top_k": 24, "router": "centroid", "combine": "sum"}

``router``: ``centroid`` (EW Eq. 9, score = x W_router^T), ``representative`` (CMoE Eq. 18,
score = act(x W_g^R) * (x W_u^R)), ``gate_mass`` (score_e = sum_{j in e} |act(x W_gate_j)|,
the gate activations are computed once for every routed neuron and reused by the selected
experts), ``softmax`` (EW Eq. 11, trainable), ``ridge`` (score = x W_router^T + router_offset,
fitted in closed form to each expert's output mass on calibration tokens; moelab's own). ``combine``: ``sum`` (EW Eq. 10 / CMoE Eq. 11,
training-free default), ``weighted`` (each selected expert scaled by its softmax probability
over all experts, EW Eq. 11, D2 §2.1), ``normalized`` (softmax over the top_k selected
scores only, so a token's weights sum to 1, as in Mixtral) or ``scaled`` (CM §3.3 / AF Eq. 9:
``s' = softmax(s)``, experts selected by ``TopK(s' + b)``, weighted ``1 + s'_i u_i``; ``u`` is
the parameter ``router_scale``, ``b`` the load-balancing buffer ``router_bias``, both zero
after ``use_scaled_combine()``, which leaves the output of a ``sum`` module unchanged).
Optional ``dispatch``: ``auto``
(default: the fastest experts kernel, see ``MoeExperts``), ``loop`` (the reference: one matmul
chain per expert on its gathered tokens) or ``padded`` (written by older exports for the retired
capacity-padded matmul; now the same as ``auto``). Optional ``expert_groups`` (one int per routed expert):
experts of one group are copies of one another (Dense2MoE's N copies of a block's MLP); a
token selects at most one expert per group, the best-scoring (ties: the lower index), so
two copies never add up for one token; ``top_k`` must not exceed the number of groups.
Optional ``skip_mean: true``: the buffer ``skip_mean`` ``[n_routed, d_model]`` holds each routed
expert's mean output over the calibration tokens that skipped it, and a token adds the means of
the experts it skips (``core.fitting``, skipped-expert compensation; moelab's own).
Any other keys are kept and written back by ``MoeFFN.spec``.

AbsTopK layer: ``{"kind": "abstopk", "d_model", "d_ffn", "act", "k"}``. Dense layer:
``{"kind": "dense"}`` (or ``null``): the base architecture's MLP is kept. Hierarchical layer:
``{"kind": "hierarchical", "d_model", "num_experts", "experts_per_token", "experts": [MoE
layer spec, ...]}`` (the sparse-MoE block stays, only its ``experts`` module is replaced).
MIDAS layer: ``{"kind": "lowrank_moe", "d_model", "d_ffn", "act", "n_experts", "rank",
"top_k"}``.

Neuron order inside an expert is irrelevant to the result; with ``top_k == n_routed`` and
``combine == "sum"`` a MoeFFN computes exactly the dense GLU it was sliced from (up to float
summation order).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN

try:  # transformers >= 5: composite configs declare their sub-configs
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # pragma: no cover - older transformers
    SubConfigSpec = None

ROUTERS = ("centroid", "representative", "gate_mass", "softmax", "ridge")
COMBINES = ("sum", "weighted", "normalized", "scaled")
DISPATCHES = ("auto", "loop", "padded")
EXPERTS_IMPLS = ("auto", "loop", "grouped_mm", "sorted", "gather")

# ``dispatch`` (layer spec, kept for old exports) -> experts implementation: "loop" is the
# reference loop; "padded" (the retired capacity-padded batched matmul, a speed choice) runs the
# default kernels: its closest relative, "gather", copies every pair's expert weights and is a
# decode path only.
_DISPATCH_TO_IMPL = {"auto": "auto", "loop": "loop", "padded": "auto"}

# "auto" on accelerators: up to this many (token, expert) pairs the gather path runs (one batched
# matmul, no host synchronisation); above it grouped_mm, whose torch fallback reads the group
# offsets on the host.
GATHER_MAX_PAIRS = 64

# "auto" on CPU: the gather path for one token when ``gate_up_proj`` is column-major (nothing is copied:
# 8B-shaped layer, 24 of 56 experts of 224 neurons, 7.5 ms against grouped_mm's 14 ms), and for up to
# GATHER_MAX_TOKENS tokens whose experts' gate/up blocks (the union, at most min(E, T·k) of them) take
# at most GATHER_MAX_BYTES, so that the blocks a token re-reads, or the gate-mass router copies, stay in
# cache: a decode step of small experts. torch 2.13's CPU grouped_mm walks every group with a host read
# and one GEMM call each, ~400 µs for a default-model layer (``_gather_rows`` has the gather numbers).
# Past 8 tokens the union's extra multiply-adds lose to grouped_mm at 16 × 96; 8 tokens of 8B-shaped
# 64 × 224 experts take 51 ms gathered against 44 ms (tests/benchmarks/bench_moe_ffn.py).
GATHER_MAX_TOKENS = 8
GATHER_MAX_BYTES = 8 << 20

# CPU: activations (per pair: input and output rows of d_model, gate/up/product rows of m) processed
# per chunk of experts, about one core's L2 cache; "auto" runs all pairs at once (grouped_mm) when
# they fit, i.e. decode steps, and in chunks ("sorted") otherwise, i.e. prefill.
CHUNK_BYTES = 1 << 20

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _as_long(idx: Any) -> torch.Tensor:
    if isinstance(idx, torch.Tensor):
        return idx.detach().to(device="cpu", dtype=torch.long)
    return torch.as_tensor(idx, dtype=torch.long)


def _grouped_mm_usable(*tensors: torch.Tensor) -> bool:
    """torch's grouped_mm takes float32/bf16/fp16 operands whose base pointers and non-unit
    strides are multiples of 16 bytes (checked by the kernel, which raises otherwise)."""
    if _GROUPED_MM is None:
        return False
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


# --------------------------------------------------------------------------- routed experts


class MoeExperts(nn.Module):
    """The routed experts of one MoE layer, stacked as in transformers 5's MoE experts modules
    (``Qwen2MoeExperts``, ``MixtralExperts``): ``gate_up_proj [E, 2m, d_model]`` (rows ``:m`` the
    gate, ``m:`` the up projection of each expert) and ``down_proj [E, d_model, m]``; expert e is
    ``down_proj[e] (act(gate_up_proj[e, :m] x) * gate_up_proj[e, m:] x)``. Every expert of a layer
    has the same size ``m`` (layers may differ), so no padding is stored or computed.
    ``down_proj`` has the ``[E, d_model, m]`` shape of those modules (and of every checkpoint) but
    ``[E, m, d_model]`` storage (``_decode_layout``): a decode step multiplies one row by the down
    projections of the selected experts, and with rows of ``m`` contiguous numbers that product
    streams memory at a third of the speed (8B-shaped layer, 32 of 64 experts, one token, one
    thread: 14 ms against 5 ms); prefill GEMMs take either layout at the same speed.
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
    ``loop`` (reference: one matmul chain per expert on its tokens, found with ``nonzero``),
    ``grouped_mm`` ((token, expert) pairs sorted by expert, two ``torch.nn.functional.grouped_mm``
    calls, no host synchronisation), ``sorted`` (same sort, processed in cache-sized chunks of
    whole experts, grouped_mm inside a chunk, or one GEMM chain per expert where grouped_mm cannot
    run, e.g. when a gradient is needed: torch 2.13 has no CPU backward for it; one host read of
    the expert counts per layer), ``gather`` (the decode path: on CPU ``embedding_bag`` sums over
    the selected experts' stored rows, ``_gather_rows``; on accelerators each pair's weights
    gathered and batch-multiplied) and ``auto`` (CPU: gather for at most ``GATHER_MAX_TOKENS``
    tokens whose experts' blocks fit in ``GATHER_MAX_BYTES``, else grouped_mm when all pairs'
    activations fit in ``CHUNK_BYTES``, else sorted; accelerators: gather for at most
    ``GATHER_MAX_PAIRS`` pairs, else grouped_mm; sorted when grouped_mm cannot run). When a
    gradient is needed, ``sorted`` and ``auto`` train through ``_masked_dense`` (every
    expert, unselected ones weighted 0, when top_k ≥ E / ``GRAD_DENSE_RATIO``) or ``_segments``.
    """

    def __init__(self, num_experts: int, expert_size: int, d_model: int, act: str = "silu", column_major: bool = True):
        super().__init__()
        self.num_experts, self.expert_size, self.d_model = int(num_experts), int(expert_size), int(d_model)
        self.act_fn = ACT2FN[act]
        self.column_major = bool(column_major)
        E, m, d = self.num_experts, self.expert_size, self.d_model
        gate_up = torch.empty(E, d, 2 * m).transpose(1, 2) if self.column_major else torch.empty(E, 2 * m, d)
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(_decode_layout(torch.empty(E, m, d).transpose(1, 2)))
        self.experts_impl = "auto"

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for p in self.parameters(recurse=False):
            if p.device.type != "meta":
                nn.init.normal_(p, 0.0, std)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, expert_size={self.expert_size}, d_model={self.d_model}, "
                f"experts_impl={self.experts_impl}")

    def gate_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x W_gate)`` of every routed neuron, ``[T, E*m]`` (expert-major): the gate-mass
        router's scores and, reused, the selected experts' gates."""
        E, m, d = self.num_experts, self.expert_size, self.d_model
        return self.act_fn(F.linear(x, self.gate_up_proj[:, :m].reshape(E * m, d)))

    def resolve_impl(self, x: torch.Tensor, top_k_index: torch.Tensor | None, needs_grad: bool,
                     weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> str:
        """The kernel ``forward`` runs (``experts_impl``, or for ``auto`` the fastest for this call);
        ``weights``: ``(gate_up_proj, down_proj)`` as ``forward`` read them."""
        impl = self.experts_impl
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f"unknown experts_impl {impl!r}; one of {EXPERTS_IMPLS}")
        wgu, wd = weights if weights is not None else (self.gate_up_proj, self.down_proj)
        if impl == "grouped_mm" and (needs_grad or not self._grouped_ok(x, wgu, wd)):
            return "sorted"
        if impl != "auto":
            return impl
        pairs = top_k_index.numel() if top_k_index is not None else 0
        if x.device.type != "cpu":
            if pairs <= GATHER_MAX_PAIRS:
                return "gather"
            return "grouped_mm" if not needs_grad and self._grouped_ok(x, wgu, wd) else "sorted"
        block_bytes = 2 * self.expert_size * self.d_model * wgu.element_size()
        if not needs_grad and x.shape[0] <= GATHER_MAX_TOKENS and (
                (x.shape[0] == 1 and _decode_layout_of(wgu))  # one token, column-major blocks: nothing is copied
                or min(self.num_experts, pairs) * block_bytes <= GATHER_MAX_BYTES):
            return "gather"
        row_bytes = (2 * self.d_model + 3 * self.expert_size) * x.element_size()
        if not needs_grad and self._grouped_ok(x, wgu, wd) and pairs * row_bytes <= CHUNK_BYTES:
            return "grouped_mm"  # a decode step: every pair's activations fit in cache at once
        return "sorted"

    def _grouped_ok(self, x: torch.Tensor, wgu: torch.Tensor | None = None, wd: torch.Tensor | None = None) -> bool:
        m = self.expert_size
        wgu = self.gate_up_proj if wgu is None else wgu
        wd = self.down_proj if wd is None else wd
        return _grouped_mm_usable(x, wgu, wd) and (m * x.element_size()) % 16 == 0

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
            return self._every_expert(x, w, top_k_weights, gate_act)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or w[0].requires_grad or w[1].requires_grad
            or (top_k_weights is not None and top_k_weights.requires_grad)
            or (gate_act is not None and gate_act.requires_grad))
        impl = self.resolve_impl(x, top_k_index, needs_grad, w)
        if impl == "loop":
            return self._loop(x, w, top_k_index, top_k_weights, gate_act)
        if impl == "gather":
            return self._gather(x, w, top_k_index, top_k_weights, gate_act)
        if impl == "grouped_mm":
            return self._grouped(x, w, top_k_index, top_k_weights, gate_act)
        if needs_grad:
            if top_k_index.shape[1] * GRAD_DENSE_RATIO >= self.num_experts:
                return self._masked_dense(x, w, top_k_index, top_k_weights, gate_act)
            return self._segments(x, w, top_k_index, top_k_weights, gate_act)
        return self._sorted(x, w, top_k_index, top_k_weights, gate_act, grouped=self._grouped_ok(x, *w))

    # ..................................................................... kernels

    def _every_expert(self, x, w, weights, gate_act):
        """Every expert on every token: one GLU over the concatenated experts (the dense FFN the
        experts were sliced from, when they cover it), each expert's neurons scaled by its weight."""
        wgu, wd = w
        E, m, d = self.num_experts, self.expert_size, self.d_model
        T = x.shape[0]
        if _decode_layout_of(wgu):  # E GEMMs of one batched matmul: [E·2m, d] would be a copy of the weights
            h = torch.matmul(x, wgu.transpose(1, 2)).transpose(0, 1)
        else:
            h = F.linear(x, wgu.reshape(E * 2 * m, d)).view(T, E, 2 * m)
        g = self._glu(h) if gate_act is None else gate_act.view(T, E, m) * h[..., m:]
        if weights is not None:
            g = g * weights.unsqueeze(-1).to(g.dtype)
        w_down = wd.permute(1, 0, 2).reshape(d, E * m)
        return F.linear(g.reshape(T, E * m), w_down)

    def _loop(self, x, w, top, weights, gate_act):
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
        gu, dn = _per_expert(wgu), _per_expert(wd)
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
            h = a * F.linear(xe, gu[e][m:])
            if w_sorted is not None:
                h = h * w_sorted[s : s + c].to(h.dtype)
            y.index_add_(0, te, F.linear(h, dn[e]))
            s += c
        return y

    def _sort_pairs(self, top):
        """(token, expert) pairs sorted by expert (stable: tokens ascending within an expert, the
        reference loop's order): expert ids, positions in ``top.reshape(-1)``, tokens, counts [E].
        On CPU from an expert × token mask (``nonzero`` lists it in that order; a token's experts
        are distinct): 12,288 pairs in 0.07 ms against a stable sort's 0.35 ms. Accelerators sort,
        which needs no host synchronisation."""
        T, k = top.shape
        flat = top.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if top.device.type != "cpu":
            e_sorted, order = torch.sort(flat, stable=True)
            return e_sorted, order, torch.div(order, k, rounding_mode="floor"), counts
        slot = torch.full((T, self.num_experts), -1, dtype=torch.long).scatter_(1, top, torch.arange(k).expand(T, k))
        e_sorted, tok = (slot.t() >= 0).nonzero().unbind(1)
        return e_sorted, tok * k + slot[tok, e_sorted], tok, counts

    def _grouped(self, x, w, top, weights, gate_act):
        """All pairs in two ``grouped_mm`` calls (one GEMM per non-empty expert inside the kernel):
        no host synchronisation, and a decode step reads only the selected experts' weights."""
        wgu, wd = w
        T = x.shape[0]
        E, m = self.num_experts, self.expert_size
        e_sorted, order, tok, counts = self._sort_pairs(top)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x.index_select(0, tok)
        if gate_act is None:
            h = _GROUPED_MM(xs, wgu.transpose(1, 2), offs=offs)
            g = self._glu(h)
        else:
            a = gate_act.view(T, E, m)[tok, e_sorted]
            g = a * _GROUPED_MM(xs, wgu[:, m:].transpose(1, 2), offs=offs)
        out = _GROUPED_MM(g.contiguous(), wd.transpose(1, 2), offs=offs)
        if weights is not None:
            out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
        return x.new_zeros(T, self.d_model).index_add_(0, tok, out.to(x.dtype))

    def _sorted(self, x, w, top, weights, gate_act, grouped: bool):
        """Pairs sorted by expert, processed in chunks of whole experts whose activations (inputs,
        gate/up, outputs) fit in about ``CHUNK_BYTES``: gathered, multiplied and scatter-added while
        they are still in cache (a single pass over all pairs moves ``T*k`` rows of ``d_model``
        through memory several times: with 24-neuron experts that costs more than the arithmetic).
        Within a chunk: one grouped_mm pair, or one GEMM chain per expert (``grouped=False``).
        Inference only: ``forward`` trains through ``_masked_dense`` or ``_segments``. One host read
        of the expert counts per layer."""
        wgu, wd = w
        T = x.shape[0]
        E, m, d = self.num_experts, self.expert_size, self.d_model
        e_sorted, order, tok, counts = self._sort_pairs(top)
        sizes = counts.tolist()  # the one host read of this path
        w_sorted = weights.reshape(-1).index_select(0, order) if weights is not None else None
        row_bytes = (2 * d + 3 * m) * x.element_size()
        gu, dn = (None, None) if grouped else (_per_expert(wgu), _per_expert(wd))
        y = x.new_zeros(T, d)
        e0 = r0 = 0
        while e0 < E:
            e1, rows = e0, 0
            while e1 < E and (rows == 0 or (rows + sizes[e1]) * row_bytes <= CHUNK_BYTES):
                rows += sizes[e1]
                e1 += 1
            if rows:
                r1 = r0 + rows
                te = tok[r0:r1]
                xs = x.index_select(0, te)
                a = gate_act.view(T, E, m)[te, e_sorted[r0:r1]] if gate_act is not None else None
                if grouped:
                    offs = torch.tensor(list(itertools.accumulate(sizes[e0:e1])), dtype=torch.int32, device=x.device)
                    if a is None:
                        h = _GROUPED_MM(xs, wgu[e0:e1].transpose(1, 2), offs=offs)
                        g = self._glu(h)
                    else:
                        g = a * _GROUPED_MM(xs, wgu[e0:e1, m:].transpose(1, 2), offs=offs)
                    out = _GROUPED_MM(g.contiguous(), wd[e0:e1].transpose(1, 2), offs=offs)
                else:
                    outs, s = [], 0
                    for e in range(e0, e1):
                        c = sizes[e]
                        if c == 0:
                            continue
                        outs.append(self._expert_glu(xs[s : s + c], None if a is None else a[s : s + c], gu[e], dn[e]))
                        s += c
                    out = torch.cat(outs) if len(outs) > 1 else outs[0]
                if w_sorted is not None:
                    out = out * w_sorted[r0:r1].unsqueeze(-1).to(out.dtype)
                y.index_add_(0, te, out.to(x.dtype))
                r0 = r1
            e0 = e1
        return y

    def _glu(self, h: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of gate/up rows ``h [..., 2m]``. The gate half is made contiguous
        first: torch's CPU activations take a scalar path on a strided half (SiLU of 12,288 × 24
        numbers: 1.0 ms strided, 0.08 ms with the copy)."""
        m = self.expert_size
        return self.act_fn(h[..., :m].contiguous()) * h[..., m:]

    def _expert_glu(self, x, gate_act, gate_up, down):
        """One expert on its tokens: ``down (act(gate_up[:m] x) * gate_up[m:] x)``, the gate's
        activation taken from ``gate_act`` when the router already computed it."""
        m = self.expert_size
        if gate_act is None:
            h = F.linear(x, gate_up)
            g = self._glu(h)
        else:
            g = gate_act * F.linear(x, gate_up[m:])
        return F.linear(g, down)

    def _masked_dense(self, x, w, top, weights, gate_act):
        """Training path when a token selects at least ``1/GRAD_DENSE_RATIO`` of the experts: every
        expert on every token in two large GEMMs, the unselected ones weighted 0. The same output
        and gradients as the selected experts alone (a weight of 0 passes no gradient), at E/k
        times the multiply-adds, but GEMMs of the whole layer instead of E small ones over k
        copies of the input: 0.76 s against 2.9 s forward + backward for 1,024 tokens at the
        default model's 64 × 24 experts, top-24, LoRA on the experts (CPU, a loaded machine)."""
        dense_w = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        src = torch.ones_like(top, dtype=x.dtype) if weights is None else weights.to(x.dtype)
        return self._every_expert(x, w, dense_w.scatter(1, top, src), gate_act)

    def _segments(self, x, w, top, weights, gate_act):
        """Training path (a gradient is needed; torch 2.13 has no CPU backward for grouped_mm):
        pairs sorted by expert, gathered once, split into one segment per expert, one GEMM chain
        each, scattered back once. Every gather, slice and scatter is done once per layer, not
        once per expert or chunk: the backward of each ``index_select`` of the input is a scatter
        into a zero tensor of the whole input, and of each weight slice a zero tensor of the
        whole stack."""
        wgu, wd = w
        T = x.shape[0]
        E, m = self.num_experts, self.expert_size
        e_sorted, order, tok, counts = self._sort_pairs(top)
        sizes = counts.tolist()  # the one host read of this path
        xs = x.index_select(0, tok).split(sizes)
        a = gate_act.view(T, E, m)[tok, e_sorted].split(sizes) if gate_act is not None else None
        gu, dn = _per_expert(wgu), _per_expert(wd)
        out = torch.cat([self._expert_glu(xs[e], None if a is None else a[e], gu[e], dn[e])
                         for e in range(E) if sizes[e]])
        if weights is not None:
            out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
        return x.new_zeros(T, self.d_model).index_add(0, tok, out.to(x.dtype))

    def _gather(self, x, w, top, weights, gate_act):
        """Decode path: only the selected experts' weights are read (``_gather_rows`` on CPU,
        ``_gather_pairs`` on accelerators)."""
        if x.device.type == "cpu":
            return self._gather_rows(x, w, top, weights, gate_act)
        return self._gather_pairs(x, w, top, weights, gate_act)

    def _gather_rows(self, x, w, top, weights, gate_act):
        """CPU decode, reading only the selected experts' weights and copying none of them.
        Gate/up: with column-major ``gate_up_proj`` (``[E, d_model, 2m]`` storage) one
        ``embedding_bag`` per (token, expert) pair, the weighted sum of the expert's ``d_model``
        rows of 2m numbers with the token's inputs as weights; otherwise (gate-mass router) the
        selected blocks (for several tokens their union, ``unique``; ``resolve_impl`` keeps the
        extra multiply-adds small) gathered with ``index_select`` into one GEMM. Down: an
        ``embedding_bag`` over the selected neurons' rows of ``down_proj``'s ``[E·m, d_model]``
        storage, each row weighted by its neuron's activation (times the routing weight).
        Default model's layer, one token, 24 of 56 experts of 24 neurons, 2 threads: grouped_mm
        410 µs, index_select + GEMM + embedding_bag ~180 µs, of which gate/up 162 µs, 77 µs as
        an embedding_bag. (On an H100 a one-bag embedding_bag runs on few blocks: 8B-shaped layer,
        one token, 0.11× dense against ``_gather_pairs``' 0.52×.)"""
        wgu, wd = w
        T, k = top.shape
        E, m, d = self.num_experts, self.expert_size, self.d_model
        if gate_act is None and _decode_layout_of(wgu):  # column-major blocks: one bag per (token, expert)
            rows = _block_rows(top, d).view(T * k, d)
            inputs = x.unsqueeze(1).expand(T, k, d).reshape(T * k, d).to(wgu.dtype)
            h = F.embedding_bag(rows, wgu.transpose(1, 2).reshape(E * d, 2 * m), per_sample_weights=inputs,
                                mode="sum").view(T, k, 2 * m).to(x.dtype)
        else:
            blocks = wgu if gate_act is None else wgu[:, m:]  # gate and up rows, or up rows only
            n = blocks.shape[1]
            experts, inv = (top.reshape(-1), None) if T == 1 else torch.unique(top, return_inverse=True)
            h = F.linear(x, blocks.index_select(0, experts).reshape(-1, d)).view(T, -1, n)
            if inv is not None:
                h = _selected(h, inv)
        if gate_act is None:
            g = self._glu(h)
        else:
            g = _selected(gate_act.view(T, E, m), top) * h
        if weights is not None:
            g = g * weights.unsqueeze(-1).to(g.dtype)
        rows = _block_rows(top, m).view(T, k * m)
        down_rows = wd.transpose(1, 2).reshape(E * m, d)  # a view in the decode layout
        out = F.embedding_bag(rows, down_rows, per_sample_weights=g.reshape(T, k * m).to(down_rows.dtype), mode="sum")
        return out.to(x.dtype)

    def _gather_pairs(self, x, w, top, weights, gate_act):
        """Accelerator decode: each (token, expert) pair multiplies by its own expert's weights,
        gathered with ``index_select`` in their storage order (a plain copy of each block, no
        transposition), in two batched matmuls: no host synchronisation."""
        wgu, wd = w
        T, k = top.shape
        E, m, d = self.num_experts, self.expert_size, self.d_model
        flat = top.reshape(-1)
        blocks = wgu if gate_act is None else wgu[:, m:]
        xs = x.unsqueeze(1).expand(T, k, d).reshape(T * k, 1, d)
        if _decode_layout_of(wgu):  # stored [E, d, n]: x [1, d] @ block [d, n]
            h = torch.bmm(xs, blocks.transpose(1, 2).index_select(0, flat)).squeeze(1)
        else:  # stored [E, n, d]
            h = torch.bmm(blocks.index_select(0, flat), xs.transpose(1, 2)).squeeze(-1)
        if gate_act is None:
            g = self._glu(h)
        else:
            g = _selected(gate_act.view(T, E, m), top).reshape(T * k, m) * h
        if _decode_layout_of(wd):  # stored [E, m, d]: g [1, m] @ block [m, d]
            out = torch.bmm(g.unsqueeze(1), wd.transpose(1, 2).index_select(0, flat)).view(T, k, d)
        else:
            out = torch.bmm(wd.index_select(0, flat), g.unsqueeze(-1)).view(T, k, d)
        if weights is not None:
            out = out * weights.unsqueeze(-1).to(out.dtype)
        return out.sum(dim=1)


def _selected(per_expert: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``per_expert [T, E, n]`` at each token's selected experts ``top [T, k]``: ``[T, k, n]``."""
    return per_expert.gather(1, top.unsqueeze(-1).expand(*top.shape, per_expert.shape[-1]))


def _block_rows(top: torch.Tensor, n: int) -> torch.Tensor:
    """Row indices ``[T, k, n]`` of each selected expert's block of ``n`` rows in a ``[E·n, ·]``
    view of a stacked weight (expert e holds rows ``e·n … e·n + n − 1``)."""
    return top.unsqueeze(-1) * n + torch.arange(n, device=top.device)


#: Training (a gradient is needed) runs every expert masked when top_k ≥ E / GRAD_DENSE_RATIO
#: (``MoeExperts._masked_dense``), per-expert segments otherwise (``_segments``).
GRAD_DENSE_RATIO = 8


def _per_expert(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w[e]`` for every expert as views from one ``unbind``. When ``w`` needs a gradient (LoRA on
    the stacked experts), each ``w[e]`` taken separately back-propagates into a zero tensor of the
    whole stack, E of them a layer (64 × 7 MB at the default model's shape: 5 s a layer per step);
    ``unbind``'s backward stacks the E slices once."""
    return w.unbind(0)


# --------------------------------------------------------------------------- MoE FFN


class MoeFFN(nn.Module):
    """Shared expert + top-k routed experts; ``forward(x[..., d_model]) -> [..., d_model]``.

    Parameters: ``shared_gate``/``shared_up`` (nn.Linear d_model -> d_shared) and
    ``shared_down`` (d_shared -> d_model), absent when ``d_shared == 0``; ``experts`` (a
    ``MoeExperts``: ``gate_up_proj [E, 2m, d_model]``, ``down_proj [E, d_model, m]``);
    ``router_weight`` ``[E, d_model]`` (centroid, softmax) or ``router_gate``/``router_up``
    ``[E, d_model]`` (representative); none for gate_mass.

    Laid out like a transformers sparse-MoE block: router (the ``router_*`` parameters, which
    keep their names because fine-tuning selects and names them), routing weights as a
    ``[T, k]`` tensor (None for the unweighted sum), and the ``experts`` module that runs them.
    ``experts_gate``/``experts_up``/``experts_down`` are views of the stacked tensors in the
    previous runtime's ``[E, m, d]``/``[E, d, m]`` shapes; state dicts and checkpoints with those
    keys are converted on load (``_load_legacy_expert_keys``, ``MoelabForCausalLM.from_pretrained``).

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
        self.router = str(spec.get("router", "centroid"))
        self.combine = str(spec.get("combine", "sum"))
        dispatch = str(spec.get("dispatch", "auto"))
        E, m, d = self.n_routed, self.expert_size, self.d_model
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; one of {ROUTERS}")
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
        self._groups = _expert_groups(spec.get("expert_groups"), E, self.top_k)
        self.act_fn = ACT2FN[self.act]
        if self.d_shared > 0:
            self.shared_gate = nn.Linear(d, self.d_shared, bias=False)
            self.shared_up = nn.Linear(d, self.d_shared, bias=False)
            self.shared_down = nn.Linear(self.d_shared, d, bias=False)
        else:
            self.shared_gate = self.shared_up = self.shared_down = None
        self.experts = MoeExperts(E, m, d, self.act, column_major=self.router != "gate_mass")
        self.dispatch = dispatch
        if self.router in ("centroid", "softmax", "ridge"):
            self.router_weight = nn.Parameter(torch.empty(E, d))
            if self.router == "ridge":
                self.router_offset = nn.Parameter(torch.empty(E))
        elif self.router == "representative":
            self.router_gate = nn.Parameter(torch.empty(E, d))
            self.router_up = nn.Parameter(torch.empty(E, d))
        if self.combine == "scaled":
            self._add_scaled_gating()
        self.compensated = bool(spec.get("skip_mean", False))
        if self.compensated:  # a buffer: fitted in closed form, saved and loaded, never trained
            self.register_buffer("skip_mean", torch.zeros(E, d))
        self.recorder: Callable[[torch.Tensor], None] | None = None
        _register_load_pre_hook(self, _load_legacy_expert_keys)
        self.reset_parameters()

    # ..................................................................... layout

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

    @property
    def experts_gate(self) -> torch.Tensor:
        """``[E, m, d]`` view of the experts' gate rows (the previous runtime's parameter)."""
        return self.experts.gate_up_proj[:, : self.expert_size]

    @property
    def experts_up(self) -> torch.Tensor:
        """``[E, m, d]`` view of the experts' up rows."""
        return self.experts.gate_up_proj[:, self.expert_size :]

    @property
    def experts_down(self) -> torch.Tensor:
        """``[E, d, m]``: the experts' down projections."""
        return self.experts.down_proj

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

    # ..................................................................... construction

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (a fresh model only; converted and loaded models overwrite it)."""
        for p in self.parameters(recurse=False):
            if p.device.type != "meta":
                nn.init.normal_(p, 0.0, std)
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
            "router": self.router, "combine": self.combine,
            **({"dispatch": self.dispatch} if self.dispatch != "auto" else {}),
            **({"skip_mean": True} if self.compensated else {}), **self._extra,
        }

    @classmethod
    @torch.no_grad()
    def from_dense(
        cls,
        gate_w: torch.Tensor,
        up_w: torch.Tensor,
        down_w: torch.Tensor,
        act: str,
        shared_idx: Any,
        routed_idx: Any,
        top_k: int,
        router: str,
        combine: str = "sum",
        router_weight: torch.Tensor | None = None,
        router_gate: torch.Tensor | None = None,
        router_up: torch.Tensor | None = None,
        router_offset: torch.Tensor | None = None,
        skip_mean: torch.Tensor | None = None,
        **extra: Any,
    ) -> "MoeFFN":
        """Slice a dense GLU into a shared expert and routed experts (EW Eqs. 7-8, CMoE Eq. 5).

        ``gate_w``/``up_w``: ``[d_ffn, d_model]`` (nn.Linear layout); ``down_w``: ``[d_model, d_ffn]``.
        ``shared_idx``: neuron ids of the shared expert (may be empty); ``routed_idx``:
        ``[E, m]`` neuron ids of each routed expert. Neurons left out of both are pruned.
        Router weights default to the expert centroids of the gate rows (EW Eq. 9); for the
        representative router to the centroids of the gate and up rows (pass CMoE's
        representative-neuron rows to follow Eq. 18 exactly). ``skip_mean`` ``[E, d_model]``: the
        skipped experts' calibration means (``core.fitting.skipped_means``), added for the experts
        a token skips.
        """
        d_ffn, d_model = gate_w.shape
        if up_w.shape != gate_w.shape or down_w.shape != (d_model, d_ffn):
            raise ValueError(
                f"shapes gate {tuple(gate_w.shape)}, up {tuple(up_w.shape)}, down {tuple(down_w.shape)} "
                "do not form a GLU (gate/up [d_ffn, d_model], down [d_model, d_ffn])"
            )
        shared = _as_long(shared_idx).reshape(-1)
        routed = _as_long(routed_idx)
        if routed.numel() == 0:
            routed = routed.reshape(0, 0)
        if routed.dim() != 2:
            raise ValueError(f"routed_idx must be [n_routed, expert_size], got shape {tuple(routed.shape)}")
        used = torch.cat([shared, routed.reshape(-1)])
        if used.numel() and (used.min() < 0 or used.max() >= d_ffn):
            raise ValueError(f"neuron index out of range [0, {d_ffn})")
        if torch.unique(used).numel() != used.numel():
            raise ValueError("a neuron is assigned twice (shared/routed indices overlap)")
        E, m = routed.shape
        spec = {
            "kind": "moe", "d_model": int(d_model), "act": str(act), "d_shared": int(shared.numel()),
            "n_routed": int(E), "expert_size": int(m), "top_k": int(top_k), "router": router,
            "combine": combine, **({"skip_mean": True} if skip_mean is not None else {}), **extra,
        }
        dev, dt = gate_w.device, gate_w.dtype
        with torch.device("meta"):
            mod = cls(spec)
        mod.to_empty(device=dev)
        mod.to(dt)
        sh, rt = shared.to(dev), routed.to(dev)
        if mod.d_shared:
            mod.shared_gate.weight.copy_(gate_w.index_select(0, sh))
            mod.shared_up.weight.copy_(up_w.index_select(0, sh))
            mod.shared_down.weight.copy_(down_w.index_select(1, sh))
        flat = rt.reshape(-1)
        mod.experts_gate.copy_(gate_w.index_select(0, flat).reshape(E, m, d_model))
        mod.experts_up.copy_(up_w.index_select(0, flat).reshape(E, m, d_model))
        # down_w[:, routed] is [d, E, m] -> [E, d, m]
        mod.experts.down_proj.copy_(down_w.index_select(1, flat).reshape(d_model, E, m).permute(1, 0, 2))
        if mod.router in ("centroid", "softmax", "ridge"):
            w = router_weight if router_weight is not None else mod.experts_gate.mean(dim=1)
            mod.router_weight.copy_(_check_router(w, E, d_model, "router_weight"))
            if mod.router == "ridge" and E:
                if router_offset is None or tuple(router_offset.shape) != (E,):
                    raise ValueError(f"the ridge router needs router_offset [n_routed={E}]")
                mod.router_offset.copy_(router_offset)
        elif mod.router == "representative":
            g = router_gate if router_gate is not None else mod.experts_gate.mean(dim=1)
            u = router_up if router_up is not None else mod.experts_up.mean(dim=1)
            mod.router_gate.copy_(_check_router(g, E, d_model, "router_gate"))
            mod.router_up.copy_(_check_router(u, E, d_model, "router_up"))
        if mod.combine == "scaled":  # to_empty left them uninitialised
            mod.router_scale.zero_()
            mod.router_bias.zero_()
        if skip_mean is not None:
            if tuple(skip_mean.shape) != (E, d_model):
                raise ValueError(f"skip_mean must be [n_routed={E}, d_model={d_model}], got {tuple(skip_mean.shape)}")
            mod.skip_mean.copy_(skip_mean)
        return mod

    def active_param_count(self) -> int:
        """Parameters one token uses: shared expert, ``top_k`` routed experts and the router."""
        router = sum(p.numel() for n, p in self.named_parameters(recurse=False) if n.startswith("router"))
        shared = 3 * self.d_model * self.d_shared
        k, m, d = min(self.top_k, self.n_routed), self.expert_size, self.d_model
        if k == 0:  # forward runs no router
            return shared
        if k == self.n_routed and self.combine == "sum":  # every expert runs, unscored
            return shared + 3 * d * m * k
        if self.router == "gate_mass" and k < self.n_routed:  # every routed gate row scores the experts
            return shared + d * m * (self.n_routed + 2 * k)
        return shared + 3 * d * m * k + router

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_shared={self.d_shared}, n_routed={self.n_routed}, "
            f"expert_size={self.expert_size}, top_k={self.top_k}, router={self.router}, "
            f"combine={self.combine}, act={self.act}"
        )

    # ..................................................................... forward

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.d_shared == 0:
            return x.new_zeros(x.shape[0], self.d_model)
        return self.shared_down(self.act_fn(self.shared_gate(x)) * self.shared_up(x))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Router scores ``[T, E]`` and, for gate_mass, act(gate) of every routed neuron ``[T, E*m]``."""
        if self.router in ("centroid", "softmax"):
            return F.linear(x, self.router_weight), None
        if self.router == "ridge":
            return F.linear(x, self.router_weight, self.router_offset), None
        if self.router == "representative":
            return self.act_fn(F.linear(x, self.router_gate)) * F.linear(x, self.router_up), None
        a = self._gate_activations(x)
        return a.abs().reshape(-1, self.n_routed, self.expert_size).sum(dim=-1), a

    def _gate_activations(self, x: torch.Tensor) -> torch.Tensor:
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
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.d_model)
        T, E, k = xt.shape[0], self.n_routed, self.top_k
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
        scores, act_gate = self._route(xt)
        key = scores
        if self.combine == "scaled":
            # CM §3.3: TopK(softmax(s) + b). In float64, because a float32 softmax of widely
            # spread scores underflows to ties at 0, and with b = 0 the selection must be TopK(s).
            key = torch.softmax(scores.detach().double(), dim=-1) + self.router_bias.double()
        if self._groups is not None and k > 1:  # top-1 is the best of its group anyway
            key = _one_per_group(key.detach(), self._groups.to(key.device))
        # [T, k]; best first only when recorded (the recorder's readers rank by it): unsorted top-k of
        # 24 of 56 experts for 512 tokens takes 0.27 ms against 0.45 ms
        top = torch.topk(key, k, dim=-1, sorted=self.recorder is not None).indices
        self._record(top, lead)
        y = y + self.experts(xt, top, self._routing_weights(scores, top), act_gate)
        if self.compensated:  # Σ_{e∉top} μ_e as (Σ_e μ_e) − Σ_{e∈top} μ_e: k + 1 additions per token
            y = y + (self.skip_mean.sum(0) - self.skip_mean[top].sum(1))
        return y.reshape(x.shape)

    def _routing_weights(self, scores: torch.Tensor, top: torch.Tensor | None) -> torch.Tensor | None:
        """Weight of each selected expert, ``[T, k]`` (``[T, E]`` when ``top`` is None: every
        expert); None for the ``sum`` combine (weights of 1, EW Eq. 10 / CMoE Eq. 11)."""
        dt = scores.dtype
        if self.combine == "sum":
            return None
        if self.combine == "normalized":  # softmax over the selected scores only (Mixtral)
            sel = scores if top is None else scores.gather(1, top)
            return torch.softmax(sel.float(), dim=-1).to(dt)
        p = torch.softmax(scores.float(), dim=-1).to(dt)  # EW Eq. 11, D2 §2.1
        if self.combine == "scaled":  # CM §3.3: g_i = 1 + s'_i u_i (exactly 1 while u = 0)
            p = 1 + p * self.router_scale
        return p if top is None else p.gather(1, top)

    def _all_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Every routed expert on every token: one GLU over the concatenated experts."""
        if self.combine == "sum":
            return self.experts(x, None, None)
        # every expert selected: the weighted and normalized combines coincide
        scores, act_gate = self._route(x)
        return self.experts(x, None, self._routing_weights(scores, None), act_gate)


_MOE_KEYS = {"kind", "d_model", "act", "d_shared", "n_routed", "n_experts", "expert_size", "top_k", "router", "combine",
             "dispatch", "skip_mean"}


def _register_load_pre_hook(module: nn.Module, hook: Callable) -> None:
    if hasattr(module, "register_load_state_dict_pre_hook"):  # torch >= 2.5
        module.register_load_state_dict_pre_hook(hook)
    else:  # pragma: no cover - older torch
        module._register_load_state_dict_pre_hook(hook, with_module=True)


def _load_legacy_expert_keys(module: "MoeFFN", state_dict: dict, prefix: str, *args: Any) -> None:
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


def _check_router(w: torch.Tensor, E: int, d: int, name: str) -> torch.Tensor:
    w = torch.as_tensor(w)
    if tuple(w.shape) != (E, d):
        raise ValueError(f"{name} must be [n_routed={E}, d_model={d}], got {tuple(w.shape)}")
    return w


# --------------------------------------------------------------------------- AbsTopK-GLU


class AbsTopKGLU(nn.Module):
    """EW Eq. 2: ``down( AbsTopK(act(x W_gate), k) * x W_up )`` - per token, only the k neurons
    with the largest ``|act(x W_gate)|`` contribute. Parameters keep the dense names."""

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "abstopk")
        if kind != "abstopk":
            raise ValueError(f"AbsTopKGLU needs a spec of kind 'abstopk', got {kind!r}")
        self.d_model, self.d_ffn = int(spec["d_model"]), int(spec["d_ffn"])
        self.act, self.k = str(spec.get("act", "silu")), int(spec["k"])
        if not 0 <= self.k <= self.d_ffn:
            raise ValueError(f"k={self.k} must be in [0, d_ffn={self.d_ffn}]")
        self._extra = {k: v for k, v in spec.items() if k not in ("d_model", "d_ffn", "act", "k")}
        self.act_fn = ACT2FN[self.act]
        self.gate_proj = nn.Linear(self.d_model, self.d_ffn, bias=False)
        self.up_proj = nn.Linear(self.d_model, self.d_ffn, bias=False)
        self.down_proj = nn.Linear(self.d_ffn, self.d_model, bias=False)
        self.recorder: Callable[[torch.Tensor], None] | None = None

    @property
    def spec(self) -> dict:
        return {"kind": "abstopk", "d_model": self.d_model, "d_ffn": self.d_ffn, "act": self.act,
                "k": self.k, **self._extra}

    @classmethod
    @torch.no_grad()
    def from_dense(cls, gate_w, up_w, down_w, act: str, k: int, **extra: Any) -> "AbsTopKGLU":
        d_ffn, d_model = gate_w.shape
        with torch.device("meta"):
            mod = cls({"kind": "abstopk", "d_model": int(d_model), "d_ffn": int(d_ffn), "act": act,
                       "k": int(k), **extra})
        mod.to_empty(device=gate_w.device)
        mod.to(gate_w.dtype)
        mod.gate_proj.weight.copy_(gate_w)
        mod.up_proj.weight.copy_(up_w)
        mod.down_proj.weight.copy_(down_w)
        return mod

    def active_param_count(self) -> int:
        """All gate rows are computed to pick the top k; up and down only for those k neurons."""
        return self.d_model * (self.d_ffn + 2 * self.k)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ffn={self.d_ffn}, k={self.k}, act={self.act}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act_fn(self.gate_proj(x))
        if self.k < self.d_ffn:
            idx = torch.topk(a.abs(), self.k, dim=-1).indices
            if self.recorder is not None:
                self.recorder(idx)
            a = torch.zeros_like(a).scatter(-1, idx, a.gather(-1, idx))
        return self.down_proj(a * self.up_proj(x))


# --------------------------------------------------------------------------- hierarchical experts


class HierarchicalExperts(nn.Module):
    """AF §4.4, Eq. 10: the routed experts of an existing sparse-MoE block, each expert
    restructured into shared + routed sub-experts with its own sub-router,
    ``E_i(x) -> E_i^s(x) + sum_j g'_ij E_ij^r(x)``; ``sub_experts[i]`` is a ``MoeFFN``.

    Replaces the fused ``experts`` module of a transformers sparse-MoE block (Mixtral,
    Qwen2-MoE, Qwen3-MoE) with the same call, ``forward(hidden_states [T, d], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, d]``, so the block's top-level router, its top-k
    weights and (Qwen2-MoE) its shared expert and shared_expert_gate keep working untouched:
    every (token, slot) pair routed to expert i runs ``sub_experts[i]`` on that token, scaled by
    the slot's weight, exactly as the replaced module does. Index ``num_experts`` means "no
    expert" (transformers' expert-parallel convention) and adds nothing.

    Spec: ``{"kind": "hierarchical", "d_model", "num_experts", "experts_per_token",
    "experts": [MoeFFN spec, ...]}``; ``experts_per_token`` is the top-level router's k (used by
    ``active_param_count`` only). Every sub-MoE has the same ``top_k``.

    Routing statistics are about sub-experts: ``n_routed`` counts the routed sub-experts of all
    experts (sub-expert j of expert i has the global id ``offsets[i] + j``) and ``top_k`` =
    ``experts_per_token * sub top_k``. ``recorder`` receives ``[batch, seq, top_k]`` global ids,
    slot-major (top-level slot s owns columns ``s*sub_top_k : (s+1)*sub_top_k``), -1 for a "no
    expert" slot. ``[batch, seq]`` is the enclosing block's input shape, remembered by a
    pre-hook ``convert_in_place`` installs; called on its own the module records ``[T, top_k]``.
    """

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "hierarchical")
        if kind != "hierarchical":
            raise ValueError(f"HierarchicalExperts needs a spec of kind 'hierarchical', got {kind!r}")
        subs = list(spec.pop("experts", None) or [])
        if not subs:
            raise ValueError("a hierarchical spec needs 'experts': one MoE spec per expert of the block")
        self.d_model = int(spec.pop("d_model"))
        self.num_experts = int(spec.pop("num_experts", len(subs)))
        self.experts_per_token = int(spec.pop("experts_per_token"))
        if self.num_experts != len(subs):
            raise ValueError(f"num_experts={self.num_experts} but the spec lists {len(subs)} expert specs")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )
        self._extra = spec
        self.sub_experts = nn.ModuleList(MoeFFN(s) for s in subs)
        if {m.d_model for m in self.sub_experts} != {self.d_model}:
            raise ValueError(f"every sub-MoE must have d_model={self.d_model}")
        tops = {m.top_k for m in self.sub_experts}
        if len(tops) != 1:  # the recorder's selections must form one rectangular tensor
            raise ValueError(f"every sub-MoE must have the same top_k, got {sorted(tops)}")
        self.sub_top_k = tops.pop()
        counts = [m.n_routed for m in self.sub_experts]
        self.offsets = [sum(counts[:i]) for i in range(len(counts))]
        self.n_routed = sum(counts)
        self.top_k = self.experts_per_token * self.sub_top_k
        self.recorder: Callable[[torch.Tensor], None] | None = None
        self._lead: tuple[int, ...] | None = None

    @property
    def spec(self) -> dict:
        return {"kind": "hierarchical", "d_model": self.d_model, "num_experts": self.num_experts,
                "experts_per_token": self.experts_per_token, **self._extra,
                "experts": [m.spec for m in self.sub_experts]}

    @classmethod
    def from_sub_experts(cls, subs: list[MoeFFN], experts_per_token: int, **extra: Any) -> "HierarchicalExperts":
        """Wrap already-built sub-MoEs (one per expert, in expert order); no weight copy."""
        if not subs:
            raise ValueError("from_sub_experts needs one MoeFFN per expert")
        spec = {"kind": "hierarchical", "d_model": subs[0].d_model, "num_experts": len(subs),
                "experts_per_token": int(experts_per_token), **extra, "experts": [m.spec for m in subs]}
        with torch.device("meta"):  # validates the spec; the meta sub-MoEs are replaced right away
            mod = cls(spec)
        mod.sub_experts = nn.ModuleList(subs)
        return mod

    def active_param_count(self) -> int:
        """Per token: ``experts_per_token`` experts, each its shared part, its active sub-experts
        and its sub-router (``MoeFFN.active_param_count``); with unequal experts the largest ones
        (an upper bound). The block's top-level router stays outside this module."""
        per_expert = sorted((m.active_param_count() for m in self.sub_experts), reverse=True)
        return sum(per_expert[: self.experts_per_token])

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, experts_per_token={self.experts_per_token}, "
                f"sub_experts={self.n_routed}, top_k={self.top_k}")

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        T, k = top_k_index.shape
        lead, self._lead = self._lead, None
        out = torch.zeros_like(hidden_states)
        selected = None
        if self.recorder is not None:
            selected = top_k_index.new_full((T, k, self.sub_top_k), -1)
        flat = top_k_index.reshape(-1)
        # (token, slot) pairs grouped by expert (stable: tokens ascending); "no expert" sorts last.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts].tolist()
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            pairs = order[start : start + c]
            start += c
            tok, pos = pairs // k, pairs % k
            sub = self.sub_experts[e]
            xe = hidden_states.index_select(0, tok)
            if selected is None:
                y = sub(xe)
            else:
                got: list[torch.Tensor] = []
                previous, sub.recorder = sub.recorder, got.append
                try:
                    y = sub(xe)
                finally:
                    sub.recorder = previous
                selected[tok, pos] = got[0].to(selected.dtype) + self.offsets[e]
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if selected is not None:
            shape = lead if lead is not None and math.prod(lead) == T else (T,)
            self.recorder(selected.reshape(*shape, k * self.sub_top_k))
        return out


def _remember_lead_shape(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook on a sparse-MoE block: its experts see flattened tokens, the recorder wants
    ``[batch, seq, ...]``."""
    x = args[0] if args else kwargs.get("hidden_states")
    experts = getattr(block, "experts", None)
    if isinstance(experts, HierarchicalExperts) and isinstance(x, torch.Tensor):
        experts._lead = tuple(x.shape[:-1])


def _set_experts(block: nn.Module, mod: HierarchicalExperts, i: int) -> None:
    """A hierarchical layer replaces only the ``experts`` of the layer's sparse-MoE block."""
    moe_block = getattr(block, "mlp", None)
    if not isinstance(getattr(moe_block, "experts", None), nn.Module):
        raise ValueError(
            f"layer {i}: a hierarchical layer replaces the experts of a sparse-MoE block (mlp.experts), "
            f"but this layer's MLP is a {type(moe_block).__name__}"
        )
    moe_block.experts = mod
    if not getattr(moe_block, "_moelab_lead_hook", False):
        moe_block.register_forward_pre_hook(_remember_lead_shape, with_kwargs=True)
        moe_block._moelab_lead_hook = True


# --------------------------------------------------------------------------- MIDAS low-rank MoE

_LOWRANK_FACTORS = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")
_LOWRANK_KEYS = {"kind", "d_model", "d_ffn", "act", "n_experts", "rank", "top_k"}


class LowRankMoeFFN(nn.Module):
    """MIDAS (MI §3.2, Alg. 1): ``n_experts`` low-rank copies of one dense GLU, each factorised
    on its own calibration set, behind a new softmax top-k gating network G.

    Expert e: ``down_b[e] down_a[e] ( act(gate_b[e] gate_a[e] x) * up_b[e] up_a[e] x )``.
    Factors are stacked ``nn.Parameter`` tensors named as in LoRA (A maps in, B maps out):
    ``gate_a``/``up_a`` ``[E, r, d_model]``, ``gate_b``/``up_b`` ``[E, d_ffn, r]``,
    ``down_a`` ``[E, r, d_ffn]``, ``down_b`` ``[E, d_model, r]``. ``router`` is G, an
    ``nn.Linear(d_model, E, bias=False)``.

    Combine: ``p = softmax(G x)`` over all E experts, the ``top_k`` largest are kept and
    renormalised to sum to 1 (Mixtral / LLaMA-MoE gating), so the output is a convex
    combination of the selected experts: with a fresh G it is roughly an average of low-rank
    approximations of the same FFN, and G stays trainable through the weights.

    Spec: ``{"kind": "lowrank_moe", "d_model", "d_ffn", "act", "n_experts", "rank", "top_k"}``.
    ``recorder``: optional callable receiving the selected expert ids ``[..., top_k]``.
    """

    def __init__(self, spec: dict):
        super().__init__()
        spec = dict(spec)
        kind = spec.pop("kind", "lowrank_moe")
        if kind != "lowrank_moe":
            raise ValueError(f"LowRankMoeFFN needs a spec of kind 'lowrank_moe', got {kind!r}")
        self.d_model, self.d_ffn = int(spec["d_model"]), int(spec["d_ffn"])
        self.act = str(spec.get("act", "silu"))
        self.n_experts, self.rank, self.top_k = int(spec["n_experts"]), int(spec["rank"]), int(spec["top_k"])
        E, r, d, f = self.n_experts, self.rank, self.d_model, self.d_ffn
        if min(d, f, E, r) < 1:
            raise ValueError(f"d_model, d_ffn, n_experts and rank must be ≥ 1 in spec {spec}")
        if not 1 <= self.top_k <= E:
            raise ValueError(f"top_k={self.top_k} must be within 1 … n_experts={E}")
        self._extra = {k: v for k, v in spec.items() if k not in _LOWRANK_KEYS}
        self.act_fn = ACT2FN[self.act]
        self.router = nn.Linear(d, E, bias=False)
        self.gate_a = nn.Parameter(torch.empty(E, r, d))
        self.gate_b = nn.Parameter(torch.empty(E, f, r))
        self.up_a = nn.Parameter(torch.empty(E, r, d))
        self.up_b = nn.Parameter(torch.empty(E, f, r))
        self.down_a = nn.Parameter(torch.empty(E, r, f))
        self.down_b = nn.Parameter(torch.empty(E, d, r))
        self.recorder: Callable[[torch.Tensor], None] | None = None
        self.reset_parameters()

    @property
    def n_routed(self) -> int:
        """Every expert is routed (no shared expert): the same count as ``n_experts``."""
        return self.n_experts

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (a fresh model only; converted and loaded models overwrite it)."""
        for p in self.parameters():
            if p.device.type != "meta":
                nn.init.normal_(p, 0.0, std)

    @property
    def spec(self) -> dict:
        return {
            "kind": "lowrank_moe", "d_model": self.d_model, "d_ffn": self.d_ffn, "act": self.act,
            "n_experts": self.n_experts, "rank": self.rank, "top_k": self.top_k, **self._extra,
        }

    @classmethod
    @torch.no_grad()
    def from_factors(
        cls, factors: dict[str, torch.Tensor], router_weight: torch.Tensor, act: str, top_k: int, **extra: Any
    ) -> "LowRankMoeFFN":
        """Build from stacked factors (keys ``gate_a`` … ``down_b``, shapes as in the class
        docstring) and the gating network's weight ``[E, d_model]``; dtype/device of ``gate_a``."""
        missing = [k for k in _LOWRANK_FACTORS if k not in factors]
        if missing:
            raise ValueError(f"missing factors: {', '.join(missing)}")
        E, r, d = factors["gate_a"].shape
        f = factors["gate_b"].shape[1]
        spec = {"kind": "lowrank_moe", "d_model": int(d), "d_ffn": int(f), "act": str(act), "n_experts": int(E),
                "rank": int(r), "top_k": int(top_k), **extra}
        with torch.device("meta"):
            mod = cls(spec)
        ref = factors["gate_a"]
        mod.to_empty(device=ref.device)
        mod.to(ref.dtype)
        for name in _LOWRANK_FACTORS:
            p = getattr(mod, name)
            if tuple(factors[name].shape) != tuple(p.shape):
                raise ValueError(f"{name} must be {tuple(p.shape)}, got {tuple(factors[name].shape)}")
            p.copy_(factors[name])
        if tuple(router_weight.shape) != (E, d):
            raise ValueError(f"router_weight must be [n_experts={E}, d_model={d}], got {tuple(router_weight.shape)}")
        mod.router.weight.copy_(router_weight)
        return mod

    def active_param_count(self) -> int:
        """Gating network plus ``top_k`` experts of three rank-r factor pairs each."""
        return self.n_experts * self.d_model + self.top_k * 3 * self.rank * (self.d_model + self.d_ffn)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, n_experts={self.n_experts}, rank={self.rank}, "
                f"top_k={self.top_k}, act={self.act}")

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on ``x [..., d_model]`` (MI Eq. 2's E_e as a GLU)."""
        g = F.linear(F.linear(x, self.gate_a[e]), self.gate_b[e])
        u = F.linear(F.linear(x, self.up_a[e]), self.up_b[e])
        return F.linear(F.linear(self.act_fn(g) * u, self.down_a[e]), self.down_b[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.d_model)
        T, E = xt.shape[0], self.n_experts
        probs = torch.softmax(self.router(xt).float(), dim=-1)
        weight, top = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        if self.recorder is not None:
            self.recorder(top.reshape(*lead, self.top_k))
        y = xt.new_zeros(T, self.d_model)
        # Group (token, expert) pairs by expert: the nonzeros of the [E, T] selection mask in
        # row-major order, so each expert runs once on all of its tokens.
        mask_t = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter_(1, top, True).t()
        tok = mask_t.nonzero()[:, 1]
        w_sorted = torch.zeros(T, E, dtype=x.dtype, device=x.device).scatter(1, top, weight).t()[mask_t]
        s = 0
        for e, c in enumerate(mask_t.sum(dim=1).tolist()):
            if c == 0:
                continue
            te = tok[s : s + c]
            y.index_add_(0, te, self.expert(e, xt.index_select(0, te)) * w_sorted[s : s + c, None])
            s += c
        return y.reshape(*lead, self.d_model)


# --------------------------------------------------------------------------- layer specs


def build_layer_module(entry: dict | None) -> nn.Module | None:
    """The module a ``moe_layers`` entry describes, or None to keep the dense MLP."""
    if not entry:
        return None
    kind = entry.get("kind", "moe")
    if kind == "dense":
        return None
    if kind == "moe":
        return MoeFFN(entry)
    if kind == "abstopk":
        return AbsTopKGLU(entry)
    if kind == "hierarchical":
        return HierarchicalExperts(entry)
    if kind == "lowrank_moe":
        return LowRankMoeFFN(entry)
    raise ValueError(f"unknown layer kind {kind!r} (moe, abstopk, hierarchical, lowrank_moe or dense)")


def layer_spec(module: nn.Module | None) -> dict:
    """The ``moe_layers`` entry of a replacement module (``{"kind": "dense"}`` for None/other)."""
    spec = getattr(module, "spec", None) if module is not None else None
    return dict(spec) if isinstance(spec, dict) else {"kind": "dense"}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (get_decoder().layers)")
    return layers


def convert_in_place(model: nn.Module, layer_modules: dict[int, nn.Module | None]) -> nn.Module:
    """Replace ``layers[i].mlp`` by ``layer_modules[i]`` (None keeps the layer dense); a
    ``HierarchicalExperts`` replaces ``layers[i].mlp.experts`` instead."""
    layers = decoder_layers(model)
    for i, mod in layer_modules.items():
        if mod is None:
            continue
        if not 0 <= int(i) < len(layers):
            raise IndexError(f"layer {i} out of range (model has {len(layers)} layers)")
        block = layers[int(i)]
        if isinstance(mod, HierarchicalExperts):
            _set_experts(block, mod, int(i))
            continue
        attr = "mlp" if hasattr(block, "mlp") else "feed_forward"
        setattr(block, attr, mod)
    return model


def _decode_layout_of(w: torch.Tensor) -> bool:
    """Whether ``w [E, a, b]`` has ``[E, b, a]`` storage."""
    return w.dim() == 3 and w.stride()[1:] == (1, w.shape[1])


@torch.no_grad()
def _decode_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[E, a, b]`` with ``[E, b, a]`` storage (``MoeExperts``); the same values."""
    if w.dim() != 3 or _decode_layout_of(w) or w.device.type == "meta":
        return w
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def realign_parameters(model: nn.Module, alignment: int = 64) -> int:
    """Copy CPU parameters/buffers whose data is not ``alignment``-byte aligned (safetensors
    memory-maps tensors at arbitrary offsets) into fresh, aligned storage, and give every
    ``MoeExperts.down_proj`` (and column-major ``gate_up_proj``) its decode layout (a loaded
    checkpoint arrives contiguous). BLAS
    kernels may round differently depending on alignment and layout, so a model loaded from disk
    and the in-memory model it was saved from only compute bit-identical logits once both are
    realigned. Tied parameters stay tied (the Parameter objects are kept). Returns the number copied."""
    n = 0
    for mod in model.modules():
        if not isinstance(mod, MoeExperts):
            continue
        for p in (mod.down_proj, mod.gate_up_proj) if mod.column_major else (mod.down_proj,):
            if (relaid := _decode_layout(p.data)) is not p.data:
                p.data = relaid
                n += 1
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "cpu" and t.numel() and t.data_ptr() % alignment:
            t.data = t.data.clone()
            n += 1
    return n


# --------------------------------------------------------------------------- config + model


_SUB_CONFIGS = (
    {"base_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")} if SubConfigSpec else {}
)


class MoelabConfig(PretrainedConfig):
    """``base_config``: the dense model's config (dict or config, with its model_type);
    ``moe_layers``: one spec per decoder layer (see module docstring); ``moelab``: free-form
    provenance (converter version, method)."""

    model_type = "moelab"
    sub_configs_defaults = _SUB_CONFIGS

    base_config: Any = None
    moe_layers: list | None = None
    moelab: dict | None = None

    def __post_init__(self, **kwargs):
        if not SubConfigSpec and isinstance(self.base_config, dict):  # pragma: no cover
            self.base_config = AutoConfig.for_model(**self.base_config)
        super().__post_init__(**kwargs)
        if self.moe_layers is None:
            self.moe_layers = []
        self.moe_layers = [dict(e) if e else {"kind": "dense"} for e in self.moe_layers]

    def get_text_config(self, decoder=None, encoder=None):
        """Generation, caches and embeddings read the base model's text config."""
        return self.base_config if self.base_config is not None else self


def _base_causal_lm_class(base_config: PretrainedConfig) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(base_config)]
    except KeyError:
        raise ValueError(
            f"base model type {getattr(base_config, 'model_type', '?')!r} has no causal-LM class in "
            "this transformers version"
        ) from None


def _is_legacy_expert_conversion(conv: Any) -> bool:
    sources = getattr(conv, "_original_source_patterns", None) or getattr(conv, "source_patterns", [])
    return any(str(p).startswith(("experts_gate", "experts_up", "experts_down")) for p in sources)


class MoelabPreTrainedModel(PreTrainedModel):
    config_class = MoelabConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module):
        if isinstance(module, (MoeFFN, LowRankMoeFFN)):
            module.reset_parameters(getattr(self.config.get_text_config(), "initializer_range", 0.02))
        elif isinstance(module, MoeExperts):
            module.reset_parameters(getattr(self.config.get_text_config(), "initializer_range", 0.02))
        else:
            super()._init_weights(module)


_LEGACY_LOCK = threading.Lock()


@contextlib.contextmanager
def _legacy_expert_conversion(class_name: str):
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


class MoelabForCausalLM(MoelabPreTrainedModel, GenerationMixin):
    """``self.model`` is the base architecture's own causal LM (e.g. LlamaForCausalLM) whose
    MLPs are replaced per ``config.moe_layers``; ``forward`` returns its CausalLMOutput.
    Tied embeddings are the inner model's business: its ``_tied_weights_keys`` are collected
    under the ``model.`` prefix by ``post_init``, so save/load tie exactly as the base does."""

    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        base_cls = _base_causal_lm_class(config.base_config)
        self.model = base_cls(config.base_config)
        layers = decoder_layers(self.model)
        if len(config.moe_layers) > len(layers):
            raise ValueError(f"{len(config.moe_layers)} moe_layers for a model of {len(layers)} layers")
        convert_in_place(self.model, {i: build_layer_module(e) for i, e in enumerate(config.moe_layers)})
        self.post_init()

    # delegation ...............................................................
    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def set_output_embeddings(self, value):
        self.model.set_output_embeddings(value)

    def get_decoder(self):
        return self.model.get_decoder()

    def set_decoder(self, decoder):
        self.model.set_decoder(decoder)

    def moe_modules(self) -> dict[int, nn.Module]:
        """Layer index -> replaced MLP module (MoeFFN / AbsTopKGLU), or the HierarchicalExperts
        inside a sparse-MoE block."""
        out = {}
        for i, block in enumerate(decoder_layers(self.model)):
            mlp = getattr(block, "mlp", None)
            if isinstance(mlp, (MoeFFN, AbsTopKGLU, LowRankMoeFFN)):
                out[i] = mlp
            elif isinstance(getattr(mlp, "experts", None), HierarchicalExperts):
                out[i] = mlp.experts
        return out

    def set_recorder(self, recorder_factory: Callable[[int], Callable[[torch.Tensor], None]] | None) -> None:
        """Install ``recorder_factory(layer)`` as every MoE layer's recorder (None removes them)."""
        for i, mod in self.moe_modules().items():
            mod.recorder = None if recorder_factory is None else recorder_factory(i)

    def save_pretrained(self, *args, **kwargs):
        """Writes the runtime's own layout: ``save_original_format`` defaults to False, because
        reverting the base family's weight conversions (e.g. Mixtral's per-expert ``w1``/``w3``)
        would also split the stacked ``experts.gate_up_proj`` of moelab's own MoE layers."""
        kwargs.setdefault("save_original_format", False)
        return super().save_pretrained(*args, **kwargs)

    def set_experts_implementation(self, impl: str) -> None:
        """Experts kernel of every ``MoeFFN`` (hierarchical sub-MoEs included): one of
        ``EXPERTS_IMPLS`` (``loop`` is the reference, ``auto`` the default)."""
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f"unknown experts implementation {impl!r}; one of {EXPERTS_IMPLS}")
        for mod in self.modules():
            if isinstance(mod, MoeExperts):
                mod.experts_impl = impl

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        with _legacy_expert_conversion(cls.__name__):
            model = super().from_pretrained(*args, **kwargs)
        # saving writes the current layout, not the converted-from one
        used = getattr(model, "_weight_conversions", None)
        if used:
            model._weight_conversions = [c for c in used if not _is_legacy_expert_conversion(c)]
        realign_parameters(model)
        return model

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.model.prepare_inputs_for_generation(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ):
        if past_key_values is not None:  # transformers >= 5.2x calls it ``cache`` (passed in kwargs)
            kwargs["past_key_values"] = past_key_values
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


__all__ = [
    "AbsTopKGLU",
    "HierarchicalExperts",
    "LowRankMoeFFN",
    "MoeExperts",
    "MoeFFN",
    "MoelabConfig",
    "MoelabForCausalLM",
    "MoelabPreTrainedModel",
    "build_layer_module",
    "convert_in_place",
    "decoder_layers",
    "layer_spec",
    "realign_parameters",
]
