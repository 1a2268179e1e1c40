"""GPU decode of the routed experts in two Triton kernels that read only the selected experts' weights, in place.

At a decode step a GPU is bound by the bytes it reads, and the torch paths read more than the experts they run:
``gather_pairs`` copies each selected block with ``index_select`` before its batched matmul (every selected byte read
twice and written once), and ``grouped_mm`` tiles each one-token group as a whole GEMM. Here each (token, expert)
pair is a GEMV straight from the stacked weights:

- ``gate_up``: ``h[p] = x[token(p)] · gate_up_proj[e(p)]`` for every pair ``p``, fp32, split over ``d_model`` so that a
  few pairs still spread over every multiprocessor (partial sums added atomically);
- ``down``: ``out[token(p)] += w(p) · down_proj[e(p)] (act(h[p, :m]) * h[p, m:])``, the GLU computed as the rows of
  the down projection are read, split over the expert's neurons, added atomically into an fp32 ``[T, d_model]``.

No host synchronisation and shapes fixed by ``(T, k)``: a decode step with these kernels can be captured in a CUDA
graph (``evaluation.speed``). Weights in any strides (``MoeExperts``' decode layout ``[E, d, 2m]`` / ``[E, m, d]``
storage reads them row by row, contiguously); any float dtype, accumulated in fp32, so the result differs from the
reference's bf16 matmuls by rounding only. Choices: the SiLU and GELU-tanh activations (the default models' and
Gemma's) and no ``down_keep`` row choice (a GPU GEMV gains nothing from skipping scattered rows); other calls take
the torch kernels (``usable``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace

import torch

#: activations the kernels compute (``MoeFFN.act`` names)
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}
#: programs launched per kernel, about: enough to keep every multiprocessor of a large GPU streaming weights
TARGET_PROGRAMS = 1024
BLOCK_N = 64  # output columns of gate_up per program
BLOCK_D = 128  # output columns of down per program
BLOCK_K = 128  # inputs per iteration (bench_triton_decode: 128 beat 32 and 64 on an H200 at the 8B shape)
NUM_WARPS = 4


@functools.cache
def available() -> bool:
    """Whether triton is installed (an optional dependency: torch's CUDA wheels bring it; the suite's extra installs
    it for ``TRITON_INTERPRET``)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors: how the suite tests them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(experts, x: torch.Tensor, gate_act: torch.Tensor | None) -> bool:
    """Whether ``routed_decode`` computes this call: triton present, a CUDA tensor (or the interpreter), no gradient
    needed (the caller checks), an activation of ``ACTS``, every neuron's down row used, the router's gate
    activations not handed in (gate-mass)."""
    if gate_act is not None or experts.down_keep < experts.expert_size or getattr(experts, "act_name", None) not in ACTS:
        return False
    return (x.device.type == "cuda" or (interpreted() and x.device.type == "cpu")) and available()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(work_items: int, blocks: int, length: int, block: int) -> tuple[int, int]:
    """(splits, elements per split) of a reduction of ``length``: about ``TARGET_PROGRAMS`` programs in all over
    ``work_items × blocks`` output tiles, each split a multiple of ``block``."""
    steps = _cdiv(length, block)
    splits = max(1, min(steps, TARGET_PROGRAMS // max(1, work_items * blocks)))
    per = _cdiv(steps, splits) * block
    return _cdiv(length, per), per


@functools.cache
def _kernels() -> SimpleNamespace:
    """The jitted kernels, built on first use: importing triton costs 0.3 s, which a CPU run need not pay."""
    try:  # inside try: transformers' check of a remote-code file's imports passes over it where triton is absent
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - usable() asks available() first
        raise RuntimeError("moelab's GPU decode kernels need triton (pip install triton)") from exc

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, top_ptr, h_ptr, D, N, K_SEL, PER_K,
                        s_we, s_wk, s_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(2) * PER_K
        token = p // K_SEL
        e = tl.load(top_ptr + p).to(tl.int64)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kk in range(k0, k0 + PER_K, BLOCK_K):
            offs_k = kk + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + token * D + offs_k, mask=offs_k < D, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e * s_we + offs_k[:, None] * s_wk + offs_n[None, :] * s_wn,
                         mask=(offs_k[:, None] < D) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
            acc += tl.sum(xv[:, None] * wv, axis=0)
        tl.atomic_add(h_ptr + p * N + offs_n, acc, mask=offs_n < N)

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, top_ptr, weight_ptr, out_ptr, M, D, K_SEL, PER_M,
                     s_we, s_wm, s_wd, HAS_WEIGHTS: tl.constexpr, ACT: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m0 = tl.program_id(2) * PER_M
        token = p // K_SEL
        e = tl.load(top_ptr + p).to(tl.int64)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for mm in range(m0, m0 + PER_M, BLOCK_K):
            offs_m = mm + tl.arange(0, BLOCK_K)
            live = offs_m < M
            gate = tl.load(h_ptr + p * 2 * M + offs_m, mask=live, other=0.0)
            up = tl.load(h_ptr + p * 2 * M + M + offs_m, mask=live, other=0.0)
            if ACT == 0:
                a = gate * tl.sigmoid(gate)
            else:  # GELU, tanh approximation: 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³)))
                inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
                a = gate * (1.0 - 1.0 / (tl.exp(2.0 * inner) + 1.0))
            g = a * up
            wv = tl.load(w_ptr + e * s_we + offs_m[:, None] * s_wm + offs_d[None, :] * s_wd,
                         mask=live[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            acc += tl.sum(g[:, None] * wv, axis=0)
        if HAS_WEIGHTS:
            acc = acc * tl.load(weight_ptr + p).to(tl.float32)
        tl.atomic_add(out_ptr + token * D + offs_d, acc, mask=offs_d < D)

    return SimpleNamespace(gate_up=_gate_up_kernel, down=_down_kernel)


def routed_decode(experts, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], top: torch.Tensor,
                  weights: torch.Tensor | None) -> torch.Tensor:
    """The sum over each token's selected experts ``top [T, k]`` (each scaled by ``weights [T, k]``, None: 1), as
    ``MoeExperts.reference`` computes it (``usable`` says when). ``w``: ``(gate_up_proj [E, 2m, d],
    down_proj [E, d, m])`` in any strides."""
    wgu, wd = w
    T, k = top.shape
    m, d = experts.expert_size, experts.d_model
    pairs = T * k
    x = x.contiguous()
    top_flat = top.reshape(-1).contiguous()
    kernels = _kernels()
    h = torch.zeros(pairs, 2 * m, dtype=torch.float32, device=x.device)
    n_blocks = _cdiv(2 * m, BLOCK_N)
    splits, per = _split(pairs, n_blocks, d, BLOCK_K)
    kernels.gate_up[(pairs, n_blocks, splits)](x, wgu, top_flat, h, d, 2 * m, k, per,
                                               wgu.stride(0), wgu.stride(2), wgu.stride(1),
                                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    out = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    d_blocks = _cdiv(d, BLOCK_D)
    splits, per = _split(pairs, d_blocks, m, BLOCK_K)
    scale = weights.reshape(-1).contiguous() if weights is not None else top_flat
    kernels.down[(pairs, d_blocks, splits)](h, wd, top_flat, scale, out, m, d, k, per,
                                            wd.stride(0), wd.stride(2), wd.stride(1),
                                            HAS_WEIGHTS=weights is not None, ACT=ACTS[experts.act_name],
                                            BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out.to(x.dtype)
