"""The fast kernels of moelab's routed experts, registered by name, and the one function that
chooses among them (``select_kernel``). Part of the exported runtime (torch only).

Every kernel computes what ``MoeExperts.reference`` (in ``moelab_moe.py``) computes: ``kernel(experts,
x [T, d], (gate_up_proj, down_proj), top_k_index [T, k], top_k_weights [T, k] | None, gate_act
[T, E·m] | None) -> [T, d]``, the sum over each token's selected experts, each scaled by its weight.
``experts`` is the ``MoeExperts`` module (sizes, activation); each weight is read once by the
caller and handed in, because under a LoRA parametrisation every read recomputes ``W + ΔW``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .moelab_triton import routed_decode as triton_routed_decode, usable as triton_usable

# "auto" on accelerators: up to this many (token, expert) pairs the gather path runs (one batched
# matmul, no host synchronisation); above it grouped_mm, whose torch fallback reads the group
# offsets on the host.
GATHER_MAX_PAIRS = 64

# "auto" on CPU: the gather path for one token when ``gate_up_proj`` is column-major (nothing is copied:
# 8B-shaped layer, 24 of 56 experts of 224 neurons, 7.5 ms against grouped_mm's 14 ms), and for up to
# GATHER_MAX_TOKENS tokens whose experts' gate/up blocks (the union, at most min(E, T·k) of them) take
# at most GATHER_MAX_BYTES, so that the blocks a token re-reads, or the gate-mass router copies, stay in
# cache: a decode step of small experts. torch 2.13's CPU grouped_mm walks every group with a host read
# and one GEMM call each, ~400 µs for a default-model layer (``gather_rows`` has the gather numbers).
# Past 8 tokens the union's extra multiply-adds lose to grouped_mm at 16 × 96; 8 tokens of 8B-shaped
# 64 × 224 experts take 51 ms gathered against 44 ms (tests/benchmarks/bench_moe_ffn.py).
GATHER_MAX_TOKENS = 8
GATHER_MAX_BYTES = 8 << 20

# CPU: activations (per pair: input and output rows of d_model, gate/up/product rows of m) processed
# per chunk of experts, about one core's L2 cache; "auto" runs all pairs at once (grouped_mm) when
# they fit, i.e. decode steps, and in chunks ("sorted") otherwise, i.e. prefill.
CHUNK_BYTES = 1 << 20

# "auto" on CPU, more than GATHER_MAX_TOKENS tokens: every expert on every token (``masked_dense``: the dense FFN's two
# GEMMs, unselected experts zeroed) once the selected share k/E reaches DENSE_SHARE + m / DENSE_NEURONS for experts
# of m neurons. Small experts make small GEMMs and move a d_model row in and out per (token, expert) pair: at a
# 512-token prefill of the default model's layer (2 threads), 128 experts of 12 neurons take 20 ms sorted against 17
# dense at k/E 0.25 and 26 against 17 at 0.4; 64 of 24 are level from 0.25 to 0.6; 32 of 48 cross near 0.6, and
# 16 of 96 stay sparse (``tests/benchmarks/bench_prefill_kernels.py``).
DENSE_SHARE = 0.1
DENSE_NEURONS = 100

#: Training (a gradient is needed) runs every expert masked when top_k ≥ E / GRAD_DENSE_RATIO
#: (``masked_dense``), per-expert segments otherwise (``segments``).
GRAD_DENSE_RATIO = 8

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def select_kernel(experts, x: torch.Tensor, top: torch.Tensor | None, needs_grad: bool,
                  weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                  gate_act: torch.Tensor | None = None) -> str:
    """The kernel a call runs: ``experts.experts_impl`` when it names one, else (``auto``) by this
    table, first matching row (``weights``: ``(gate_up_proj, down_proj)`` as the call read them;
    "grouped ok": torch has grouped_mm and the operands meet its dtype and 16-byte rules):

    ======================  ==========================================================  ============
    requested               when                                                        kernel
    ======================  ==========================================================  ============
    ``grouped_mm``          a gradient is needed, or grouped not ok                     sorted
    ``triton``              pairs > GATHER_MAX_PAIRS                                    as ``auto``
    ``triton``              a gradient is needed, or ``moelab_triton.usable`` says no   gather
    ``loop`` / ``sorted``   always                                                      as requested
    / ``gather`` /          (``grouped_mm`` otherwise)
    ``auto``, accelerator   pairs ≤ GATHER_MAX_PAIRS, no gradient, triton usable        triton
    ``auto``, accelerator   pairs ≤ GATHER_MAX_PAIRS                                    gather
    ``auto``, accelerator   no gradient and grouped ok                                  grouped_mm
    ``auto``, CPU           no gradient, T ≤ GATHER_MAX_TOKENS, and one token on        gather
                            column-major blocks or the selected blocks ≤
                            GATHER_MAX_BYTES
    ``auto``, CPU           no gradient, T > GATHER_MAX_TOKENS, k/E ≥ DENSE_SHARE +      dense
                            m/DENSE_NEURONS
    ``auto``, CPU           no gradient, grouped ok, every pair's activations ≤         grouped_mm
                            CHUNK_BYTES
    ``auto``                otherwise                                                   sorted
    ======================  ==========================================================  ============

    ``sorted`` under a gradient trains through ``masked_dense`` (top_k ≥ E / GRAD_DENSE_RATIO) or
    ``segments`` (``run_kernel``). On a CPU with a C compiler, ``MoeFFN`` runs ``auto``'s float32 calls without
    gradient on the native kernels (``moelab_native``) before this table is asked."""
    impl = experts.experts_impl
    if impl not in EXPERTS_IMPLS:
        raise ValueError(f"unknown experts_impl {impl!r}; one of {EXPERTS_IMPLS}")
    wgu, wd = weights if weights is not None else (experts.gate_up_proj, experts.down_proj)
    if impl == "grouped_mm" and (needs_grad or not grouped_ok(experts, x, wgu, wd)):
        return "sorted"
    pairs = top.numel() if top is not None else 0
    if impl == "triton":
        if pairs > GATHER_MAX_PAIRS:  # a GEMV per pair: decode steps only
            impl = "auto"
        elif needs_grad or not triton_usable(experts, x, gate_act):
            return "gather"
    if impl != "auto":
        return impl
    if x.device.type != "cpu":
        if pairs <= GATHER_MAX_PAIRS:
            return "triton" if not needs_grad and triton_usable(experts, x, gate_act) else "gather"
        return "grouped_mm" if not needs_grad and grouped_ok(experts, x, wgu, wd) else "sorted"
    block_bytes = 2 * experts.expert_size * experts.d_model * wgu.element_size()
    if not needs_grad and x.shape[0] <= GATHER_MAX_TOKENS and (
            (x.shape[0] == 1 and decode_layout_of(wgu))  # one token, column-major blocks: nothing is copied
            or min(experts.num_experts, pairs) * block_bytes <= GATHER_MAX_BYTES):
        return "gather"
    if not needs_grad and x.shape[0] > GATHER_MAX_TOKENS and top is not None and (
            top.shape[1] >= experts.num_experts * (DENSE_SHARE + experts.expert_size / DENSE_NEURONS)):
        return "dense"
    row_bytes = (2 * experts.d_model + 3 * experts.expert_size) * x.element_size()
    if not needs_grad and grouped_ok(experts, x, wgu, wd) and pairs * row_bytes <= CHUNK_BYTES:
        return "grouped_mm"  # a decode step: every pair's activations fit in cache at once
    return "sorted"


def run_kernel(name: str, experts, x, w, top, weights, gate_act, needs_grad: bool) -> torch.Tensor:
    """Run the fast kernel ``name`` (``select_kernel``'s answer, not ``loop``)."""
    if name == "sorted":
        if needs_grad:
            if top.shape[1] * GRAD_DENSE_RATIO >= experts.num_experts:
                return masked_dense(experts, x, w, top, weights, gate_act)
            return segments(experts, x, w, top, weights, gate_act)
        return sorted_chunks(experts, x, w, top, weights, gate_act, use_grouped=grouped_ok(experts, x, *w))
    return KERNELS[name](experts, x, w, top, weights, gate_act)


def grouped_ok(experts, x: torch.Tensor, wgu: torch.Tensor | None = None, wd: torch.Tensor | None = None) -> bool:
    """torch's grouped_mm takes float32/bf16/fp16 operands whose base pointers and non-unit
    strides are multiples of 16 bytes (checked by the kernel, which raises otherwise)."""
    wgu = experts.gate_up_proj if wgu is None else wgu
    wd = experts.down_proj if wd is None else wd
    if _GROUPED_MM is None or (experts.expert_size * x.element_size()) % 16:
        return False
    for t in (x, wgu, wd):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return True


def decode_layout_of(w: torch.Tensor) -> bool:
    """Whether ``w [E, a, b]`` has ``[E, b, a]`` storage (``MoeExperts``' decode layout)."""
    return w.dim() == 3 and w.stride()[1:] == (1, w.shape[1])


@torch.no_grad()
def decode_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[E, a, b]`` with ``[E, b, a]`` storage (``MoeExperts``); the same values."""
    if w.dim() != 3 or decode_layout_of(w) or w.device.type == "meta":
        return w
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@torch.no_grad()
def row_major_t(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` with ``[in, out]`` storage (the same values): row ``i`` of the storage holds input ``i``'s
    weights, so a kernel that skips zero inputs reads only the rows it needs."""
    if w.dim() != 2 or w.stride() == (1, w.shape[0]):  # on meta too: ``to_empty`` keeps the strides
        return w
    return w.t().contiguous().t()


@torch.no_grad()
def normal_in_storage_order(w: torch.Tensor, std: float) -> None:
    """``nn.init.normal_(w, 0, std)`` drawn through a view of ``w`` in its storage's order: on a tensor stored
    transposed (the decode layouts above) torch's ``normal_`` takes an element-wise path ten times slower (an
    8B-shaped layer's experts: 2.9 s against 0.31 s), and a kernel table builds a random layer per layout. Through
    ``nn.init`` still, which transformers patches while it loads weights; its guard reads the flag of a loaded
    weight (``_is_hf_initialized``) from the tensor it is given, so a flagged ``w`` goes to it as it is."""
    view = w.permute(sorted(range(w.dim()), key=lambda i: -w.stride(i)))
    flagged = getattr(w, "_is_hf_initialized", False)
    nn.init.normal_(view if view.is_contiguous() and not flagged else w, 0.0, std)


def per_expert(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``w[e]`` for every expert as views from one ``unbind``. When ``w`` needs a gradient (LoRA on
    the stacked experts), each ``w[e]`` taken separately back-propagates into a zero tensor of the
    whole stack, E of them a layer (64 × 7 MB at the default model's shape: 5 s a layer per step);
    ``unbind``'s backward stacks the E slices once."""
    return w.unbind(0)


def _selected(per_expert: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``per_expert [T, E, n]`` at each token's selected experts ``top [T, k]``: ``[T, k, n]``."""
    return per_expert.gather(1, top.unsqueeze(-1).expand(*top.shape, per_expert.shape[-1]))


def _block_rows(top: torch.Tensor, n: int) -> torch.Tensor:
    """Row indices ``[T, k, n]`` of each selected expert's block of ``n`` rows in a ``[E·n, ·]``
    view of a stacked weight (expert e holds rows ``e·n … e·n + n − 1``)."""
    return top.unsqueeze(-1) * n + torch.arange(n, device=top.device)


def keep_largest(g: torch.Tensor, n: int) -> torch.Tensor:
    """``g`` with all but the ``n`` entries of largest magnitude along its last dimension set to 0:
    the down projection's input inside an expert (``MoeFFN``'s ``down_keep``), whose zeros a kernel
    that reads only the kept rows of the down projection skips (``gather_rows``). A gradient flows
    through the kept entries.

    The mask is chosen without a gradient, by the ``n``-th largest magnitude, and multiplied in: its
    backward is one multiply. A ``topk`` of the entries scattered into zeros gave the same values,
    but fine-tuning through it (``masked_dense``: 1,024 tokens × 128 experts × 12 neurons a layer)
    spent 2.9x longer here, forward and backward (77 ms against 27 ms, 2 threads). Entries that tie
    at the threshold are all kept: float products tie with probability about 0."""
    m = g.shape[-1]
    if n >= m:
        return g
    with torch.no_grad():
        a = g.abs()
        keep = a >= a.kthvalue(m - n + 1, dim=-1, keepdim=True).values
    return g * keep


def glu(experts, h: torch.Tensor, keep: bool = True) -> torch.Tensor:
    """``act(gate) * up`` of gate/up rows ``h [..., 2m]``, each expert's largest ``down_keep`` kept
    (``keep_largest``; ``keep=False``: all of them). The gate half is made contiguous
    first: torch's CPU activations take a scalar path on a strided half (SiLU of 12,288 × 24
    numbers: 1.0 ms strided, 0.08 ms with the copy)."""
    m = experts.expert_size
    g = experts.act_fn(h[..., :m].contiguous()) * h[..., m:]
    return keep_largest(g, experts.down_keep) if keep else g


def gated(experts, gate_act: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``glu`` when the router already computed ``act(gate)``: ``gate_act * up``, largest kept."""
    return keep_largest(gate_act * up, experts.down_keep)


def expert_glu(experts, x, gate_act, gate_up, down):
    """One expert on its tokens: ``down (act(gate_up[:m] x) * gate_up[m:] x)``, the gate's
    activation taken from ``gate_act`` when the router already computed it."""
    m = experts.expert_size
    if gate_act is None:
        h = F.linear(x, gate_up)
        g = glu(experts, h)
    else:
        g = gated(experts, gate_act, F.linear(x, gate_up[m:]))
    return F.linear(g, down)


#: Tokens from which ``every_expert`` multiplies column-major gate/up blocks as one ``[d_model, E·2m]`` matrix (a copy,
#: 0.2 ms for the default model's layer) instead of E small GEMMs of one batched matmul: a 512-token prefill of 128
#: experts of 12 neurons takes 12.5 ms against 14.7 (the dense FFN's gate/up: 11.2 ms).
FLAT_MIN_TOKENS = 64


def _products(experts, x, wgu, gate_act):
    """``act(gate) * up`` of every expert's neurons for every token, ``[T, E, m]``, nothing kept yet."""
    E, m, d = experts.num_experts, experts.expert_size, experts.d_model
    T = x.shape[0]
    if gate_act is not None:  # the router computed the gates: the up rows only, E GEMMs of one batched matmul
        return gate_act.view(T, E, m) * torch.matmul(x, wgu[:, m:].transpose(1, 2)).transpose(0, 1)
    if decode_layout_of(wgu):  # stored [E, d, 2m]
        if T >= FLAT_MIN_TOKENS:
            h = F.linear(x, wgu.transpose(1, 2).permute(1, 0, 2).reshape(d, E * 2 * m).t()).view(T, E, 2 * m)
        else:  # E GEMMs of one batched matmul: no copy of the weights for a few tokens
            h = torch.matmul(x, wgu.transpose(1, 2)).transpose(0, 1)
    else:
        h = F.linear(x, wgu.reshape(E * 2 * m, d)).view(T, E, 2 * m)
    return glu(experts, h, keep=False)


def _down_all(experts, wd, g):
    """The down projection of ``g [T, E, m]`` (every expert's neurons, zeros where none ran) in one GEMM."""
    E, m, d = experts.num_experts, experts.expert_size, experts.d_model
    return F.linear(g.reshape(g.shape[0], E * m), wd.permute(1, 0, 2).reshape(d, E * m))


def every_expert(experts, x, w, weights, gate_act):
    """Every expert on every token: one GLU over the concatenated experts (the dense FFN the
    experts were sliced from, when they cover it), each expert's neurons scaled by its weight."""
    wgu, wd = w
    g = keep_largest(_products(experts, x, wgu, gate_act), experts.down_keep)
    if weights is not None:
        g = g * weights.unsqueeze(-1).to(g.dtype)
    return _down_all(experts, wd, g)


def masked_dense(experts, x, w, top, weights, gate_act):
    """CPU inference over many tokens of small experts (``select_kernel``), and the training path when a token
    selects at least ``1/GRAD_DENSE_RATIO`` of the experts: every expert on every token in two large GEMMs, the
    unselected ones zeroed. The same output and gradients as the selected experts alone (a zero passes no
    gradient), at E/k times the multiply-adds, but GEMMs of the whole layer instead of E small ones over k
    copies of the input: 0.76 s against 2.9 s forward + backward for 1,024 tokens at the
    default model's 64 × 24 experts, top-24, LoRA on the experts (CPU, a loaded machine). Only the selected
    (token, expert) pairs are gathered for ``down_keep``'s largest-kept choice (k/E of the work) and scattered back."""
    wgu, wd = w
    T, k = top.shape
    g = _products(experts, x, wgu, gate_act)
    idx = top.unsqueeze(-1).expand(T, k, g.shape[-1])
    sel = keep_largest(g.gather(1, idx), experts.down_keep)
    if weights is not None:
        sel = sel * weights.unsqueeze(-1).to(sel.dtype)
    return _down_all(experts, wd, torch.zeros_like(g).scatter(1, idx, sel))


def sort_pairs(experts, top):
    """(token, expert) pairs sorted by expert (stable: tokens ascending within an expert, the
    reference loop's order): expert ids, positions in ``top.reshape(-1)``, tokens, counts [E].
    On CPU from an expert × token mask (``nonzero`` lists it in that order; a token's experts
    are distinct): 12,288 pairs in 0.07 ms against a stable sort's 0.35 ms. Accelerators sort,
    which needs no host synchronisation."""
    T, k = top.shape
    flat = top.reshape(-1)
    if top.device.type != "cpu":  # bincount reads its maximum on the host, which a CUDA graph cannot capture
        counts = torch.zeros(experts.num_experts, dtype=torch.long, device=top.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        e_sorted, order = torch.sort(flat, stable=True)
        return e_sorted, order, torch.div(order, k, rounding_mode="floor"), counts
    counts = torch.bincount(flat, minlength=experts.num_experts)
    slot = torch.full((T, experts.num_experts), -1, dtype=torch.long).scatter_(1, top, torch.arange(k).expand(T, k))
    e_sorted, tok = (slot.t() >= 0).nonzero().unbind(1)
    return e_sorted, tok * k + slot[tok, e_sorted], tok, counts


def grouped(experts, x, w, top, weights, gate_act):
    """All pairs in two ``grouped_mm`` calls (one GEMM per non-empty expert inside the kernel):
    no host synchronisation, and a decode step reads only the selected experts' weights."""
    wgu, wd = w
    T = x.shape[0]
    E, m = experts.num_experts, experts.expert_size
    e_sorted, order, tok, counts = sort_pairs(experts, top)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x.index_select(0, tok)
    if gate_act is None:
        h = _GROUPED_MM(xs, wgu.transpose(1, 2), offs=offs)
        g = glu(experts, h)
    else:
        a = gate_act.view(T, E, m)[tok, e_sorted]
        g = gated(experts, a, _GROUPED_MM(xs, wgu[:, m:].transpose(1, 2), offs=offs))
    out = _GROUPED_MM(g.contiguous(), wd.transpose(1, 2), offs=offs)
    if weights is not None:
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return x.new_zeros(T, experts.d_model).index_add_(0, tok, out.to(x.dtype))


def sorted_chunks(experts, x, w, top, weights, gate_act, use_grouped: bool):
    """Pairs sorted by expert, processed in chunks of whole experts whose activations (inputs,
    gate/up, outputs) fit in about ``CHUNK_BYTES``: gathered, multiplied and scatter-added while
    they are still in cache (a single pass over all pairs moves ``T*k`` rows of ``d_model``
    through memory several times: with 24-neuron experts that costs more than the arithmetic).
    Within a chunk: one grouped_mm pair, or one GEMM chain per expert (``use_grouped=False``).
    Inference only: ``run_kernel`` trains through ``masked_dense`` or ``segments``. One host read
    of the expert counts per layer."""
    wgu, wd = w
    T = x.shape[0]
    E, m, d = experts.num_experts, experts.expert_size, experts.d_model
    e_sorted, order, tok, counts = sort_pairs(experts, top)
    sizes = counts.tolist()  # the one host read of this path
    w_sorted = weights.reshape(-1).index_select(0, order) if weights is not None else None
    row_bytes = (2 * d + 3 * m) * x.element_size()
    gu, dn = (None, None) if use_grouped else (per_expert(wgu), per_expert(wd))
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
            if use_grouped:
                offs = torch.tensor(list(itertools.accumulate(sizes[e0:e1])), dtype=torch.int32, device=x.device)
                if a is None:
                    h = _GROUPED_MM(xs, wgu[e0:e1].transpose(1, 2), offs=offs)
                    g = glu(experts, h)
                else:
                    g = gated(experts, a, _GROUPED_MM(xs, wgu[e0:e1, m:].transpose(1, 2), offs=offs))
                out = _GROUPED_MM(g.contiguous(), wd[e0:e1].transpose(1, 2), offs=offs)
            else:
                outs, s = [], 0
                for e in range(e0, e1):
                    c = sizes[e]
                    if c == 0:
                        continue
                    outs.append(expert_glu(experts, xs[s : s + c], None if a is None else a[s : s + c], gu[e], dn[e]))
                    s += c
                out = torch.cat(outs) if len(outs) > 1 else outs[0]
            if w_sorted is not None:
                out = out * w_sorted[r0:r1].unsqueeze(-1).to(out.dtype)
            y.index_add_(0, te, out.to(x.dtype))
            r0 = r1
        e0 = e1
    return y


def segments(experts, x, w, top, weights, gate_act):
    """Training path (a gradient is needed; torch 2.13 has no CPU backward for grouped_mm):
    pairs sorted by expert, gathered once, split into one segment per expert, one GEMM chain
    each, scattered back once. Every gather, slice and scatter is done once per layer, not
    once per expert or chunk: the backward of each ``index_select`` of the input is a scatter
    into a zero tensor of the whole input, and of each weight slice a zero tensor of the
    whole stack."""
    wgu, wd = w
    T = x.shape[0]
    E, m = experts.num_experts, experts.expert_size
    e_sorted, order, tok, counts = sort_pairs(experts, top)
    sizes = counts.tolist()  # the one host read of this path
    xs = x.index_select(0, tok).split(sizes)
    a = gate_act.view(T, E, m)[tok, e_sorted].split(sizes) if gate_act is not None else None
    gu, dn = per_expert(wgu), per_expert(wd)
    out = torch.cat([expert_glu(experts, xs[e], None if a is None else a[e], gu[e], dn[e])
                     for e in range(E) if sizes[e]])
    if weights is not None:
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return x.new_zeros(T, experts.d_model).index_add(0, tok, out.to(x.dtype))


def gather(experts, x, w, top, weights, gate_act):
    """Decode path: only the selected experts' weights are read (``gather_rows`` on CPU,
    ``gather_pairs`` on accelerators)."""
    if x.device.type == "cpu":
        return gather_rows(experts, x, w, top, weights, gate_act)
    return gather_pairs(experts, x, w, top, weights, gate_act)


def gather_rows(experts, x, w, top, weights, gate_act):
    """CPU decode, reading only the selected experts' weights and copying none of them.
    Gate/up: with column-major ``gate_up_proj`` (``[E, d_model, 2m]`` storage) one
    ``embedding_bag`` per (token, expert) pair, the weighted sum of the expert's ``d_model``
    rows of 2m numbers with the token's inputs as weights; otherwise (gate-mass router) the
    selected blocks (for several tokens their union, ``unique``; ``resolve_impl`` keeps the
    extra multiply-adds small) gathered with ``index_select`` into one GEMM. Down: an
    ``embedding_bag`` over the selected neurons' rows of ``down_proj``'s ``[E·m, d_model]``
    storage, each row weighted by its neuron's activation (times the routing weight); under
    ``down_keep`` only the kept neurons' rows, so the down projection reads and multiplies that share.
    Default model's layer, one token, 24 of 56 experts of 24 neurons, 2 threads: grouped_mm
    410 µs, index_select + GEMM + embedding_bag ~180 µs, of which gate/up 162 µs, 77 µs as
    an embedding_bag. (On an H100 a one-bag embedding_bag runs on few blocks: 8B-shaped layer,
    one token, 0.11× dense against ``gather_pairs``' 0.52×.)"""
    wgu, wd = w
    T, k = top.shape
    E, m, d = experts.num_experts, experts.expert_size, experts.d_model
    n = min(experts.down_keep, m)
    if gate_act is None and decode_layout_of(wgu):  # column-major blocks: one bag per (token, expert)
        rows = _block_rows(top, d).view(T * k, d)
        inputs = x.unsqueeze(1).expand(T, k, d).reshape(T * k, d).to(wgu.dtype)
        h = F.embedding_bag(rows, wgu.transpose(1, 2).reshape(E * d, 2 * m), per_sample_weights=inputs,
                            mode="sum").view(T, k, 2 * m).to(x.dtype)
    else:
        blocks = wgu if gate_act is None else wgu[:, m:]  # gate and up rows, or up rows only
        used, inv = (top.reshape(-1), None) if T == 1 else torch.unique(top, return_inverse=True)
        h = F.linear(x, blocks.index_select(0, used).reshape(-1, d)).view(T, -1, blocks.shape[1])
        if inv is not None:
            h = _selected(h, inv)
    g = glu(experts, h, keep=False) if gate_act is None else _selected(gate_act.view(T, E, m), top) * h
    rows = _block_rows(top, m)
    if n < m:  # only the kept neurons' rows of the down projection are read
        idx = g.abs().topk(n, dim=-1, sorted=False).indices
        g, rows = g.gather(-1, idx), rows.gather(-1, idx)
    if weights is not None:
        g = g * weights.unsqueeze(-1).to(g.dtype)
    down_rows = wd.transpose(1, 2).reshape(E * m, d)  # a view in the decode layout
    out = F.embedding_bag(rows.view(T, k * n), down_rows, per_sample_weights=g.reshape(T, k * n).to(down_rows.dtype),
                          mode="sum")
    return out.to(x.dtype)


def gather_pairs(experts, x, w, top, weights, gate_act):
    """Accelerator decode: each (token, expert) pair multiplies by its own expert's weights,
    gathered with ``index_select`` in their storage order (a plain copy of each block, no
    transposition), in two batched matmuls: no host synchronisation."""
    wgu, wd = w
    T, k = top.shape
    E, m, d = experts.num_experts, experts.expert_size, experts.d_model
    flat = top.reshape(-1)
    blocks = wgu if gate_act is None else wgu[:, m:]
    xs = x.unsqueeze(1).expand(T, k, d).reshape(T * k, 1, d)
    if decode_layout_of(wgu):  # stored [E, d, n]: x [1, d] @ block [d, n]
        h = torch.bmm(xs, blocks.transpose(1, 2).index_select(0, flat)).squeeze(1)
    else:  # stored [E, n, d]
        h = torch.bmm(blocks.index_select(0, flat), xs.transpose(1, 2)).squeeze(-1)
    if gate_act is None:
        g = glu(experts, h)
    else:
        g = gated(experts, _selected(gate_act.view(T, E, m), top).reshape(T * k, m), h)
    if decode_layout_of(wd):  # stored [E, m, d]: g [1, m] @ block [m, d]
        out = torch.bmm(g.unsqueeze(1), wd.transpose(1, 2).index_select(0, flat)).view(T, k, d)
    else:
        out = torch.bmm(wd.index_select(0, flat), g.unsqueeze(-1)).view(T, k, d)
    if weights is not None:
        out = out * weights.unsqueeze(-1).to(out.dtype)
    return out.sum(dim=1)


def triton_decode(experts, x, w, top, weights, gate_act):
    """Accelerator decode in two Triton kernels reading only the selected experts' weights, in place
    (``moelab_triton``; ``select_kernel`` runs it where ``moelab_triton.usable``)."""
    return triton_routed_decode(experts, x, w, top, weights)


#: the kernels ``MoeExperts.experts_impl`` can name besides the reference ``loop`` and ``auto``
KERNELS = {"grouped_mm": grouped, "sorted": sorted_chunks, "gather": gather, "dense": masked_dense,
           "triton": triton_decode}
EXPERTS_IMPLS = ("auto", "loop", *KERNELS)
