"""A native CPU decode kernel for the routed experts: one call per layer and step instead of some twenty
torch operations. Part of the exported runtime; it needs only a C compiler at run time, and without one
(or on anything but float32 on the CPU) the torch kernels run as before.

Why: a decode step of 128 twelve-neuron experts reads little memory per layer (the selected blocks), so
the fixed cost of each torch call (dispatch, a tensor allocated per intermediate, a Python frame) is a
large share of it: on the default model's ``--recipe best`` conversion the MoE layers' operators other than
the products took about as long as the products of the routed experts themselves. ``moe_decode`` does what
``moelab_kernels.gather_rows`` does, with the skipped-expert compensation folded in, for every token and
selected expert of a call:

    h = x · W_gu[e]  (the expert's [d_model, 2m] block, rows read in storage order)
    g = act(h[:m]) · h[m:], the ``keep`` entries of largest |g| kept (``MoeFFN``'s down_keep)
    out += weight · Σ_kept g_r · W_down[e, r]  (+ Σ_{e not selected} μ_e under compensation)

The source is compiled once per machine and source text (``-O3 -march=native -fopenmp``) into the user's
cache (``MOELAB_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/moelab/kernels`` or ``~/.cache/moelab/kernels``),
written atomically, and loaded with ctypes. It links the OpenMP runtime torch itself loaded
(``libgomp.so.1``), so one thread pool serves both. ``MOELAB_NATIVE_KERNELS=0`` turns it off.

Choices: ties at the ``keep``-th largest |g| keep the lower neuron index (torch's topk may keep
either: float products tie with probability about 0); sums run in a different order than torch's, so
results agree to float32 rounding (``tests/engine/test_native_kernel.py`` checks 1e-5 relative).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
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

static inline float act_fn(float v, int act) {
    switch (act) {
    case 0: return v / (1.0f + expf(-v));
    case 1: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case 2: return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    default: return v > 0.0f ? v : 0.0f;
    }
}

/* the keep-th largest of a[0..n) (a is reordered): quickselect */
static float kth_largest(float *a, int64_t n, int64_t keep) {
    int64_t lo = 0, hi = n - 1, want = keep - 1;
    while (lo < hi) {
        float pivot = a[(lo + hi) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j; else if (want >= i) lo = i; else break;
    }
    return a[want];
}

/* g = act(h[:m]) * h[m:] into h[:m], all but its keep entries of largest |g| set to 0 (ties: the lower index
   keeps), each kept one times scale */
static void kept_products(float *h, float *mag, int64_t m, int64_t keep, int act, float scale) {
    for (int64_t r = 0; r < m; r++) h[r] = act_fn(h[r], act) * h[m + r];
    float thr = -1.0f;
    int64_t ties = 0;
    if (keep < m) {
        for (int64_t r = 0; r < m; r++) mag[r] = fabsf(h[r]);
        thr = kth_largest(mag, m, keep);
        int64_t above = 0;
        for (int64_t r = 0; r < m; r++) above += fabsf(h[r]) > thr;
        ties = keep - above;
    }
    for (int64_t r = 0; r < m; r++) {
        const float a = fabsf(h[r]);
        h[r] = (a < thr || (a == thr && ties-- <= 0)) ? 0.0f : h[r] * scale;
    }
}

/* one (token, expert) pair's kept products, each times its row of the expert's down block wde, added into acct */
static void add_down(float *h, float *mag, int64_t m, int64_t keep, int act, float scale,
                     const float *wde, int64_t d, float *acct) {
    kept_products(h, mag, m, keep, act, scale);
    for (int64_t r = 0; r < m; r++) {
        const float coef = h[r];
        if (coef == 0.0f) continue;
        const float *drow = wde + r * d;
        for (int64_t i = 0; i < d; i++) acct[i] += coef * drow[i];
    }
}

/* a dense GLU's kept products (the shared expert's down_keep): out [T,n] = act(gate) * up ([T,n] each), all but
   each row's keep entries of largest magnitude set to 0 */
void moelab_glu_keep(int64_t T, int64_t n, int64_t keep, int act, const float *gate, const float *up, float *out) {
    float *buf = malloc(sizeof(float) * 2 * n), *mag = malloc(sizeof(float) * n);
    for (int64_t t = 0; t < T; t++) {
        memcpy(buf, gate + t * n, sizeof(float) * n);
        memcpy(buf + n, up + t * n, sizeof(float) * n);
        kept_products(buf, mag, n, keep, act, 1.0f);
        memcpy(out + t * n, buf, sizeof(float) * n);
    }
    free(buf); free(mag);
}

/* x [T,d]; top [T,k]; wts [T,k] or NULL; wgu [E,d,2m]; wd [E,m,d]; mu [E,d] or NULL; out [T,d].
   Expert-major: the pairs are grouped by expert, so a block that several tokens selected is read from
   memory once (a batch of 8 tokens selects most experts of a layer) and re-read from cache. */
void moelab_moe_decode(int64_t T, int64_t k, int64_t E, int64_t d, int64_t m, int64_t keep, int act,
                       const float *x, const int64_t *top, const float *wts, const float *wgu,
                       const float *wd, const float *mu, float *out, int nthreads) {
    const int64_t m2 = 2 * m, P = T * k;
    int64_t *start = calloc(E + 1, sizeof(int64_t)), *pairs = malloc(sizeof(int64_t) * P);
    for (int64_t p = 0; p < P; p++) start[top[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t *fill = malloc(sizeof(int64_t) * E);
    memcpy(fill, start, sizeof(int64_t) * E);
    for (int64_t p = 0; p < P; p++) pairs[fill[top[p]]++] = p;  /* token-ordered within an expert */
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
        float *h = malloc(sizeof(float) * T * m2);
        float *mag = malloc(sizeof(float) * m);
        const float **xs = malloc(sizeof(float *) * T);
        #pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < n_used; u++) {
            const int64_t e = fill[u], n = start[e + 1] - start[e];
            const int64_t *own = pairs + start[e];
            const float *W = wgu + e * d * m2;
            if (u + 1 < n_used)  /* the next block's first lines, while this one is computed */
                for (int64_t b = 0; b < 64 * 16 && b < d * m2; b += 16) __builtin_prefetch(wgu + fill[u + 1] * d * m2 + b);
            for (int64_t q = 0; q < n; q++) xs[q] = x + (own[q] / k) * d;
            memset(h, 0, sizeof(float) * n * m2);
            for (int64_t i = 0; i < d; i++) {
                const float *row = W + i * m2;
                for (int64_t q = 0; q < n; q++) {
                    const float xi = xs[q][i];
                    float *hq = h + q * m2;
                    for (int64_t c = 0; c < m2; c++) hq[c] += xi * row[c];
                }
            }
            for (int64_t q = 0; q < n; q++)
                add_down(h + q * m2, mag, m, keep, act, wts ? wts[own[q]] : 1.0f, wd + e * m * d, d,
                         acc + (own[q] / k) * d);
        }
        if (mu) {  /* the means of the experts each token skips */
            #pragma omp for schedule(static) nowait
            for (int64_t e = 0; e < E; e++) {
                const float *row = mu + e * d;
                for (int64_t t = 0; t < T; t++) {
                    int chosen = 0;
                    for (int64_t j = 0; j < k; j++) chosen |= top[t * k + j] == e;
                    if (chosen) continue;
                    float *acct = acc + t * d;
                    for (int64_t i = 0; i < d; i++) acct[i] += row[i];
                }
            }
        }
        free(h); free(mag); free(xs);
    }
    memcpy(out, accs, sizeof(float) * T * d);
    for (int th = 1; th < used; th++)
        for (int64_t i = 0; i < T * d; i++) out[i] += accs[(size_t)th * T * d + i];
    free(accs); free(start); free(pairs); free(fill);
}
"""

_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    if root := os.environ.get("MOELAB_KERNEL_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moelab" / "kernels"


def _machine_key() -> str:
    """The source, the flags and this CPU (``-march=native`` code may not run on another one)."""
    cpu = ""
    with open("/proc/cpuinfo") as f:  # Linux: the model and flags of the first processor
        for line in f:
            if line.startswith(("model name", "flags")):
                cpu += line
            if line.strip() == "":
                break
    text = "\n".join([_SOURCE, " ".join(_FLAGS), platform.machine(), cpu])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compile() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    target = _cache_dir() / f"moe_decode-{_machine_key()}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, lib = Path(tmp) / "moe_decode.c", Path(tmp) / "moe_decode.so"
            src.write_text(_SOURCE)
            done = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(lib), "-lm"], capture_output=True)
            if done.returncode:
                return None
            os.replace(lib, target)
    library = ctypes.CDLL(str(target))
    decode, glu = library.moelab_moe_decode, library.moelab_glu_keep
    decode.restype = glu.restype = None
    decode.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int]
    glu.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3
    return library


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (compiled on first use)."""
    global _library, _tried
    if os.environ.get("MOELAB_NATIVE_KERNELS", "1") == "0":
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


def usable(x: torch.Tensor, wgu_rows: torch.Tensor, act: str) -> bool:
    """Whether ``moe_decode`` runs this call: float32 CPU tensors, an activation it has, the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and wgu_rows.dtype == torch.float32
            and act in ACTIVATIONS and library() is not None)


def moe_decode(x: torch.Tensor, top: torch.Tensor, weights: torch.Tensor | None, wgu_rows: torch.Tensor,
               wd_rows: torch.Tensor, m: int, keep: int, act: str, skip_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, d]``: each token's selected experts (``top [T, k]``, scaled by ``weights [T, k]``) and, with
    ``skip_mean [E, d]``, the sum of the means of the experts it skips. ``wgu_rows``: the gate/up blocks as
    ``[E, d, 2m]`` contiguous storage; ``wd_rows``: the down blocks as ``[E, m, d]`` contiguous storage."""
    T, k = top.shape
    E, d = wgu_rows.shape[0], wgu_rows.shape[1]
    x = x.contiguous()
    top = top.contiguous().to(torch.int64)
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
    out = torch.empty(T, d, dtype=torch.float32)
    library().moelab_moe_decode(T, k, E, d, m, min(keep, m), ACTIVATIONS[act], x.data_ptr(), top.data_ptr(),
                                None if weights is None else weights.data_ptr(), wgu_rows.data_ptr(),
                                wd_rows.data_ptr(), None if skip_mean is None else skip_mean.data_ptr(),
                                out.data_ptr(), torch.get_num_threads())
    return out


def glu_keep(gate: torch.Tensor, up: torch.Tensor, keep: int, act: str) -> torch.Tensor:
    """``act(gate) · up`` (``[T, n]`` each) with all but each row's ``keep`` entries of largest magnitude set to 0:
    ``moelab_kernels.keep_largest`` of a dense GLU's products (the shared expert's), one call where torch takes six.
    Single-threaded: for a decode step's few rows, a fork of the thread pool costs more than it saves."""
    T, n = gate.shape
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(T, n, dtype=torch.float32)
    library().moelab_glu_keep(T, n, min(keep, n), ACTIVATIONS[act], gate.data_ptr(), up.data_ptr(), out.data_ptr())
    return out
