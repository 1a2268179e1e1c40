"""Native CPU kernels for the routed experts: one call per layer and forward instead of some twenty torch
operations at a decode step, and sparse products that beat the dense FFN's GEMMs at prefill. Part of the exported
runtime; it needs only a C compiler at run time, and without one (or on anything but float32 on the CPU) the torch
kernels run as before.

Why, at a decode step: 128 twelve-neuron experts read little memory per layer (the selected blocks), so the fixed
cost of each torch call (dispatch, a tensor allocated per intermediate, a Python frame) is a large share of it: on
the default model's ``--recipe best`` conversion the MoE layers' operators other than the products took about as
long as the products of the routed experts themselves. At prefill: torch has no sparse product that pays for such
small experts (``sorted`` moves a d_model row in and out per pair for a 24-wide GEMM), so every expert ran masked,
the dense FFN's cost plus the routing. ``moe_routed`` does, for every token and selected expert of a call, what
``moelab_kernels.gather_rows`` does, with the skipped-expert compensation folded in:

    h = x · W_gu[e]  (the expert's [d_model, 2m] block, rows read in storage order)
    g = act(h[:m]) · h[m:], the ``keep`` entries of largest |g| kept (``MoeFFN``'s down_keep)
    out += weight · Σ_kept g_r · W_down[e, r]  (+ Σ_{e not selected} μ_e under compensation)

Up to ``DECODE_TOKENS`` tokens (``moelab_moe_decode``) the pairs are grouped by expert and the selected experts
shared among the threads, so a block that several tokens of a batch selected is read from memory once; each
thread sums into its own accumulator and they are added in thread order. More tokens (``moelab_moe_prefill``) are
shared among the threads by range, and each thread walks every expert's pairs of its tokens four at a time (eight
under AVX-512 where the widths are multiples of 24): four tokens × 24 columns of a product stay in registers, so each
weight is loaded once per four tokens (as a GEMM's micro-kernel does; 1.2-2× the dense FFN's speed at the shares plans
use, ``bench_prefill_kernels.py``). Either way the same inputs give the same bits.

At a decode step a block whose router is linear (centroid, softmax, ridge) runs whole in ``moe_ffn_decode``
(``moelab_moe_ffn_decode``): the shared expert's gate and up rows and the router's rows shared among the threads,
then one thread keeps the shared expert's largest products and ranks the experts, then the threads share one slice
each of the shared down projection (its kept neurons' rows, from ``[d_shared, d]`` storage) and the selected experts.
One parallel region with two barriers where the torch path made some ten calls, each a fork of the thread pool or
a Python frame: the 30 FFNs of a ``--recipe best`` conversion at 0.5 took 9.3 ms a token against 15.0 ms (dense
MLPs 26-30 ms) on a 2-vCPU AMD EPYC, and the whole model 1.46x dense against 1.28x (``bench_recipe_speed --unfused``).

TEAL's layers (``moelab_teal.TealGLU``) run a decode step in one call too (``teal_decode``): each product reads
only the weight rows some token of the step (up to eight) has a nonzero input for, each row once for them all. The
projections outside the FFN (``moelab_linear``) run a decode step in ``linear_decode``, and a Llama-style decoder
layer's attention half (``moelab_layer``) in two calls: ``attention_in`` (RMSNorm, q/k/v, rotary embedding) and
``attention_out`` (attention over the KV cache, output projection, residual add, RMSNorm).

The source is compiled once per machine and source text (``-O3 -march=native -fopenmp``) into the user's
cache (``MOELAB_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/moelab/kernels`` or ``~/.cache/moelab/kernels``),
written atomically, and loaded with ctypes. It links the OpenMP runtime torch itself loaded
(``libgomp.so.1``), so one thread pool serves both. ``MOELAB_NATIVE_KERNELS=0`` turns it off.

Choices: ties at the ``keep``-th largest |g| keep the lower neuron index (torch's topk may keep
either: float products tie with probability about 0); SiLU's exponential is a polynomial (Cephes' expf, about
1e-7 relative) so that it vectorises; sums run in a different order than torch's, so results agree to float32
rounding (``tests/engine/test_native_kernel.py`` checks 1e-5 relative).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

#: activation name (transformers' ACT2FN keys) -> the kernel's code
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2, "gelu_fast": 2, "relu": 3}

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32), aligned(4)));  /* unaligned 8-float vectors */
typedef int32_t v8i __attribute__((vector_size(32)));

/* e^x, branch-free so that loops over it vectorise: x = n ln2 + r, e^r by Cephes' expf polynomial (relative error
   about 1e-7 over float's range; below -87.3 it flushes towards 0, above 88.7 saturates) */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3333519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

static inline float act_fn(float v, int act) {
    switch (act) {
    case 0: return v / (1.0f + exp_approx(-v));
    case 1: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case 2: return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    default: return v > 0.0f ? v : 0.0f;
    }
}

/* the bits of the keep-th largest of n non-negative floats, given as their bits (which order as the floats do):
   built from the top bit down, each bit kept when at least keep entries reach the value so far; every pass is a
   count that vectorises, where a quickselect branches unpredictably on every entry */
static int32_t kth_largest_bits(const int32_t *bits, int64_t n, int64_t keep) {
    int32_t thr = 0;
    for (int b = 30; b >= 0; b--) {
        const int32_t cand = thr | (int32_t)(1u << b);
        int32_t count = 0;
        for (int32_t r = 0; r < (int32_t)n; r++) count += bits[r] >= cand;
        if (count >= keep) thr = cand;
    }
    return thr;
}

/* kept_products' ranks, a vector of them at a time: the 12-neuron experts of --recipe best rank in one 16-float
   vector where AVX-512 has it */
#if defined(__AVX512F__)
#define RANK_LANES 16
#define LANE_INDEX ((vri){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
#else
#define RANK_LANES 8
#define LANE_INDEX ((vri){0, 1, 2, 3, 4, 5, 6, 7})
#endif
typedef float vr __attribute__((vector_size(4 * RANK_LANES), aligned(4)));
typedef int32_t vri __attribute__((vector_size(4 * RANK_LANES)));

/* g = act(h[:m]) * h[m:] into h[:m], all but its keep entries of largest |g| set to 0 (ties: the lower index
   keeps), each kept one times scale. Small experts rank each entry against the others (m² comparisons that
   vectorise, no branches); larger ones find the threshold bit by bit (kth_largest_bits). */
static void kept_products(float *h, float *mag, int64_t m, int64_t keep, int act, float scale) {
    if (act == 0)
        for (int64_t r = 0; r < m; r++) h[r] = h[r] / (1.0f + exp_approx(-h[r])) * h[m + r];
    else
        for (int64_t r = 0; r < m; r++) h[r] = act_fn(h[r], act) * h[m + r];
    if (keep >= m) {
        for (int64_t r = 0; r < m; r++) h[r] *= scale;
        return;
    }
    if (m <= 32) {  /* entry r's rank: the entries larger, or as large at a lower index; RANK_LANES ranks at a time */
        for (int64_t r = 0; r < m; r++) mag[r] = fabsf(h[r]);
        for (int64_t r0 = 0; r0 < m; r0 += RANK_LANES) {
            const int64_t n = m - r0 < RANK_LANES ? m - r0 : RANK_LANES;
#if defined(__AVX512F__)
            /* masked loads and stores: a memcpy of n floats (12 of 16 lanes for --recipe best) went through the stack
               a float at a time, and the masked ones made the routed prefill call 1-4% faster (96 or 98 experts of
               12, top-37 or top-63, 512 tokens, a Zen 4 EPYC; the same bits) */
            const __mmask16 lanes = (__mmask16)((1u << n) - 1);
            vr mv = (vr)_mm512_maskz_loadu_ps(lanes, mag + r0), hv;
#else
            vr mv = {0}, hv = {0};
            memcpy(&mv, mag + r0, sizeof(float) * n);
#endif
            vri rv = LANE_INDEX + (int32_t)r0, rank = {0};
            for (int64_t s = 0; s < m; s++) {
                const vr a = (vr){0} + mag[s];
                rank -= (a > mv) | ((a == mv) & ((vri){0} + (int32_t)s < rv));
            }
            /* a select, not a branch per entry: a kept entry is as likely as not, and the mispredicted branches
               took some 1 ms of a 6 ms prefill layer (98 twelve-neuron experts, top-36, half kept, 512 tokens) */
#if defined(__AVX512F__)
            hv = (vr)_mm512_maskz_loadu_ps(lanes, h + r0);
            hv = (vr)((vri)(hv * scale) & (rank < (int32_t)keep));
            _mm512_mask_storeu_ps(h + r0, lanes, (__m512)hv);
#else
            memcpy(&hv, h + r0, sizeof(float) * n);
            hv = (vr)((vri)(hv * scale) & (rank < (int32_t)keep));
            memcpy(h + r0, &hv, sizeof(float) * n);
#endif
        }
        return;
    }
    int32_t *bits = (int32_t *)mag;  /* |g| as bits (mag is allocated memory: it takes the type stored into it) */
    for (int64_t r = 0; r < m; r++) { const float a = fabsf(h[r]); memcpy(bits + r, &a, sizeof(a)); }
    const int32_t thr = kth_largest_bits(bits, m, keep);
    int64_t above = 0;
    for (int64_t r = 0; r < m; r++) above += bits[r] > thr;
    /* the ties beyond the first keep - above (in index order) marked dropped, then one select that vectorises: a
       branch per entry, kept or not as likely as not, took 0.6 ms of a prefill layer's 3.4 ms shared expert (396
       neurons, half kept, 512 tokens) */
    int64_t ties = keep - above;
    for (int64_t r = 0; r < m; r++)
        if (bits[r] == thr && ties-- <= 0) bits[r] = -1;
    for (int64_t r = 0; r < m; r++) h[r] = bits[r] >= thr ? h[r] * scale : 0.0f;
}

/* ---- an expert's pairs, TB tokens at a time: its products as a GEMM micro-kernel computes them ---- */
#define TB 4
/* an empty asm that "changes" vectors: they are then loaded once into registers, where the compiler would
   otherwise fold the same load into each of the TB multiply-adds that read it (TB loads, not one). "v" names all 32
   of AVX-512's registers, "x" the first 16. No pin where an 8-float vector takes two registers (NEON's and SSE's hold
   4 floats): there the constraint is impossible, and "+w" failed the whole build on aarch64 (the torch kernels ran) */
#if defined(__x86_64__) && defined(__AVX512F__)
#define PIN_ "+v"
#elif defined(__x86_64__) && defined(__AVX__)
#define PIN_ "+x"
#endif
#ifdef PIN_
#define IN_REGISTERS1(a) __asm__("" : PIN_(a))
#define IN_REGISTERS2(a, b) __asm__("" : PIN_(a), PIN_(b))
#define IN_REGISTERS3(a, b, c) __asm__("" : PIN_(a), PIN_(b), PIN_(c))
#define IN_REGISTERS4(a, b, c, e) __asm__("" : PIN_(a), PIN_(b), PIN_(c), PIN_(e))
#else
#define IN_REGISTERS1(a) ((void)0)
#define IN_REGISTERS2(a, b) ((void)0)
#define IN_REGISTERS3(a, b, c) ((void)0)
#define IN_REGISTERS4(a, b, c, e) ((void)0)
#endif

/* Software prefetch, PREFETCH_AHEAD bytes ahead of what a loop reads. A decode step reads each selected expert's
   weights once, from memory: a 12-neuron expert's gate and up block is 55 KB, fourteen 4 KB pages, and the hardware
   prefetchers stop at every page's end (the dense FFN's GEMV reads megabytes in order). Issued here, the reads
   overlap. The default model's --recipe best conversion at 0.5, whole model, 2 threads, a 2-vCPU Xeon with a 480 MiB
   L3, each model's turn after a 1 GiB sweep of the caches and two untimed steps: decode batch 1 1.10x dense became
   1.13x, batch 8 1.02x became 1.05x, prefill unchanged. */
#define PREFETCH_AHEAD 6144
#define PREFETCH(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD)

/* the first 4 KB (at most n floats) of the block at w: the next expert's, while this one is computed */
static inline void prefetch_start(const float *w, int64_t n) {
    for (int64_t b = 0; b < 1024 && b < n; b += 16) __builtin_prefetch(w + b);
}

/* 24 columns of TB tokens' products (gate_up_24: or of the one token x0 when one), the micro-kernels of
   gate_up_block and down_block. gate_up_24: o_q[0..24) = x_q · W[:, 0..24) (rows m2 apart); down_24: o_q[0..24) +=
   Σ_j h_q[r_j] · Wd[r_j, 0..24) over the n rows r_j (rows ld apart). With AVX-512 the 24 columns are one 16- and
   one 8-float vector, two multiply-adds a row and token where 8-float vectors take three (and 32 registers hold
   them): the kernels' products took about twice as long as the dense FFN's GEMMs per multiply-add on a Xeon whose
   BLAS uses 16-float vectors. Each column's sum runs in the same order either way, so the bits are the same. */
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define V24_ZERO(a) v16 a##l = {0}; v8 a##h = {0}
#define V24_LOAD(a, p) v16 a##l = *(const v16 *)(p); v8 a##h = *(const v8 *)((p) + 16)
#define V24_STORE(p, a) (*(v16 *)(p) = a##l, *(v8 *)((p) + 16) = a##h)
#define V24_FMA(a, s, w) (a##l += s##l * w##l, a##h += s##h * w##h)
#define V24_PIN(w) IN_REGISTERS2(w##l, w##h)
/* a number in every lane, broadcast once into a register: folded into each multiply-add instead, it was loaded twice
   (once per vector width) */
#define V24_SCALAR(s, b) const float s##_ = (b); \
    v16 s##l = {s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_, s##_}; \
    IN_REGISTERS1(s##l); v8 s##h; memcpy(&s##h, &s##l, sizeof(v8))
#else
#define V24_ZERO(a) v8 a##0 = {0}, a##1 = {0}, a##2 = {0}
#define V24_LOAD(a, p) v8 a##0 = *(const v8 *)(p), a##1 = *(const v8 *)((p) + 8), a##2 = *(const v8 *)((p) + 16)
#define V24_STORE(p, a) (*(v8 *)(p) = a##0, *(v8 *)((p) + 8) = a##1, *(v8 *)((p) + 16) = a##2)
#define V24_FMA(a, s, w) (a##0 += (s) * w##0, a##1 += (s) * w##1, a##2 += (s) * w##2)
#define V24_PIN(w) IN_REGISTERS3(w##0, w##1, w##2)
#define V24_SCALAR(s, b) const float s = (b)
#endif

static inline void gate_up_24(const float *W, int64_t d, int64_t m2, const float *x0, const float *x1,
                              const float *x2, const float *x3, int one, float *o0, float *o1, float *o2, float *o3) {
    V24_ZERO(a0); V24_ZERO(a1); V24_ZERO(a2); V24_ZERO(a3);
    if (one) {
        for (int64_t i = 0; i < d; i++) {
            PREFETCH(W + i * m2);
            V24_LOAD(w, W + i * m2);
            V24_SCALAR(b0, x0[i]);
            V24_FMA(a0, b0, w);
        }
        V24_STORE(o0, a0);
        return;
    }
    for (int64_t i = 0; i < d; i++) {
        PREFETCH(W + i * m2);
        V24_LOAD(w, W + i * m2);
        V24_PIN(w);
        V24_SCALAR(b0, x0[i]); V24_SCALAR(b1, x1[i]); V24_SCALAR(b2, x2[i]); V24_SCALAR(b3, x3[i]);
        V24_FMA(a0, b0, w); V24_FMA(a1, b1, w); V24_FMA(a2, b2, w); V24_FMA(a3, b3, w);
    }
    V24_STORE(o0, a0); V24_STORE(o1, a1); V24_STORE(o2, a2); V24_STORE(o3, a3);
}

static inline void down_24(const float *Wd, int64_t ld, const int64_t *rows, int64_t n, const float *h0,
                           const float *h1, const float *h2, const float *h3, float *o0, float *o1, float *o2,
                           float *o3) {
    V24_LOAD(a0, o0); V24_LOAD(a1, o1); V24_LOAD(a2, o2); V24_LOAD(a3, o3);
    for (int64_t j = 0; j < n; j++) {
        const int64_t r = rows[j];
        __builtin_prefetch(Wd + r * ld + 48);  /* this row's next columns: rows_columns walks them after these */
        V24_LOAD(w, Wd + r * ld);
        V24_PIN(w);
        V24_SCALAR(c0, h0[r]); V24_SCALAR(c1, h1[r]); V24_SCALAR(c2, h2[r]); V24_SCALAR(c3, h3[r]);
        V24_FMA(a0, c0, w); V24_FMA(a1, c1, w); V24_FMA(a2, c2, w); V24_FMA(a3, c3, w);
    }
    V24_STORE(o0, a0); V24_STORE(o1, a1); V24_STORE(o2, a2); V24_STORE(o3, a3);
}

/* h[q][0..m2) = x_q · W (W [d, m2]) for the TB token rows xs, or for the one row xs[0] when one: TB tokens × 24
   columns held in registers, so each weight row is loaded once per TB tokens and each input number once per 24
   columns */
static void gate_up_block(const float *W, int64_t d, int64_t m2, const float *const *xs, int one, float *h) {
    const float *x0 = xs[0], *x1 = one ? x0 : xs[1], *x2 = one ? x0 : xs[2], *x3 = one ? x0 : xs[3];
    int64_t c = 0;
    for (; c + 24 <= m2; c += 24)
        gate_up_24(W + c, d, m2, x0, x1, x2, x3, one, h + c, h + m2 + c, h + 2 * m2 + c, h + 3 * m2 + c);
    const int nq = one ? 1 : TB;
    for (; c + 8 <= m2; c += 8) {  /* what is left of the columns: 8 at a time (a single row computed 4 times, so that
                                      it takes the same operations as in a block), then one by one */
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < d; i++) {
            const v8 w = *(const v8 *)(W + i * m2 + c);
            a0 += x0[i] * w; a1 += x1[i] * w; a2 += x2[i] * w; a3 += x3[i] * w;
        }
        *(v8 *)(h + c) = a0;
        if (one) continue;
        *(v8 *)(h + m2 + c) = a1; *(v8 *)(h + 2 * m2 + c) = a2; *(v8 *)(h + 3 * m2 + c) = a3;
    }
    for (; c < m2; c++)
        for (int q = 0; q < nq; q++) {
            float s = 0.0f;
            for (int64_t i = 0; i < d; i++) s += xs[q][i] * W[i * m2 + c];
            h[q * m2 + c] = s;
        }
}

/* the rows r < m that some of the nq token rows of h (stride m2) has nonzero, in order, into rows; their count. No
   branch per row: under down_keep a row is kept about as often as not */
static inline int64_t kept_rows(const float *h, int64_t m2, int64_t m, int nq, int64_t *rows) {
    int64_t n = 0;
    for (int64_t r = 0; r < m; r++) {
        int any = 0;
        for (int q = 0; q < nq; q++) any |= h[q * m2 + r] != 0.0f;
        rows[n] = r;
        n += any;
    }
    return n;
}

/* outs[q][0..d) += Σ_j h_q[r_j] · Wd[r_j, 0..d) over the n rows r_j (rows ld apart) for nq tokens (h_q: row q of h,
   stride hs), row by row: four rows at a time, each read once from memory, in order, into every token's outputs (the
   next tokens read them from L1; each output loaded and stored once per four rows). The hardware prefetchers follow
   rows read in order, where walking 24-column blocks down every kept row (down_24) waits on memory at every row:
   TEAL's gate product of 61% of the rows on a 480 MiB-L3 Xeon took 165 µs against 137 µs dense for one token that
   way (row by row 107-111 µs; prefetching the next rows, or eight at a time, gained nothing), and 539 µs against 342
   µs dense for eight. Each output's sum runs in row order, as down_24's does, and a row a token did not keep adds
   its exact zero: the same bits in a block of any size. */
static void down_rows(const float *h, int64_t hs, const int64_t *rows, int64_t n, const float *Wd, int64_t d,
                      int64_t ld, float *const *outs, int nq) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *w0 = Wd + rows[j] * ld, *w1 = Wd + rows[j + 1] * ld, *w2 = Wd + rows[j + 2] * ld,
                    *w3 = Wd + rows[j + 3] * ld;
        for (int q = 0; q < nq; q++) {
            const float *hq = h + q * hs;
            const float c0 = hq[rows[j]], c1 = hq[rows[j + 1]], c2 = hq[rows[j + 2]], c3 = hq[rows[j + 3]];
            float *o = outs[q];
            int64_t i = 0;
            for (; i + 16 <= d; i += 16) {
                v8 a = *(v8 *)(o + i), b = *(v8 *)(o + i + 8);
                a += c0 * *(const v8 *)(w0 + i); b += c0 * *(const v8 *)(w0 + i + 8);
                a += c1 * *(const v8 *)(w1 + i); b += c1 * *(const v8 *)(w1 + i + 8);
                a += c2 * *(const v8 *)(w2 + i); b += c2 * *(const v8 *)(w2 + i + 8);
                a += c3 * *(const v8 *)(w3 + i); b += c3 * *(const v8 *)(w3 + i + 8);
                *(v8 *)(o + i) = a; *(v8 *)(o + i + 8) = b;
            }
            for (; i < d; i++) {
                float a = o[i];
                a += c0 * w0[i]; a += c1 * w1[i]; a += c2 * w2[i]; a += c3 * w3[i];
                o[i] = a;
            }
        }
    }
    for (; j < n; j++) {
        const float *w = Wd + rows[j] * ld;
        for (int q = 0; q < nq; q++) {
            const float c = h[q * hs + rows[j]];
            float *o = outs[q];
            int64_t i = 0;
            for (; i + 8 <= d; i += 8) *(v8 *)(o + i) += c * *(const v8 *)(w + i);
            for (; i < d; i++) o[i] += c * w[i];
        }
    }
}

/* outs[q] += h_q · Wd (Wd [m, d], rows ld apart; h_q: row q of h, stride m2, its first m entries) for the TB tokens
   outs (TB tokens × 24 outputs in registers), or the one outs[0] (down_rows). Only the rows some token of the
   block kept are read (a decode step's down_keep halves the bytes it reads); within the block a row one token did not
   keep is multiplied by its zero, which adds nothing and is cheaper than a sparse pass per token. rows: room for m
   indices. */
static void down_block(const float *h, int64_t m2, int64_t m, const float *Wd, int64_t d, int64_t ld, float *const *outs,
                       int one, int64_t *rows) {
    if (one) {
        down_rows(h, m2, rows, kept_rows(h, m2, m, 1, rows), Wd, d, ld, outs, 1);
        return;
    }
    float *o0 = outs[0], *o1 = outs[1], *o2 = outs[2], *o3 = outs[3];
    const float *h0 = h, *h1 = h + m2, *h2 = h + 2 * m2, *h3 = h + 3 * m2;
    const int64_t n = kept_rows(h, m2, m, TB, rows);
    int64_t i = 0;
    for (; i + 24 <= d; i += 24)
        down_24(Wd + i, ld, rows, n, h0, h1, h2, h3, o0 + i, o1 + i, o2 + i, o3 + i);
    for (; i + 8 <= d; i += 8) {  /* what is left of the outputs: 8 at a time, then one by one */
        v8 a0 = *(v8 *)(o0 + i), a1 = *(v8 *)(o1 + i), a2 = *(v8 *)(o2 + i), a3 = *(v8 *)(o3 + i);
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = rows[j];
            const v8 w = *(const v8 *)(Wd + r * ld + i);
            a0 += h0[r] * w; a1 += h1[r] * w; a2 += h2[r] * w; a3 += h3[r] * w;
        }
        *(v8 *)(o0 + i) = a0; *(v8 *)(o1 + i) = a1; *(v8 *)(o2 + i) = a2; *(v8 *)(o3 + i) = a3;
    }
    for (; i < d; i++)
        for (int q = 0; q < TB; q++)
            for (int64_t j = 0; j < n; j++) outs[q][i] += h[q * m2 + rows[j]] * Wd[rows[j] * ld + i];
}

/* Under AVX-512 (32 registers) a block of an expert's pairs takes TBW = 8 tokens where its widths are multiples of
   24: 8 tokens × 24 columns in 16 registers, so each weight row is loaded once per 8 tokens. With 4 the 24-wide
   products of 98 twelve-neuron experts at top-36 ran at about 175 GFLOP/s on 2 cores of a Xeon whose BLAS runs the
   dense FFN at 270. Each column's sum runs in the same order as in a block of 4 (a row the block reads that a token
   did not keep adds its exact zero), so the bits are the same. */
#if defined(__AVX512F__)
#define TBW 8
#define X8(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)

static void gate_up_24x8(const float *W, int64_t d, int64_t m2, const float *const *xs, float *h) {
#define GU_INIT(q) V24_ZERO(a##q); const float *x##q = xs[q];
#define GU_STEP(q) { V24_SCALAR(b##q, x##q[i]); V24_FMA(a##q, b##q, w); }
#define GU_STORE(q) V24_STORE(h + q * m2, a##q);
    X8(GU_INIT)
    for (int64_t i = 0; i < d; i++) {
        PREFETCH(W + i * m2);
        V24_LOAD(w, W + i * m2);
        V24_PIN(w);
        X8(GU_STEP)
    }
    X8(GU_STORE)
}

static void down_24x8(const float *Wd, int64_t ld, const int64_t *rows, int64_t n, const float *const *hq,
                      float *const *outs, int64_t i) {
#define DN_INIT(q) V24_LOAD(a##q, outs[q] + i); const float *h##q = hq[q];
#define DN_STEP(q) { V24_SCALAR(c##q, h##q[r]); V24_FMA(a##q, c##q, w); }
#define DN_STORE(q) V24_STORE(outs[q] + i, a##q);
    X8(DN_INIT)
    for (int64_t j = 0; j < n; j++) {
        const int64_t r = rows[j];
        __builtin_prefetch(Wd + r * ld + i + 48);  /* as in down_24 */
        V24_LOAD(w, Wd + r * ld + i);
        V24_PIN(w);
        X8(DN_STEP)
    }
    X8(DN_STORE)
}

/* down_24x8 on 48 columns: three 16-float vectors a row where 24 columns take a 16- and an 8-float one, so a
   multiply-add does 16 lanes' work, not 12 on average, and each token's broadcast input serves 48 columns. The routed
   prefill call (96 experts of 12, half of each down kept, 512 tokens, top-24 to top-48, 2 threads of an Ice Lake
   Xeon, both builds in one process) took 12-14% less time; each column's sum runs in the same order, so the bits are
   the same. At a decode step of 8 tokens (rows_columns), which reads the weights from memory, it gained nothing. */
static void down_48x8(const float *Wd, int64_t ld, const int64_t *rows, int64_t n, const float *const *hq,
                      float *const *outs, int64_t i) {
#define D48_INIT(q) v16 a##q##0 = *(const v16 *)(outs[q] + i), a##q##1 = *(const v16 *)(outs[q] + i + 16), \
    a##q##2 = *(const v16 *)(outs[q] + i + 32); const float *h##q = hq[q];
#define D48_STEP(q) { V24_SCALAR(c##q, h##q[r]); a##q##0 += c##q##l * w0; a##q##1 += c##q##l * w1; \
    a##q##2 += c##q##l * w2; }
#define D48_STORE(q) *(v16 *)(outs[q] + i) = a##q##0; *(v16 *)(outs[q] + i + 16) = a##q##1; \
    *(v16 *)(outs[q] + i + 32) = a##q##2;
    X8(D48_INIT)
    for (int64_t j = 0; j < n; j++) {
        const int64_t r = rows[j];
        const float *wr = Wd + r * ld + i;
        __builtin_prefetch(wr + 48); __builtin_prefetch(wr + 64); __builtin_prefetch(wr + 80);  /* as in down_24 */
        v16 w0 = *(const v16 *)wr, w1 = *(const v16 *)(wr + 16), w2 = *(const v16 *)(wr + 32);
        IN_REGISTERS3(w0, w1, w2);
        X8(D48_STEP)
    }
    X8(D48_STORE)
}

/* gate_up_block, kept products and down_block for 8 tokens (xs, outs) of an expert whose 2m and d are multiples of
   24; h: scratch of 8·2m */
static void expert_block8(const float *W, const float *Wd, int64_t d, int64_t m, int64_t keep, int act,
                          const float *const *xs, float *const *outs, const float *scales, float *h, float *mag,
                          int64_t *rows) {
    const int64_t m2 = 2 * m;
    for (int64_t c = 0; c < m2; c += 24) gate_up_24x8(W + c, d, m2, xs, h + c);
    for (int q = 0; q < TBW; q++) kept_products(h + q * m2, mag, m, keep, act, scales[q]);
    const int64_t n = kept_rows(h, m2, m, TBW, rows);
    const float *hq[TBW];
    for (int q = 0; q < TBW; q++) hq[q] = h + q * m2;
    int64_t i = 0;
    for (; i + 48 <= d; i += 48) down_48x8(Wd, d, rows, n, hq, outs, i);
    for (; i < d; i += 24) down_24x8(Wd, d, rows, n, hq, outs, i);
}
#else
#define TBW TB
#endif

/* a dense GLU's kept products (the shared expert's down_keep): out [T,n] = act(gate) * up ([T,n] each), all but
   each row's keep entries of largest magnitude set to 0; rows shared among nthreads */
void moelab_glu_keep(int64_t T, int64_t n, int64_t keep, int act, const float *gate, const float *up, float *out,
                     int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc(sizeof(float) * 2 * n), *mag = malloc(sizeof(float) * (n + 8));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            memcpy(buf, gate + t * n, sizeof(float) * n);
            memcpy(buf + n, up + t * n, sizeof(float) * n);
            kept_products(buf, mag, n, keep, act, 1.0f);
            memcpy(out + t * n, buf, sizeof(float) * n);
        }
        free(buf); free(mag);
    }
}

/* between a prefill's two GEMMs over every routed expert (moe_routed past NATIVE_DENSE_SHARE): out [T, E·m] = each
   token's selected experts' kept products act(gate)·up, scaled by their weights (wts [T, k] or NULL), zeros for the
   experts it did not select; h [T, E·2m] the gate and up rows' values (expert e's gate at e·2m, its up at e·2m + m);
   threads share the tokens */
void moelab_select_keep(int64_t T, int64_t E, int64_t m, int64_t k, int64_t keep, int act, const float *h,
                        const int64_t *top, const float *wts, float *out, int nthreads) {
    const int64_t m2 = 2 * m;
    #pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc(sizeof(float) * m2), *mag = malloc(sizeof(float) * (m + 8));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * E * m;
            memset(o, 0, sizeof(float) * E * m);
            for (int64_t j = 0; j < k; j++) {
                const int64_t e = top[t * k + j];
                memcpy(buf, h + (t * E + e) * m2, sizeof(float) * m2);
                kept_products(buf, mag, m, keep, act, wts ? wts[t * k + j] : 1.0f);
                memcpy(o + e * m, buf, sizeof(float) * m);
            }
        }
        free(buf); free(mag);
    }
}

/* the P = T·k (token, expert) pairs of top grouped by expert: pairs[start[e] .. start[e+1]) are expert e's positions
   in top, token-ordered; fill: room for E numbers */
static void group_by_expert(const int64_t *top, int64_t P, int64_t E, int64_t *start, int64_t *pairs, int64_t *fill) {
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t p = 0; p < P; p++) start[top[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int64_t) * E);
    for (int64_t p = 0; p < P; p++) pairs[fill[top[p]]++] = p;
}

/* one expert's n pairs (own: positions in top; token = position / k): its products TB tokens at a time, the kept
   ones scaled by their weights, added into the rows of acc (one per token); TBW at a time where expert_block8
   applies. h, mag, rows: scratch of TBW·2m, m + 8 and m numbers */
static void expert_pairs(const float *W, const float *Wd, const int64_t *own, int64_t n, int64_t k, int64_t d,
                         int64_t m, int64_t keep, int act, const float *x, const float *wts, float *acc,
                         float *h, float *mag, int64_t *rows) {
    const int64_t m2 = 2 * m;
    const float *xs[TBW];
    float *outs[TBW];
#if TBW > TB
    const int wide = m2 % 24 == 0 && d % 24 == 0;
#endif
    for (int64_t q0 = 0; q0 < n;) {
#if TBW > TB
        if (wide && n - q0 >= TBW) {
            float scales[TBW];
            for (int q = 0; q < TBW; q++) {
                xs[q] = x + (own[q0 + q] / k) * d;
                outs[q] = acc + (own[q0 + q] / k) * d;
                scales[q] = wts ? wts[own[q0 + q]] : 1.0f;
            }
            expert_block8(W, Wd, d, m, keep, act, xs, outs, scales, h, mag, rows);
            q0 += TBW;
            continue;
        }
#endif
        const int nq = n - q0 >= TB ? TB : 1;  /* blocks of TB tokens, the rest one by one */
        for (int q = 0; q < nq; q++) {
            xs[q] = x + (own[q0 + q] / k) * d;
            outs[q] = acc + (own[q0 + q] / k) * d;
        }
        gate_up_block(W, d, m2, xs, nq == 1, h);
        for (int q = 0; q < nq; q++) kept_products(h + q * m2, mag, m, keep, act, wts ? wts[own[q0 + q]] : 1.0f);
        down_block(h, m2, m, Wd, d, d, outs, nq == 1, rows);
        q0 += nq;
    }
}

/* o[c0..c1) += Σ of mu [E, d]'s rows over the experts a token skips (tk: its k selected ones), columns c0..c1, row
   by row in expert order: each skipped row is read in order while the outputs stay in L1. Column by column (8 at a
   time over every skipped row, the same sums in the same order) a decode step's 70 skipped rows were read 32 bytes
   at a time from 70 places: 30 µs of a 210 µs layer, on one thread while the other waited. chosen: scratch of E */
static void add_skipped_means(float *restrict o, const int64_t *tk, int64_t k, int64_t E, const float *restrict mu,
                              int64_t d, int64_t c0, int64_t c1, unsigned char *chosen) {
    memset(chosen, 0, E);
    for (int64_t j = 0; j < k; j++) chosen[tk[j]] = 1;
    for (int64_t e = 0; e < E; e++) {
        if (chosen[e]) continue;
        const float *restrict row = mu + e * d;
        for (int64_t i = c0; i < c1; i++) o[i] += row[i];
    }
}

/* o [d] = Σ of mu [E, d]'s rows over the experts a token skips, as (Σ of every row: total) − its k selected ones,
   in their order: k rows read instead of E − k. moelab_moe_prefill's choice where a token selects fewer than half
   the experts (at top-28 of 98, 4% of a 512-token prefill went to the 70 skipped rows); the torch path
   (skipped_means) computes the same difference. 32 columns stay in registers over the k rows (the rows are in L2
   across a prefill's tokens): o written row by row took 0.64-0.78 ms of a 4.7 ms routed call (98 experts of 12,
   top-38, 512 tokens, a 2-vCPU Xeon), this 0.19-0.26 ms, the same sums in the same order */
static void skipped_means_by_total(float *restrict o, const float *restrict total, const int64_t *tk, int64_t k,
                                   const float *restrict mu, int64_t d) {
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {  /* 32 columns in registers over the k rows: o is written once, not k times */
        v8 a0 = *(const v8 *)(total + i), a1 = *(const v8 *)(total + i + 8), a2 = *(const v8 *)(total + i + 16),
           a3 = *(const v8 *)(total + i + 24);
        for (int64_t j = 0; j < k; j++) {
            const float *row = mu + tk[j] * d + i;
            a0 -= *(const v8 *)row; a1 -= *(const v8 *)(row + 8); a2 -= *(const v8 *)(row + 16);
            a3 -= *(const v8 *)(row + 24);
        }
        *(v8 *)(o + i) = a0; *(v8 *)(o + i + 8) = a1; *(v8 *)(o + i + 16) = a2; *(v8 *)(o + i + 24) = a3;
    }
    for (; i < d; i++) {
        float a = total[i];
        for (int64_t j = 0; j < k; j++) a -= mu[tk[j] * d + i];
        o[i] = a;
    }
}

/* within a parallel region, the threads sharing the columns (a decode step has one token or a few): each token's
   skipped experts' means (mu [E, d]), the calling thread's columns, into its accumulator acc [T, d] */
static void skipped_means_shared(float *acc, int64_t T, const int64_t *top, int64_t k, int64_t E, const float *mu,
                                 int64_t d) {
    const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
    const int64_t c0 = d * th / nth / 16 * 16, c1 = th + 1 == nth ? d : d * (th + 1) / nth / 16 * 16;
    unsigned char *chosen = malloc(E);
    for (int64_t t = 0; t < T; t++) add_skipped_means(acc + t * d, top + t * k, k, E, mu, d, c0, c1, chosen);
    free(chosen);
}

/* out [n] = the used threads' accumulators (accs [used, n]) added in thread order: the same bits whatever the timing */
static void sum_in_thread_order(float *out, const float *accs, int used, int64_t n) {
    memcpy(out, accs, sizeof(float) * n);
    for (int th = 1; th < used; th++)
        for (int64_t i = 0; i < n; i++) out[i] += accs[(size_t)th * n + i];
}

/* x [T,d]; top [T,k]; wts [T,k] or NULL; wgu [E,d,2m]; wd [E,m,d]; mu [E,d] or NULL; out [T,d].
   Expert-major: the pairs are grouped by expert, so a block that several tokens selected is read from
   memory once (a batch of 8 tokens selects most experts of a layer) and re-read from cache. */
void moelab_moe_decode(int64_t T, int64_t k, int64_t E, int64_t d, int64_t m, int64_t keep, int act,
                       const float *x, const int64_t *top, const float *wts, const float *wgu,
                       const float *wd, const float *mu, float *out, int nthreads) {
    const int64_t m2 = 2 * m, P = T * k;
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *pairs = malloc(sizeof(int64_t) * P);
    int64_t *fill = malloc(sizeof(int64_t) * E);
    group_by_expert(top, P, E, start, pairs, fill);
    int64_t n_used = 0;  /* the selected experts, shared out evenly among the threads */
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) fill[n_used++] = e;
    /* one accumulator per thread, summed in thread order afterwards: with the static schedules
       the result does not depend on timing (same inputs and threads, same bits) */
    float *accs = calloc((size_t)nthreads * T * d, sizeof(float));
    int used = 1;
    #pragma omp parallel num_threads(nthreads)
    {
        float *acc = accs + (size_t)omp_get_thread_num() * T * d;
        #pragma omp single
        used = omp_get_num_threads();
        float *h = malloc(sizeof(float) * TBW * m2), *mag = malloc(sizeof(float) * (m + 8));
        int64_t *rows = malloc(sizeof(int64_t) * m);
        #pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < n_used; u++) {
            const int64_t e = fill[u], n = start[e + 1] - start[e];
            const int64_t *own = pairs + start[e];
            const float *W = wgu + e * d * m2;
            if (u + 1 < n_used) prefetch_start(wgu + fill[u + 1] * d * m2, d * m2);
            expert_pairs(W, wd + e * m * d, own, n, k, d, m, keep, act, x, wts, acc, h, mag, rows);
        }
        if (mu) skipped_means_shared(acc, T, top, k, E, mu, d);
        free(h); free(mag); free(rows);
    }
    sum_in_thread_order(out, accs, used, T * d);
    free(accs); free(start); free(pairs); free(fill);
}

/* what moelab_moe_decode computes, for many tokens: each thread owns a range of tokens (their output rows
   start with the skipped experts' means, then add the experts in expert order, so the bits do not depend on
   the thread count) and walks every expert's pairs within that range, TB tokens at a time. The means are the
   skipped rows' sum, or every row's sum less the selected ones where that reads fewer (skipped_means_by_total) */
void moelab_moe_prefill(int64_t T, int64_t k, int64_t E, int64_t d, int64_t m, int64_t keep, int act,
                        const float *x, const int64_t *top, const float *wts, const float *wgu,
                        const float *wd, const float *mu, float *out, int nthreads) {
    const int64_t m2 = 2 * m, P = T * k;
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *pairs = malloc(sizeof(int64_t) * P);
    int64_t *fill = malloc(sizeof(int64_t) * E);
    group_by_expert(top, P, E, start, pairs, fill);
    float *total = mu && k < E - k ? calloc(d, sizeof(float)) : NULL;
    if (total)
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < d; i++) total[i] += mu[e * d + i];
    #pragma omp parallel num_threads(nthreads)
    {
        const int nth = omp_get_num_threads(), th = omp_get_thread_num();
        const int64_t t0 = T * th / nth, t1 = T * (th + 1) / nth;
        float *h = malloc(sizeof(float) * TBW * m2), *mag = malloc(sizeof(float) * (m + 8));
        int64_t *rows = malloc(sizeof(int64_t) * m);
        unsigned char *chosen = malloc(E);
        for (int64_t t = t0; t < t1; t++) {
            if (total) {
                skipped_means_by_total(out + t * d, total, top + t * k, k, mu, d);
                continue;
            }
            memset(out + t * d, 0, sizeof(float) * d);
            if (mu) add_skipped_means(out + t * d, top + t * k, k, E, mu, d, 0, d, chosen);
        }
        for (int64_t e = 0; e < E; e++) {
            int64_t lo = start[e], hi = start[e + 1], a, b;
            for (a = lo, b = hi; a < b;) { int64_t c = (a + b) / 2; if (pairs[c] / k < t0) a = c + 1; else b = c; }
            lo = a;
            for (b = hi; a < b;) { int64_t c = (a + b) / 2; if (pairs[c] / k < t1) a = c + 1; else b = c; }
            hi = a;
            expert_pairs(wgu + e * d * m2, wd + e * m * d, pairs + lo, hi - lo, k, d, m, keep, act, x, wts, out, h, mag,
                         rows);
        }
        free(h); free(mag); free(rows); free(chosen);
    }
    free(total); free(start); free(pairs); free(fill);
}

/* where slice u of parts over n columns starts (n for u = parts): a multiple of 24, the micro-kernel's width */
static inline int64_t slice_start(int64_t n, int64_t u, int64_t parts) {
    return u >= parts ? n : n * u / parts / 24 * 24;
}

/* columns c0..c1 of out [T, ·] (rows ldo apart) += Σ_j h_q[r_j] · W[r_j, c0..c1) over the n rows r_j (ascending;
   W's rows ld apart; h_q: row q of h, stride hs). Blocks of several tokens keep 24
   columns of each token's outputs in registers (down_24, and down_24x8 under AVX-512), each weight vector loaded once
   for the block, the block filled up with tokens of zeros; one token goes row by row (down_rows). Row by row, several
   tokens' outputs were loaded and stored once per four rows and outgrew L1; 24 columns walked down every row waited on
   memory at each row. So the rows go in panels of ROWS_PANEL, all 24-column strips of a panel before the next, each
   row's next strip prefetched: each row of a panel is then a stream read in order. Thirty TEAL FFNs of the default
   model (d 576 / D 1,536, calibrated at cost 0.5, eight tokens, weights from memory, 2 threads of a Zen 4 EPYC,
   interleaved): 46.4 ms row by row, 37.0 in strips down every row, 32.1 in panels, 26.2 with the prefetch, the
   dense decode call 22.7 (another run: strips 34.9, panels 31.0, prefetched 23.5; panels of 16 rows 30.6, of 128
   26.5). At two and four tokens 18.0 and 30.2 ms row by row, 16.8 and 20.9 now. Those were eight consecutive tokens
   of one text; eight tokens of eight texts, as a batch of eight sequences decodes, took 27.1 ms through the three
   row-by-row calls TEAL made before, 22.3 in one call, 20.8 in the dense call, and the whole model's TEAL 0.5 went
   from 1.11x to 1.17x dense at decode b8 (five rounds in one process; one sequence 1.48x either way). Each column's
   sum runs in row order either way, a row a token did not need adding its exact zero: a token's outputs have the
   same bits in a block of any size and in any slice. */
#define ROWS_TOKENS 8
#define ROWS_PANEL 32
static void rows_columns(const float *h, int64_t hs, const int64_t *rows, int64_t n, const float *W, int64_t ld,
                         int64_t c0, int64_t c1, int64_t T, float *out, int64_t ldo) {
    if (c1 <= c0 || T == 0) return;
    float *zeros = NULL, *sink = NULL;
    const float *hq[ROWS_TOKENS];
    float *outs[ROWS_TOKENS];
    for (int64_t q0 = 0; q0 < T; q0 += TBW) {  /* blocks of the widest micro-kernel: 8 tokens under AVX-512, else 4 */
        const int nq = T - q0 >= TBW ? TBW : (int)(T - q0);
        const int block = nq == 1 ? 1 : nq <= TB ? TB : TBW;
        if (nq < block && zeros == NULL) {  /* its missing tokens: inputs of zeros (as long as the rows read) and
                                                outputs to a scratch row */
            zeros = calloc(n ? rows[n - 1] + 1 : 1, sizeof(float));
            sink = calloc(c1, sizeof(float));
        }
        for (int q = 0; q < block; q++) {
            hq[q] = q < nq ? h + (q0 + q) * hs : zeros;
            outs[q] = q < nq ? out + (q0 + q) * ldo : sink;
        }
        int64_t c = block > 1 ? c0 + (c1 - c0) / 24 * 24 : c0;
        for (int64_t j0 = 0; j0 < n && block > 1; j0 += ROWS_PANEL) {
            const int64_t np = n - j0 < ROWS_PANEL ? n - j0 : ROWS_PANEL;
            for (int64_t s = c0; s < c; s += 24) {
#if TBW > TB
                if (block == TBW) { down_24x8(W, ld, rows + j0, np, hq, outs, s); continue; }
#endif
                down_24(W + s, ld, rows + j0, np, hq[0], hq[1], hq[2], hq[3], outs[0] + s, outs[1] + s, outs[2] + s,
                        outs[3] + s);
            }
        }
        if (c == c1) continue;
        float *rest[ROWS_TOKENS];
        for (int q = 0; q < nq; q++) rest[q] = outs[q] + c;
        down_rows(h + q0 * hs, hs, rows, n, W + c, c1 - c, ld, rest, nq);
    }
    free(zeros); free(sink);
}

/* the columns of slice u of parts of out [T, n] += h_t · W (h_t: row t of h, stride hs, its first m entries; W:
   [m, n] storage), up to ROWS_TOKENS tokens at a time, each reading once for its block the rows some token of the
   block has nonzero (a decode step of up to eight sequences: once). rows: room for m indices */
static void rows_slice(const float *h, int64_t hs, int64_t m, const float *W, int64_t n, int64_t u, int64_t parts,
                       int64_t T, float *out, int64_t *rows) {
    const int64_t c0 = slice_start(n, u, parts), c1 = slice_start(n, u + 1, parts);
    for (int64_t q0 = 0; q0 < T && c1 > c0; q0 += ROWS_TOKENS) {
        const int nq = T - q0 >= ROWS_TOKENS ? ROWS_TOKENS : (int)(T - q0);
        const float *hq = h + q0 * hs;
        rows_columns(hq, hs, rows, kept_rows(hq, hs, m, nq, rows), W, n, c0, c1, nq, out + q0 * n, n);
    }
}

/* TEAL's FFN (moelab_teal.TealGLU, TEAL section 3: a magnitude threshold on each projection's input) at a decode
   step, in one parallel region: out [T, d] = (s_mid(act(x_s Wg) · x_s Wu)) Wd, with x_s = x where |x| > below_in (0
   elsewhere) and s_mid zeroing |h| ≤ below_mid, as torch's hardshrink does (below_in < 0: nothing zeroed). Wg, Wu:
   [d, D] storage and Wd [D, d] (rows by input), so a zeroed input skips a weight row: the gate and up products read
   only the rows some token has a nonzero input for, the threads sharing their columns (and each thread the same
   columns of h); after one barrier the down product reads only the rows of h some token kept, the threads sharing
   d. It was eight calls a layer (three row-skipping products, five torch operations), each a fork of the thread pool
   or a Python frame: one token through a random-weight FFN at d 576 / D 1,536, sparsities 0.5 / 0.5, took 118-123
   µs, where the dense decode call took 102-104; in one call 88-99 µs (2 threads of a Zen 4 EPYC). */
void moelab_teal_decode(int64_t T, int64_t d, int64_t D, int act, const float *x, float below_in, float below_mid,
                        const float *wg, const float *wu, const float *wd, float *out, int nthreads) {
    float *xs = malloc(sizeof(float) * (T * d + 1)), *g = malloc(sizeof(float) * (2 * T * D + 1)), *u = g + T * D;
    int64_t *rows = malloc(sizeof(int64_t) * (d + 1));
    for (int64_t i = 0; i < T * d; i++) xs[i] = fabsf(x[i]) <= below_in ? 0.0f : x[i];
    const int64_t nx = kept_rows(xs, d, d, (int)T, rows);
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
        int64_t c0 = slice_start(D, th, nth), c1 = slice_start(D, th + 1, nth);
        for (int64_t q = 0; q < T; q++) {
            memset(g + q * D + c0, 0, sizeof(float) * (c1 - c0));
            memset(u + q * D + c0, 0, sizeof(float) * (c1 - c0));
        }
        rows_columns(xs, d, rows, nx, wg, D, c0, c1, T, g, D);
        rows_columns(xs, d, rows, nx, wu, D, c0, c1, T, u, D);
        for (int64_t q = 0; q < T; q++)
            for (int64_t c = c0; c < c1; c++) {
                const float v = g[q * D + c];
                const float h = (act == 0 ? v / (1.0f + exp_approx(-v)) : act_fn(v, act)) * u[q * D + c];
                g[q * D + c] = fabsf(h) <= below_mid ? 0.0f : h;
            }
        #pragma omp barrier
        int64_t *kept = malloc(sizeof(int64_t) * (D + 1));
        const int64_t nh = kept_rows(g, D, D, (int)T, kept);
        c0 = slice_start(d, th, nth); c1 = slice_start(d, th + 1, nth);
        for (int64_t q = 0; q < T; q++) memset(out + q * d + c0, 0, sizeof(float) * (c1 - c0));
        rows_columns(g, D, kept, nh, wd, d, c0, c1, T, out, d);
        free(kept);
    }
    free(xs); free(g); free(rows);
}

/* ---- a whole MoE FFN at a decode step, in one call ---- */

/* one token's dot product with a weight row, 32 numbers at a time into four 8-float sums: a token's result is the
   same whichever block of tokens it is computed in */
#define DOT_STEP(q) (s##q##0 += w0 * *(const v8 *)(x##q + i), s##q##1 += w1 * *(const v8 *)(x##q + i + 8), \
                     s##q##2 += w2 * *(const v8 *)(x##q + i + 16), s##q##3 += w3 * *(const v8 *)(x##q + i + 24))
#define DOT_ZERO(q) v8 s##q##0 = {0}, s##q##1 = {0}, s##q##2 = {0}, s##q##3 = {0}
/* the 32 weights at w + i, in registers: without the pin the compiler folded each weight load into every token's
   multiply-add (a load per token, where the tokens' inputs are what L1 serves) */
#define DOT_LOAD(w, i) v8 w0 = *(const v8 *)((w) + (i)), w1 = *(const v8 *)((w) + (i) + 8), \
                       w2 = *(const v8 *)((w) + (i) + 16), w3 = *(const v8 *)((w) + (i) + 24); \
                       IN_REGISTERS4(w0, w1, w2, w3)
#define DOT_END(q, t) out[(t) * ld + r] = dot_finish(s##q##0, s##q##1, s##q##2, s##q##3, w, x##q, i, d)

static inline float dot_finish(v8 a0, v8 a1, v8 a2, v8 a3, const float *w, const float *xt, int64_t i, int64_t d) {
    for (; i + 8 <= d; i += 8) a0 += *(const v8 *)(w + i) * *(const v8 *)(xt + i);
    const v8 a = (a0 + a1) + (a2 + a3);
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; i < d; i++) s += w[i] * xt[i];
    return s;
}

/* one group of N tokens (XN: the X-macro over 0..N-1) at a time through the row w, as long as N are left */
#define DOT_X(q) const float *x##q = x + (t + q) * d; DOT_ZERO(q);
#define DOT_S(q) DOT_STEP(q);
#define DOT_E(q) DOT_END(q, t + q);
#define DOT_GROUPS(N, XN) \
    for (; t + N <= T; t += N) { \
        XN(DOT_X) \
        int64_t i = 0; \
        for (; i + 32 <= d; i += 32) { \
            PREFETCH(w + i); PREFETCH(w + i + 16);  /* the rows are contiguous: on into the next ones */ \
            DOT_LOAD(w, i); \
            XN(DOT_S) \
        } \
        XN(DOT_E) \
    }
#define X1(F) F(0)
#define X2(F) F(0) F(1)
#define X3(F) F(0) F(1) F(2)
#define X4(F) F(0) F(1) F(2) F(3)

/* out[t · ld + r] = x_t · W[r] for rows r0..r1 of W [·, d] and the T rows of x (the shared expert's gate and up
   rows and the router's, nn.Linear's layout: each a contiguous row of d). Tokens go in fours under AVX-512 (32
   vector registers: 16 sums and 4 weight vectors), in threes under AVX2 (16: 12 sums and 4 weight vectors, each
   token's inputs read by its multiply-adds from L1), then in pairs, each weight vector loaded once serving them all
   (one by one, a batch took two loads a multiply-add). Each token's sums run in the same order whatever its group.
   Threes and the weights pinned in registers (DOT_LOAD; GCC had folded their loads into every token's multiply-add)
   took a batch of 8 through the 49,152-row LM head from 6.5-7.3 to 5.6-6.9 ms and through a 576-square projection
   from 79-100 to 69-90 µs on a Zen 3 EPYC (2 threads; three runs, the builds side by side in one process), the
   same bits; 1 to 4 tokens, which read the weights from memory, within that host's noise. */
static void rows_dot(const float *W, int64_t r0, int64_t r1, int64_t d, const float *x, int64_t T, float *out,
                     int64_t ld) {
    for (int64_t r = r0; r < r1; r++) {
        const float *w = W + r * d;
        int64_t t = 0;
#if defined(__AVX512F__)
        DOT_GROUPS(4, X4)
#elif defined(__AVX2__)
        DOT_GROUPS(3, X3)
#endif
        DOT_GROUPS(2, X2)
        DOT_GROUPS(1, X1)
    }
}

/* y [T, n] = x [T, d] W^T (+ b) for W [n, d] in nn.Linear's layout, the threads sharing W's rows: a decode step's
   projections outside the FFN (attention's, the LM head), whose weights torch's GEMV read at half this rate on a
   Zen 4 EPYC (the LM head: 9-10 ms on one thread or two, 4.9 ms here on two). A token's row of y has the same bits
   whichever tokens share the call and however many threads run it. */
void moelab_linear_decode(int64_t T, int64_t d, int64_t n, const float *x, const float *W, const float *b, float *y,
                          int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
        const int64_t r0 = n * th / nth, r1 = n * (th + 1) / nth;
        rows_dot(W, r0, r1, d, x, T, y, n);
        if (b)
            for (int64_t t = 0; t < T; t++)
                for (int64_t r = r0; r < r1; r++) y[t * n + r] += b[r];
    }
}

/* y = weight · x / sqrt(mean(x²) + eps) for one row of d (transformers' RMSNorm of Llama-style models in float32) */
static void rms_row(const float *x, const float *weight, float eps, int64_t d, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) y[i] = weight[i] * (x[i] * r);
}

/* rotary embedding of one head of hd in place: x·cos + rotate_half(x)·sin, rotate_half(x) = (-x[h:], x[:h]) */
static void rope_head(float *x, const float *c, const float *s, int64_t hd) {
    const int64_t h = hd / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = a * c[i] - b * s[i];
        x[i + h] = b * c[i + h] + a * s[i + h];
    }
}

/* The attention half's inputs for a decode step of N tokens (one new token per sequence): xn = RMSNorm(x) (weight
   nw, eps), then q/k/v [N, nq|nk|nv] = xn W^T (+ b) with the threads sharing each weight's rows, then on every head
   of q and k its RMSNorm (Qwen3's q_norm and k_norm: weights qn, kn [hd], eps heps; NULL for none) and the rotary
   embedding (cs, sn [N, hd]: each token's cos and sin). One parallel region where transformers makes some twenty
   torch calls. */
void moelab_attn_in(int64_t N, int64_t d, const float *x, const float *nw, float eps, int64_t hd, int64_t nq,
                    int64_t nk, int64_t nv, const float *wq, const float *wk, const float *wv, const float *bq,
                    const float *bk, const float *bv, const float *qn, const float *kn, float heps, const float *cs,
                    const float *sn, float *q, float *k, float *v, int nthreads) {
    float *xn = malloc(sizeof(float) * N * d + 1);
    for (int64_t t = 0; t < N; t++) rms_row(x + t * d, nw, eps, d, xn + t * d);
    const int64_t hq = nq / hd, hk = nk / hd;
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
        const float *ws[3] = {wq, wk, wv}, *bs[3] = {bq, bk, bv};
        float *ys[3] = {q, k, v};
        const int64_t ns[3] = {nq, nk, nv};
        for (int j = 0; j < 3; j++) {
            const int64_t r0 = ns[j] * th / nth, r1 = ns[j] * (th + 1) / nth;
            rows_dot(ws[j], r0, r1, d, xn, N, ys[j], ns[j]);
            if (bs[j])
                for (int64_t t = 0; t < N; t++)
                    for (int64_t r = r0; r < r1; r++) ys[j][t * ns[j] + r] += bs[j][r];
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < N * (hq + hk); i++) {
            const int64_t t = i / (hq + hk), h = i % (hq + hk);
            float *head = h < hq ? q + t * nq + h * hd : k + t * nk + (h - hq) * hd;
            const float *hn = h < hq ? qn : kn;
            if (hn) rms_row(head, hn, heps, hd, head);
            rope_head(head, cs + t * hd, sn + t * hd, hd);
        }
    }
    free(xn);
}

/* The attention half's outputs for a decode step of B sequences, one new token each: each query head h of q [B, hq
   · hd] attends (scale; softmax over the keys its mask row allows: mask [·, L] of bytes, row b at b · mstride, NULL
   for all) to the L keys and values of kv head h / (hq / hk) (K, V: element strides per sequence, head and
   position, the last dim contiguous), then o = att Wo^T (+ bo) with the threads sharing Wo's rows, then
   hs = x + o and xn = RMSNorm(hs) (weight nw, eps). A row whose mask allows no key attends to nothing (zeros). */
void moelab_attn_out(int64_t B, int64_t hq, int64_t hk, int64_t hd, int64_t L, const float *q, const float *K,
                     const float *V, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb, int64_t vsh, int64_t vsl,
                     const uint8_t *mask, int64_t mstride, float scale, int64_t d, const float *wo, const float *bo,
                     const float *x, const float *nw, float eps, float *hs, float *xn, int nthreads) {
    const int64_t nq = hq * hd, rep = hq / hk;
    float *att = malloc(sizeof(float) * B * nq + 1), *o = malloc(sizeof(float) * B * d + 1);
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
        float *p = malloc(sizeof(float) * L + 1);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < B * hq; i++) {
            const int64_t b = i / hq, h = i % hq, g = h / rep;
            const float *qh = q + b * nq + h * hd, *Kh = K + b * ksb + g * ksh, *Vh = V + b * vsb + g * vsh;
            const uint8_t *mb = mask ? mask + b * mstride : NULL;
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                if (mb && !mb[j]) { p[j] = -INFINITY; continue; }
                float dot = 0.0f;
                for (int64_t c = 0; c < hd; c++) dot += qh[c] * Kh[j * ksl + c];
                p[j] = dot * scale;
                mx = p[j] > mx ? p[j] : mx;
            }
            float *out = att + b * nq + h * hd;
            for (int64_t c = 0; c < hd; c++) out[c] = 0.0f;
            if (mx == -INFINITY) continue;
            for (int64_t j = 0; j < L; j++) {
                p[j] = p[j] == -INFINITY ? 0.0f : expf(p[j] - mx);
                sum += p[j];
            }
            for (int64_t j = 0; j < L; j++) {
                if (p[j] == 0.0f) continue;
                const float w = p[j] / sum, *vj = Vh + j * vsl;
                for (int64_t c = 0; c < hd; c++) out[c] += w * vj[c];
            }
        }
        free(p);
        const int64_t r0 = d * th / nth, r1 = d * (th + 1) / nth;
        rows_dot(wo, r0, r1, nq, att, B, o, d);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t c = 0; c < d; c++) hs[b * d + c] = x[b * d + c] + (bo ? o[b * d + c] + bo[c] : o[b * d + c]);
            rms_row(hs + b * d, nw, eps, d, xn + b * d);
        }
    }
    free(att);
    free(o);
}

/* the k best of E scores into top[0..k), best first (ties: the lower index first): each score's rank is the count
   of scores above it, comparisons that vectorise. Slots a NaN left unranked keep a valid expert index. */
static void select_top(const float *s, int64_t E, int64_t k, int64_t *top) {
    for (int64_t j = 0; j < k; j++) top[j] = j;
    for (int64_t e = 0; e < E; e++) {
        const float v = s[e];
        int32_t rank = 0;
        for (int32_t f = 0; f < (int32_t)E; f++) rank += (s[f] > v) | ((s[f] == v) & (f < (int32_t)e));
        if (rank < k) top[rank] = e;
    }
}

/* the combine weights of a token's k selected experts (best first): combine 1 (weighted) their softmax
   probabilities over all E scores, 2 (normalized) a softmax over the k selected scores only */
static void combine_weights(const float *s, int64_t E, const int64_t *top, int64_t k, int combine, float *w) {
    float mx = s[top[0]], sum = 0.0f;
    if (combine == 1) {
        for (int64_t e = 0; e < E; e++) mx = s[e] > mx ? s[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += expf(s[e] - mx);
    } else {
        for (int64_t j = 0; j < k; j++) mx = s[top[j]] > mx ? s[top[j]] : mx;
        for (int64_t j = 0; j < k; j++) sum += expf(s[top[j]] - mx);
    }
    for (int64_t j = 0; j < k; j++) w[j] = expf(s[top[j]] - mx) / sum;
}

/* MoeFFN for T <= DECODE_TOKENS tokens: the shared expert (sg, su [ds, d] as nn.Linear stores them; sd its down
   projection as [ds, d] storage, so that the skeep kept neurons' rows are read, not the whole matrix), the router
   (rw [E, d], rb [E] or NULL: s = x rw^T + rb), each token's top-k (written to top, best first) and combine
   weights, the selected experts (wgu, wd, mu as moelab_moe_decode takes them), all in one parallel region with
   two barriers, where the torch path makes some ten calls and thread-pool forks a layer.
   1. the threads share the rows of gate, up and router; 2. one thread ranks the experts, keeps the shared
   expert's largest products and groups the pairs by expert; 3. the threads share out one slice of the shared
   down projection's outputs each, then the selected experts one by one. Each sums into its own accumulator,
   added in thread order, so the same inputs and threads give the same bits. */
void moelab_moe_ffn_decode(int64_t T, int64_t d, int act, const float *x, int64_t ds, int64_t skeep, const float *sg,
                           const float *su, const float *sd, int64_t E, int64_t k, const float *rw, const float *rb,
                           int combine, int64_t m, int64_t keep, const float *wgu, const float *wd, const float *mu,
                           float *out, int64_t *top, int nthreads) {
    const int64_t m2 = 2 * m, ds2 = 2 * ds, P = T * k;
    float *sh = malloc(sizeof(float) * (T * ds2 + 1)), *sc = malloc(sizeof(float) * T * E);
    float *wts = combine ? malloc(sizeof(float) * P) : NULL;
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *pairs = malloc(sizeof(int64_t) * P);
    int64_t *fill = malloc(sizeof(int64_t) * E);
    float *accs = calloc((size_t)nthreads * T * d, sizeof(float));
    int used = 1;
    int64_t n_used = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        const int nth = omp_get_num_threads(), th = omp_get_thread_num();
        float *acc = accs + (size_t)th * T * d;
        rows_dot(sg, ds * th / nth, ds * (th + 1) / nth, d, x, T, sh, ds2);
        rows_dot(su, ds * th / nth, ds * (th + 1) / nth, d, x, T, sh + ds, ds2);
        rows_dot(rw, E * th / nth, E * (th + 1) / nth, d, x, T, sc, E);
        #pragma omp barrier
        #pragma omp single
        {
            used = nth;
            float *mag = malloc(sizeof(float) * (ds + 8));
            for (int64_t t = 0; t < T; t++) {
                if (ds) kept_products(sh + t * ds2, mag, ds, skeep, act, 1.0f);
                float *s = sc + t * E;
                if (rb) for (int64_t e = 0; e < E; e++) s[e] += rb[e];
                select_top(s, E, k, top + t * k);
                if (combine) combine_weights(s, E, top + t * k, k, combine, wts + t * k);
            }
            group_by_expert(top, P, E, start, pairs, fill);
            for (int64_t e = 0; e < E; e++)
                if (start[e + 1] > start[e]) fill[n_used++] = e;
            free(mag);
        }
        const int64_t rmax = m > ds ? m : ds;
        float *h = malloc(sizeof(float) * TBW * m2 + 1), *mag = malloc(sizeof(float) * (m + 8));
        int64_t *rows = malloc(sizeof(int64_t) * (rmax + 1));
        const int64_t slices = ds ? nth : 0;
        #pragma omp for schedule(static, 1) nowait
        for (int64_t u = 0; u < slices + n_used; u++) {
            if (u < slices) {  /* a slice of the shared down projection's outputs */
                rows_slice(sh, ds2, ds, sd, d, u, slices, T, acc, rows);
                continue;
            }
            const int64_t e = fill[u - slices];
            if (u + nth < slices + n_used)  /* this thread's next expert */
                prefetch_start(wgu + fill[u + nth - slices] * d * m2, d * m2);
            expert_pairs(wgu + e * d * m2, wd + e * m * d, pairs + start[e], start[e + 1] - start[e], k, d, m, keep,
                         act, x, wts, acc, h, mag, rows);
        }
        if (mu) skipped_means_shared(acc, T, top, k, E, mu, d);
        free(h); free(mag); free(rows);
    }
    sum_in_thread_order(out, accs, used, T * d);
    free(accs); free(sh); free(sc); free(wts); free(start); free(pairs); free(fill);
}
"""

#: up to this many tokens a call shares the selected experts among the threads (``moelab_moe_decode``)
DECODE_TOKENS = 8

_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    if root := os.environ.get("MOELAB_KERNEL_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moelab" / "kernels"


#: the lines of /proc/cpuinfo that name a CPU and what it can run: x86's model and flags, and aarch64's, which has
#: neither (its implementer, part and features)
CPU_LINES = ("model name", "flags", "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def cpu_identity(cpuinfo: str) -> str:
    """The first processor's ``CPU_LINES`` in a /proc/cpuinfo text."""
    lines = []
    for line in cpuinfo.splitlines():
        if line.strip() == "":
            break
        if line.startswith(CPU_LINES):
            lines.append(line)
    return "\n".join(lines)


def build_key() -> str:
    """What the compiled kernel is built from: the source, the flags and this CPU (``-march=native`` code may not run
    on another one: a kernel cache shared between machines keeps one build per CPU)."""
    with open("/proc/cpuinfo") as f:  # Linux
        cpu = cpu_identity(f.read())
    text = "\n".join([_SOURCE, " ".join(_FLAGS), platform.machine(), cpu])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compile() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    target = _cache_dir() / f"moelab_native-{build_key()}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, lib = Path(tmp) / "moelab_native.c", Path(tmp) / "moelab_native.so"
            src.write_text(_SOURCE)
            done = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(lib), "-lm"], capture_output=True)
            if done.returncode:
                return None
            os.replace(lib, target)
    return load(target)


def load(path: Path) -> ctypes.CDLL:
    """The compiled kernel at ``path`` with its functions' signatures declared (a build for another target too)."""
    library = ctypes.CDLL(str(path))
    decode, prefill, glu = library.moelab_moe_decode, library.moelab_moe_prefill, library.moelab_glu_keep
    decode.restype = prefill.restype = glu.restype = None
    decode.argtypes = prefill.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int]
    glu.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    select = library.moelab_select_keep
    select.restype = None
    select.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    teal = library.moelab_teal_decode
    teal.restype = None
    teal.argtypes = [i64, i64, i64, ctypes.c_int, ptr, f32, f32, ptr, ptr, ptr, ptr, ctypes.c_int]
    linear = library.moelab_linear_decode
    linear.restype = None
    linear.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_int]
    attn_in, attn_out = library.moelab_attn_in, library.moelab_attn_out
    attn_in.restype = attn_out.restype = None
    attn_in.argtypes = [i64, i64, ptr, ptr, f32] + [i64] * 4 + [ptr] * 8 + [f32] + [ptr] * 5 + [ctypes.c_int]
    attn_out.argtypes = ([i64] * 5 + [ptr] * 3 + [i64] * 6 + [ptr, i64, f32, i64] + [ptr] * 4
                         + [f32, ptr, ptr, ctypes.c_int])
    ffn = library.moelab_moe_ffn_decode
    ffn.restype = None
    ffn.argtypes = ([i64, i64, ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int, i64, i64]
                    + [ptr] * 5 + [ctypes.c_int])
    return library


#: the dict ``os.environ`` reads and writes (POSIX: bytes to bytes), for ``switched_off``
_ENVIRON = getattr(os.environ, "_data", None)


def switched_off() -> bool:
    """Whether ``MOELAB_NATIVE_KERNELS=0`` turns the kernels off now. One dict lookup: a decode step asks once a
    layer, with the weights just streamed through the caches, where ``os.environ.get`` took some 10 µs."""
    if isinstance(_ENVIRON, dict):
        return _ENVIRON.get(b"MOELAB_NATIVE_KERNELS") == b"0"
    return os.environ.get("MOELAB_NATIVE_KERNELS", "1") == "0"


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (compiled on first use)."""
    global _library, _tried
    if switched_off():
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _library = _compile()
                except OSError:
                    _library = None
                _tried = True
    return _library


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a C argument, NULL for an absent one."""
    return None if t is None else t.data_ptr()


def usable(x: torch.Tensor, wgu_rows: torch.Tensor, act: str) -> bool:
    """Whether ``moe_routed`` runs this call: float32 CPU tensors, an activation it has, the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and wgu_rows.dtype == torch.float32
            and act in ACTIVATIONS and library() is not None)


def moe_routed(x: torch.Tensor, top: torch.Tensor, weights: torch.Tensor | None, wgu_rows: torch.Tensor,
               wd_rows: torch.Tensor, m: int, keep: int, act: str, skip_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, d]``: each token's selected experts (``top [T, k]``, scaled by ``weights [T, k]``) and, with
    ``skip_mean [E, d]``, the sum of the means of the experts it skips. ``wgu_rows``: the gate/up blocks as
    ``[E, d, 2m]`` contiguous storage; ``wd_rows``: the down blocks as ``[E, m, d]`` contiguous storage.
    Up to ``DECODE_TOKENS`` tokens the selected experts are shared among the threads (a decode step reads
    each selected block once); more tokens are shared among them (``moelab_moe_prefill``), or, where each selects
    this machine's ``dense_share`` of the experts or more, run every expert in two GEMMs (``_routed_dense``)."""
    T, k = top.shape
    x = x.contiguous()
    top = top.contiguous().to(torch.int64)
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
    if T > DECODE_TOKENS and k >= dense_share(T) * wgu_rows.shape[0]:
        return _routed_dense(x, top, weights, wgu_rows, wd_rows, m, keep, act, skip_mean)
    return _routed_pairs(x, top, weights, wgu_rows, wd_rows, m, keep, act, skip_mean)


def _routed_pairs(x: torch.Tensor, top: torch.Tensor, weights: torch.Tensor | None, wgu_rows: torch.Tensor,
                  wd_rows: torch.Tensor, m: int, keep: int, act: str, skip_mean: torch.Tensor | None) -> torch.Tensor:
    """``moe_routed`` by the selected (token, expert) pairs only: the decode or the prefill kernel (contiguous
    ``x``, int64 ``top`` and float32 ``weights`` as ``moe_routed`` makes them)."""
    (T, k), (E, d) = top.shape, wgu_rows.shape[:2]
    out = torch.empty(T, d, dtype=torch.float32)
    run = library().moelab_moe_decode if T <= DECODE_TOKENS else library().moelab_moe_prefill
    run(T, k, E, d, m, min(keep, m), ACTIVATIONS[act], x.data_ptr(), top.data_ptr(),
        _ptr(weights), wgu_rows.data_ptr(), wd_rows.data_ptr(), _ptr(skip_mean), out.data_ptr(),
        torch.get_num_threads())
    return out


#: the largest expert (its gate, up and down blocks, float32 bytes) a prefill runs in the native kernels: the pairs
#: kernel (``moelab_moe_prefill``) walks each selected expert's weights once per block of a few tokens, which pays
#: while an expert stays in a core's cache, and the two GEMMs of ``_routed_dense`` pay for their copy and ranking;
#: past it torch's GEMMs per expert (``sorted``) take the prefill. 512 tokens, 2 threads of a Zen 4 EPYC (1 MiB L2),
#: time over the dense FFN's: d 576, experts 0.08-1.3 MiB, native 0.32-0.45x against torch's 0.37-1.18x; d 2,048,
#: 1.6 MiB 0.98 against 0.99x, 6.3 MiB 0.70 against 0.49x; d 4,096 (an 8B shape), 5.5 MiB 0.72 against 0.63x (top-77
#: of 96 in two GEMMs, half the down rows: 1.32 against 0.94x), 22-88 MiB 1.32-2.38x against 0.41-0.52x
NATIVE_PREFILL_MAX_EXPERT_BYTES = 3 << 19


def runs_native_prefill(tokens: int, expert_size: int, d_model: int) -> bool:
    """Whether a call of ``tokens`` tokens that the native kernels could run (``moe_routed``) does: a decode step
    always, a prefill where its experts are no larger than ``NATIVE_PREFILL_MAX_EXPERT_BYTES`` (else torch's
    kernels run it)."""
    return tokens <= DECODE_TOKENS or 3 * expert_size * d_model * 4 <= NATIVE_PREFILL_MAX_EXPERT_BYTES


#: from this share of the routed experts selected per token, a prefill runs every expert in two GEMMs (the selected
#: ones' kept products between them, zeros for the rest); from NATIVE_LONG_TOKENS tokens on, from the lower share
#: (the GEMMs' copy of the weights into one matrix is paid once a call). These are the shares where a machine's own
#: are not known (``dense_shares`` measures them), from 96 twelve-neuron experts, half their down rows kept, 2
#: threads of an AVX-512 Xeon: at 512 tokens 12.6 ms by pairs against 14.2 ms in two GEMMs at top-62, 13.0 against
#: 13.0 at top-72; at 2,048 tokens 55.9 against 64.3 ms at top-48, 70.7 against 61.9 at top-62
NATIVE_DENSE_SHARE, NATIVE_DENSE_SHARE_LONG, NATIVE_LONG_TOKENS = 0.7, 0.55, 1024

#: the layer ``measure_dense_shares`` times: ``--recipe best``'s experts on the default model (d_model, experts,
#: neurons each, of which half kept), half of them selected, at half and twice NATIVE_LONG_TOKENS tokens
CALIBRATION_LAYER = {"d_model": 576, "experts": 96, "expert_size": 12, "keep": 6}
CALIBRATION_TOKENS = (NATIVE_LONG_TOKENS // 2, 2 * NATIVE_LONG_TOKENS)
_shares: dict[int, tuple[float, float]] = {}
_shares_lock = threading.Lock()


def measure_dense_shares(rounds: int = 5) -> tuple[float, float]:
    """This machine's (``NATIVE_DENSE_SHARE``, ``NATIVE_DENSE_SHARE_LONG``): at each of ``CALIBRATION_TOKENS``, the
    pairs kernel and the two GEMMs run ``CALIBRATION_LAYER`` with half its experts selected, interleaved for
    ``rounds`` rounds. The pairs' time grows with the share selected and the GEMMs' does not (they compute every
    expert), so they cost the same from share 0.5 · GEMMs' median / pairs' median (above 1: the pairs kernel always
    wins). Where the BLAS is fast against the kernels the GEMMs take over early (the Xeon above: 0.70 and 0.55);
    on a 2-vCPU Zen 4 EPYC the pairs kernel ran 86 of 96 experts in 2,048 tokens 1.4x faster than the GEMMs."""
    gen = torch.Generator().manual_seed(0)
    E, d, m, keep = (CALIBRATION_LAYER[k] for k in ("experts", "d_model", "expert_size", "keep"))
    wgu, wd = torch.randn(E, d, 2 * m, generator=gen) / 24, torch.randn(E, m, d, generator=gen) / 35
    out = []
    for tokens in CALIBRATION_TOKENS:
        x = torch.randn(tokens, d, generator=gen)
        top = torch.rand(tokens, E, generator=gen).argsort(dim=1)[:, : E // 2].contiguous()
        calls = [lambda f=f: f(x, top, None, wgu, wd, m, keep, "silu", None) for f in (_routed_pairs, _routed_dense)]
        seconds: list[list[float]] = [[], []]
        for call in calls:  # untimed: the first call of each allocates and faults its buffers in
            call()
        for _ in range(rounds):
            for call, times in zip(calls, seconds):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
        out.append(round(0.5 * statistics.median(seconds[1]) / statistics.median(seconds[0]), 3))
    return out[0], out[1]


def dense_shares() -> tuple[float, float]:
    """(``NATIVE_DENSE_SHARE``, ``NATIVE_DENSE_SHARE_LONG``) as this machine has them: measured once per kernel build
    (source and CPU) and thread count (``measure_dense_shares``, about 0.6 s), kept beside the build as JSON and
    read from there by later processes; the fixed shares where the kernels are not built."""
    threads = torch.get_num_threads()
    if (known := _shares.get(threads)) is not None:
        return known
    with _shares_lock:
        if threads not in _shares:
            _shares[threads] = _stored_shares(threads)
    return _shares[threads]


def _stored_shares(threads: int) -> tuple[float, float]:
    if library() is None:
        return NATIVE_DENSE_SHARE, NATIVE_DENSE_SHARE_LONG
    path = _cache_dir() / f"moelab_native-{build_key()}-shares-{threads}.json"
    try:
        short, long = json.loads(path.read_text())["shares"]
        return float(short), float(long)
    except (OSError, ValueError, KeyError, TypeError):  # not measured yet here (or a file cut short)
        pass
    shares = measure_dense_shares()
    try:  # staged as ``_compile`` stages the library: a failed write leaves nothing behind
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            staged = Path(tmp) / path.name
            staged.write_text(json.dumps({"shares": shares, "tokens": CALIBRATION_TOKENS, "layer": CALIBRATION_LAYER,
                                          "threads": threads}))
            os.replace(staged, path)
    except OSError:  # a cache this user may read but not write: measured again by the next process
        pass
    return shares


def dense_share(tokens: int) -> float:
    """The share of the routed experts selected per token from which a prefill of ``tokens`` tokens runs every expert
    in two GEMMs (``dense_shares``)."""
    short, long = dense_shares()
    return short if tokens <= NATIVE_LONG_TOKENS else long


def _routed_dense(x: torch.Tensor, top: torch.Tensor, weights: torch.Tensor | None, wgu_rows: torch.Tensor,
                  wd_rows: torch.Tensor, m: int, keep: int, act: str, skip_mean: torch.Tensor | None) -> torch.Tensor:
    """``moe_routed`` for many tokens that select most experts: the gate and up rows of every expert in one GEMM,
    each token's selected experts' kept products (``moelab_select_keep``), every expert's down rows in one GEMM."""
    (T, k), (E, d) = top.shape, wgu_rows.shape[:2]
    h = x @ wgu_rows.permute(1, 0, 2).reshape(d, E * 2 * m)  # [E, d, 2m] storage -> [d, E·2m]: one copy a call
    kept = torch.empty(T, E * m, dtype=torch.float32)
    library().moelab_select_keep(T, E, m, k, min(keep, m), ACTIVATIONS[act], h.data_ptr(), top.data_ptr(),
                                 _ptr(weights), kept.data_ptr(), torch.get_num_threads())
    out = kept @ wd_rows.reshape(E * m, d)
    if skip_mean is not None:
        out += skipped_means(top, skip_mean)
    return out


def skipped_means(top: torch.Tensor, skip_mean: torch.Tensor) -> torch.Tensor:
    """``[T, d]``: Σ over the experts each token skips of their means (``skip_mean [E, d]``; ``top [T, k]`` the
    selected ones), as (Σ_e μ_e) − Σ_{e∈top} μ_e: k + 1 additions per token, summed as they are read
    (``embedding_bag``; ``skip_mean[top]`` wrote [T, k, d] first, 4 ms against 200 ms a layer for 1,024 tokens at
    top-91 of 128)."""
    return skip_mean.sum(0) - torch.nn.functional.embedding_bag(top, skip_mean, mode="sum")


def glu_keep(gate: torch.Tensor, up: torch.Tensor, keep: int, act: str) -> torch.Tensor:
    """``act(gate) · up`` (``[T, n]`` each) with all but each row's ``keep`` entries of largest magnitude set to 0:
    ``moelab_kernels.keep_largest`` of a dense GLU's products (the shared expert's), one call where torch takes six.
    A decode step's few rows run on one thread: a fork of the thread pool would cost more than it saves."""
    T, n = gate.shape
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(T, n, dtype=torch.float32)
    threads = 1 if T <= DECODE_TOKENS else torch.get_num_threads()
    library().moelab_glu_keep(T, n, min(keep, n), ACTIVATIONS[act], gate.data_ptr(), up.data_ptr(), out.data_ptr(), threads)
    return out


#: the combines ``moe_ffn_decode`` computes (``MoeRouter.weights``), as the kernel's code
FUSED_COMBINES = {"sum": 0, "weighted": 1, "normalized": 2}
#: the most routed experts ``moe_ffn_decode`` ranks (its ranking compares every pair of scores)
FUSED_MAX_EXPERTS = 512


class FusedDecode:
    """``moe_ffn_decode`` for one layer's weights, its arguments checked and converted once: a decode step's
    Python work per layer is then two allocations and the call (the arguments built per call cost some 40 µs a
    layer against the call's few hundred, ``MoeFFN._fused_decode`` keeps one per layer). It holds pointers, not the
    tensors: the caller keeps them alive and builds a new one when any is replaced."""

    def __init__(self, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, shared_keep: int,
                 router: tuple[torch.Tensor, torch.Tensor | None], top_k: int, combine: str, wgu_rows: torch.Tensor,
                 wd_rows: torch.Tensor, m: int, keep: int, act: str, skip_mean: torch.Tensor | None = None) -> None:
        (sg, su, sd), ds = (shared, shared[0].shape[0]) if shared is not None else ((None, None, None), 0)
        rw, rb = router
        self.top_k, self.act = top_k, ACTIVATIONS[act]
        self._run = library().moelab_moe_ffn_decode
        middle = (ds, min(shared_keep, ds), _ptr(sg), _ptr(su), _ptr(sd), wgu_rows.shape[0], top_k, rw.data_ptr(),
                  _ptr(rb), FUSED_COMBINES[combine], m, min(keep, m), wgu_rows.data_ptr(), wd_rows.data_ptr(),
                  _ptr(skip_mean))
        # as ctypes values once, not converted at every call
        self._middle = tuple(kind(v) for kind, v in zip(self._run.argtypes[4:], middle))

    @classmethod
    def shared_only(cls, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, shared_keep: int, act: str,
                    d_model: int) -> "FusedDecode":
        """The call of a block that selects no expert (top-0, all of it shared, or a dense FFN): its shared expert
        alone (None: the block adds nothing), no router read, no routed expert (E = 0 to the kernel)."""
        return cls(shared, shared_keep, (torch.empty(0, d_model), None), 0, "sum", torch.empty(0, d_model, 0),
                   torch.empty(0, 0, d_model), 0, 0, act)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output shaped as x [..., d], selected experts [T, top_k])``."""
        x = x.contiguous()
        d = x.shape[-1]
        T = x.numel() // d
        out = torch.empty_like(x)
        top = torch.empty(T, self.top_k, dtype=torch.int64)
        self._run(T, d, self.act, x.data_ptr(), *self._middle, out.data_ptr(), top.data_ptr(), torch.get_num_threads())
        return out, top


def moe_ffn_decode(x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, shared_keep: int,
                   router: tuple[torch.Tensor, torch.Tensor | None], top_k: int, combine: str, wgu_rows: torch.Tensor,
                   wd_rows: torch.Tensor, m: int, keep: int, act: str,
                   skip_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole ``MoeFFN`` at a decode step (``[T, d]``, T <= ``DECODE_TOKENS``), one call: the shared expert
    (``shared``: gate and up ``[d_shared, d]`` contiguous, down as ``[d_shared, d]`` storage; its ``shared_keep``
    largest products kept), a linear router (``router``: weight ``[E, d]`` contiguous and offset ``[E]`` or None),
    each token's ``top_k`` experts, their ``combine`` weights (``FUSED_COMBINES``) and the routed experts as
    ``moe_routed`` takes them. Returns the output and the selected experts ``[T, top_k]``, best first (ties: the
    lower index). Scores are summed in another order than torch's GEMM, so an expert whose score ties the k-th
    to float rounding may be selected where torch selects its rival."""
    return FusedDecode(shared, shared_keep, router, top_k, combine, wgu_rows, wd_rows, m, keep, act, skip_mean)(x)


def linear_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, d] @ weight.T (+ bias)`` for a decode step (``moelab_linear_decode``): ``weight [n, d]`` contiguous, as
    ``nn.Linear`` stores it, its rows shared among torch's threads."""
    T, d = x.shape
    x = x.contiguous()
    out = torch.empty(T, weight.shape[0], dtype=torch.float32)
    library().moelab_linear_decode(T, d, weight.shape[0], x.data_ptr(), weight.data_ptr(),
                                   _ptr(bias), out.data_ptr(), torch.get_num_threads())
    return out


def attention_in(x: torch.Tensor, norm: tuple[torch.Tensor, float], head_dim: int,
                 weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
                 cos: torch.Tensor, sin: torch.Tensor,
                 head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> tuple[torch.Tensor, ...]:
    """A decode step's attention inputs in one call (``moelab_attn_in``): ``x [N, d]`` normalised (``norm``: the
    RMSNorm's weight and eps), projected by the q, k and v ``weights`` (``[n, d]`` contiguous, as ``nn.Linear`` stores
    them; ``biases`` or None), each head of q and k RMS-normalised (``head_norms``: Qwen3's q and k norm weights
    ``[head_dim]`` and their eps; None for none), the rotary embedding (``cos``, ``sin`` ``[N, head_dim]``
    contiguous) applied to q and k. Returns q, k, v ``[N, n]``."""
    N, d = x.shape
    x = x.contiguous()
    q, k, v = (torch.empty(N, w.shape[0], dtype=torch.float32) for w in weights)
    library().moelab_attn_in(N, d, x.data_ptr(), norm[0].data_ptr(), norm[1], head_dim, q.shape[1], k.shape[1],
                             v.shape[1], *map(_ptr, weights), *map(_ptr, biases),
                             *map(_ptr, (head_norms or (None,) * 2)[:2]),
                             head_norms[2] if head_norms else 0.0, cos.data_ptr(), sin.data_ptr(),
                             q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.get_num_threads())
    return q, k, v


def attention_out(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  out_proj: tuple[torch.Tensor, torch.Tensor | None], x: torch.Tensor,
                  norm: tuple[torch.Tensor, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's attention and what follows it up to the FFN, in one call (``moelab_attn_out``): each sequence's
    one query ``q [B, heads · hd]`` over its cache (``keys``, ``values`` ``[B, kv heads, L, hd]``, the last dim
    contiguous; ``mask`` a bool ``[B or 1, 1, 1, L]`` with a contiguous last dim, True where a key may be attended,
    or None for all), ``scale``, the output projection (``out_proj``: weight ``[d, heads · hd]`` contiguous, bias or
    None) added to the residual ``x [B, d]``, and that sum RMS-normalised (``norm``). Returns ``(x + o, its norm)``."""
    B, hk, L, hd = keys.shape
    hq = q.shape[1] // hd
    wo, bo = out_proj
    d = wo.shape[0]
    q, x = q.contiguous(), x.contiguous()
    hs, xn = torch.empty(B, d, dtype=torch.float32), torch.empty(B, d, dtype=torch.float32)
    mstride = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    library().moelab_attn_out(B, hq, hk, hd, L, q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0),
                              keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
                              _ptr(mask), mstride, scale, d, wo.data_ptr(), _ptr(bo), x.data_ptr(), norm[0].data_ptr(),
                              norm[1], hs.data_ptr(), xn.data_ptr(), torch.get_num_threads())
    return hs, xn


def teal_decode(x: torch.Tensor, below_in: float, below_mid: float, gate_rows: torch.Tensor, up_rows: torch.Tensor,
                down_rows: torch.Tensor, act: str) -> torch.Tensor:
    """TEAL's FFN for a decode step of ``x [T, d]`` in one call (``moelab_teal_decode``): ``gate_rows`` and ``up_rows``
    ``[d, D]``, ``down_rows`` ``[D, d]``, each contiguous (the weights in ``[in, out]`` storage, transposed); entries
    with ``|x| <= below_in`` and ``|h| <= below_mid`` zeroed, only the weight rows some token of the call needs read."""
    T, d = x.shape
    x = x.contiguous()
    out = torch.empty(T, d, dtype=torch.float32)
    library().moelab_teal_decode(T, d, gate_rows.shape[1], ACTIVATIONS[act], x.data_ptr(), below_in, below_mid,
                                 gate_rows.data_ptr(), up_rows.data_ptr(), down_rows.data_ptr(), out.data_ptr(),
                                 torch.get_num_threads())
    return out
