"""MoE runtime: MoeFFN / AbsTopKGLU against dense and naive references, export round trips."""

from __future__ import annotations

import copy
import filecmp
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN

from moelab.engine.runtime import modeling_moelab, moelab_kernels
from moelab.engine.runtime.export import AUTO_MAP, RUNTIME_FILES, build_moe_model, export_model, load_exported
from moelab.engine.runtime.modeling_moelab import (
    MoeFFN,
    MoelabConfig,
    MoelabForCausalLM,
    build_layer_module,
    layer_spec,
)
from moelab.engine.core.slicing import abstopk_from_dense, expert_rows, moe_from_dense
from moelab.engine.models import load_model

ROUTERS = ("centroid", "representative", "gate_mass", "softmax")


def dense_glu(x, wg, wu, wd, act="silu"):
    return F.linear(ACT2FN[act](F.linear(x, wg)) * F.linear(x, wu), wd)


def random_glu(d_model, d_ffn, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = d_model ** -0.5
    wg = torch.randn(d_ffn, d_model, generator=g) * s
    wu = torch.randn(d_ffn, d_model, generator=g) * s
    wd = torch.randn(d_model, d_ffn, generator=g) * d_ffn ** -0.5
    return wg, wu, wd


def partition(d_ffn, d_shared, n_experts, m, seed=0, use_all=True):
    perm = torch.randperm(d_ffn, generator=torch.Generator().manual_seed(seed))
    shared, routed = perm[:d_shared], perm[d_shared : d_shared + n_experts * m].reshape(n_experts, m)
    if use_all:
        assert d_shared + n_experts * m == d_ffn
    return shared, routed


def make_moe(d_model=32, d_ffn=48, d_shared=8, n_experts=5, top_k=2, router="centroid", combine="sum",
             act="silu", seed=0, **kw):
    m = (d_ffn - d_shared) // n_experts if n_experts else 0
    wg, wu, wd = random_glu(d_model, d_ffn, seed)
    shared, routed = partition(d_ffn, d_shared, n_experts, m, seed, use_all=False)
    extra = {}
    if router == "representative" and n_experts:  # CMoE: one representative neuron per expert
        rep = routed[:, 0]
        extra = {"router_gate": wg[rep], "router_up": wu[rep]}
    mod = moe_from_dense(wg, wu, wd, act, shared, routed, top_k, router, combine, **extra, **kw)
    return mod, (wg, wu, wd), (shared, routed)


# ------------------------------------------------------------------ naive per-token reference


def reference_moe(mod: MoeFFN, x: torch.Tensor):
    """Loop over tokens in float64: returns (output, chosen expert sets, ambiguous-token mask)."""
    act = mod.act_fn
    P = {n: p.detach().double() for n, p in mod.named_parameters()}
    P.update(zip(("experts_gate", "experts_up", "experts_down"), (t.detach().double() for t in expert_rows(mod))))
    xt = x.reshape(-1, mod.d_model).double()
    out = torch.zeros_like(xt)
    chosen, ambiguous = [], []
    for t in range(xt.shape[0]):
        v = xt[t]
        y = torch.zeros(mod.d_model, dtype=torch.float64)
        if mod.d_shared:
            h = act(P["shared_gate.weight"] @ v) * (P["shared_up.weight"] @ v)
            y += P["shared_down.weight"] @ h
        E = mod.n_routed
        if mod.router.kind in ("centroid", "softmax"):
            s = P["router_weight"] @ v
        elif mod.router.kind == "representative":
            s = act(P["router_gate"] @ v) * (P["router_up"] @ v)
        else:
            s = torch.stack([act(P["experts_gate"][e] @ v).abs().sum() for e in range(E)])
        k = mod.top_k
        ss = torch.sort(s, descending=True).values
        ambiguous.append(bool(0 < k < E and (ss[k - 1] - ss[k]).abs() < 1e-5))
        sel = torch.topk(s, k).indices.tolist() if k < E else list(range(E))
        chosen.append(set(sel))
        p = torch.softmax(s, 0)
        for e in sel:
            h = act(P["experts_gate"][e] @ v) * (P["experts_up"][e] @ v)
            o = P["experts_down"][e] @ h
            y += o * p[e] if mod.combine == "weighted" else o
        out[t] = y
    return out.reshape(x.shape), chosen, torch.tensor(ambiguous).reshape(x.shape[:-1])


# ------------------------------------------------------------------ (a) all experts == dense


SHAPES = [  # d_model, d_ffn, d_shared, n_experts, act
    (32, 48, 8, 5, "silu"),
    (16, 64, 0, 8, "silu"),  # no shared expert
    (24, 40, 40, 0, "silu"),  # all shared, no routed experts
    (20, 36, 12, 3, "gelu_pytorch_tanh"),
    (8, 8, 0, 8, "silu"),  # one neuron per expert
]


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_all_experts_active_equals_dense(router, shape):
    d_model, d_ffn, d_shared, E, act = shape
    mod, (wg, wu, wd), _ = make_moe(d_model, d_ffn, d_shared, E, E, router, "sum", act, seed=d_ffn)
    assert mod.d_shared + mod.n_routed * mod.expert_size == d_ffn  # a full partition
    x = torch.randn(3, 7, d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mod(x), dense_glu(x, wg, wu, wd, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router", ROUTERS)
def test_top_k_zero_is_shared_expert_only(router):
    mod, (wg, wu, wd), (shared, _) = make_moe(32, 48, 8, 5, 0, router)
    x = torch.randn(9, 32)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), dense_glu(x, wg[shared], wu[shared], wd[:, shared]), rtol=1e-5, atol=1e-5)
    no_shared, *_ = make_moe(32, 48, 0, 6, 0, router)
    assert torch.equal(no_shared(x), torch.zeros_like(x))


def test_pruned_neurons_are_left_out():
    """Neurons in neither the shared nor a routed expert are dropped (a static prune)."""
    wg, wu, wd = random_glu(16, 40)
    keep_shared, keep_routed = torch.tensor([3, 1]), torch.tensor([[0, 5, 7], [9, 2, 11]])
    mod = moe_from_dense(wg, wu, wd, "silu", keep_shared, keep_routed, 2, "centroid")
    x = torch.randn(4, 16)
    keep = torch.cat([keep_shared, keep_routed.reshape(-1)])
    with torch.no_grad():
        torch.testing.assert_close(mod(x), dense_glu(x, wg[keep], wu[keep], wd[:, keep]), rtol=1e-5, atol=1e-5)


def test_from_dense_validates_partition():
    wg, wu, wd = random_glu(8, 12)
    with pytest.raises(ValueError, match="twice"):
        moe_from_dense(wg, wu, wd, "silu", [0, 1], [[1, 2], [3, 4]], 1, "centroid")
    with pytest.raises(ValueError, match="range"):
        moe_from_dense(wg, wu, wd, "silu", [], [[0, 12]], 1, "centroid")
    with pytest.raises(ValueError, match="top_k"):
        moe_from_dense(wg, wu, wd, "silu", [], [[0, 1], [2, 3]], 3, "centroid")
    with pytest.raises(ValueError, match="router"):
        moe_from_dense(wg, wu, wd, "silu", [], [[0, 1], [2, 3]], 1, "nope")


def test_numpy_indices_and_centroid_router_default():
    np = pytest.importorskip("numpy")
    wg, wu, wd = random_glu(8, 12)
    routed = np.arange(12).reshape(3, 4)
    mod = moe_from_dense(wg, wu, wd, "silu", np.zeros(0, dtype=np.int64), routed, 1, "centroid")
    torch.testing.assert_close(mod.router_weight.detach(), wg.reshape(3, 4, 8).mean(1))  # EW Eq. 9


# ------------------------------------------------------------------ (b) top-k == naive reference


@pytest.mark.parametrize("dispatch", ["auto", "loop", "padded"])
@pytest.mark.parametrize("combine", ["sum", "weighted"])
@pytest.mark.parametrize("router", ROUTERS)
def test_top_k_dispatch_matches_per_token_reference(router, combine, dispatch):
    mod, *_ = make_moe(32, 64, 8, 7, 3, router, combine, seed=3)
    mod.dispatch = dispatch
    x = torch.randn(4, 13, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = mod(x)
    ref, _, ambiguous = reference_moe(mod, x)
    assert ambiguous.float().mean() < 0.1
    ok = ~ambiguous
    torch.testing.assert_close(y[ok], ref[ok].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("combine", ["sum", "weighted"])
def test_top_k_equal_E_with_weights_matches_reference(combine):
    mod, *_ = make_moe(16, 40, 4, 6, 6, "softmax", combine)
    x = torch.randn(11, 16)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), reference_moe(mod, x)[0].float(), rtol=1e-4, atol=1e-5)


def test_softmax_router_is_trainable():
    mod, *_ = make_moe(16, 40, 4, 6, 2, "softmax", "weighted")
    x = torch.randn(10, 16)
    mod(x).pow(2).sum().backward()
    for name in ("router_weight", "experts.gate_up_proj", "experts.down_proj", "shared_gate.weight"):
        grad = mod.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_loop_and_padded_dispatch_agree_with_unbalanced_routing():
    mod, *_ = make_moe(32, 72, 0, 8, 2, "centroid", seed=7)
    with torch.no_grad():
        mod.router_weight[0] += 5 * mod.router_weight[0].sign()  # expert 0 takes most tokens
        x = torch.randn(64, 32)
        outs = []
        for dispatch in ("loop", "padded", "auto"):
            mod.dispatch = dispatch
            outs.append(mod(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ (b2) fast experts kernels == reference loop

FAST_IMPLS = ("grouped_mm", "sorted", "gather", "dense", "triton", "auto")
ALL_ROUTERS = ("centroid", "representative", "gate_mass", "softmax", "ridge")
COMBINES = ("sum", "weighted", "normalized", "scaled")


def kernel_moe(router, combine, d_model=32, d_ffn=72, d_shared=8, n_experts=16, top_k=3, seed=0, **kw):
    """A MoeFFN with expert_size 4 (grouped_mm-compatible strides); scaled combine with nonzero u and b."""
    if router == "ridge":
        kw["router_offset"] = torch.randn(n_experts, generator=torch.Generator().manual_seed(seed))
    mod, *_ = make_moe(d_model, d_ffn, d_shared, n_experts, top_k, router, "sum" if combine == "scaled" else combine,
                       seed=seed, **kw)
    if combine == "scaled":
        mod.use_scaled_combine()
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            mod.router_scale.copy_(torch.randn(n_experts, generator=g))
            mod.router_bias.copy_(0.01 * torch.randn(n_experts, generator=g))
    return mod


def run_impl(mod, x, impl):
    mod.experts_impl = impl
    try:
        with torch.no_grad():
            return mod(x)
    finally:
        mod.experts_impl = "auto"


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("router", ALL_ROUTERS)
def test_fast_kernels_equal_the_reference_loop(router, combine):
    """Issue 12: every fast experts kernel == the reference loop (fp32, 1e-5), on a batch where
    some experts get no token, on one token, and with every expert active (top_k == n_routed)."""
    mod = kernel_moe(router, combine)
    g = torch.Generator().manual_seed(7)
    cases = {"batch": torch.randn(2, 9, 32, generator=g), "one token": torch.randn(1, 32, generator=g),
             "three tokens": torch.randn(3, 32, generator=g)}
    for name, x in cases.items():
        ref = run_impl(mod, x, "loop")
        seen = []
        mod.recorder = seen.append
        run_impl(mod, x, "loop")
        mod.recorder = None
        if name == "three tokens":
            assert seen[0].unique().numel() < mod.n_routed, "some experts are empty"
        for impl in FAST_IMPLS:
            torch.testing.assert_close(run_impl(mod, x, impl), ref, rtol=1e-5, atol=1e-5, msg=f"{impl} on {name}")
    every = kernel_moe(router, combine, top_k=16)
    x = cases["batch"]
    ref = run_impl(every, x, "loop")
    for impl in FAST_IMPLS:
        torch.testing.assert_close(run_impl(every, x, impl), ref, rtol=1e-5, atol=1e-5)
    if combine in ("sum", "weighted") and router in ROUTERS:  # the kinds the per-token reference knows
        torch.testing.assert_close(ref, reference_moe(every, x)[0].float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("router", ALL_ROUTERS)
def test_accelerator_decode_path_equals_the_loop_on_cpu(router, monkeypatch):
    """``gather_pairs`` (what ``gather`` runs on accelerators) checked where CI runs: both storage
    layouts of gate_up_proj (gate_mass keeps row-major), weighted and unweighted."""
    for combine in ("sum", "weighted"):
        mod = kernel_moe(router, combine)
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
        ref = run_impl(mod, x, "loop")
        monkeypatch.setitem(moelab_kernels.KERNELS, "gather", moelab_kernels.gather_pairs)
        torch.testing.assert_close(run_impl(mod, x, "gather"), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("down_keep", [1.0, 0.5])
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("router", ALL_ROUTERS)
def test_cuda_kernels_equal_the_cpu_reference_loop(router, combine, down_keep, monkeypatch):
    """On a CUDA device every kernel (gather for one and for several tokens, grouped_mm, sorted,
    auto, which picks gather for few pairs and grouped_mm or sorted above GATHER_MAX_PAIRS) gives
    the CPU reference loop's output (fp32, 1e-5), empty experts and every expert active included,
    with every neuron's down projection and with half of them (``down_keep``)."""
    import copy

    mod = kernel_moe(router, combine, down_keep=down_keep)
    g = torch.Generator().manual_seed(11)
    cases = {"batch": torch.randn(2, 9, 32, generator=g), "one token": torch.randn(1, 32, generator=g),
             "three tokens": torch.randn(3, 32, generator=g), "many tokens": torch.randn(200, 32, generator=g)}
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    for m in (mod, kernel_moe(router, combine, top_k=16, down_keep=down_keep)):
        on_gpu = copy.deepcopy(m).cuda()
        for name, x in cases.items():
            ref = run_impl(m, x, "loop")
            for impl in FAST_IMPLS + ("loop",):
                got = run_impl(on_gpu, x.cuda(), impl)
                torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5, msg=f"cuda {impl} on {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("router", ALL_ROUTERS)
def test_cuda_skipped_expert_means_equal_the_cpu_reference_loop(router):
    """The skipped-expert means (summed through ``embedding_bag``) on a CUDA device, with half of each
    expert's down projection kept: every kernel gives the CPU reference loop's output."""
    import copy

    g = torch.Generator().manual_seed(5)
    mod = kernel_moe(router, "sum", down_keep=0.5, skip_mean=torch.randn(16, 32, generator=g))
    x = torch.randn(200, 32, generator=g)
    ref = run_impl(mod, x, "loop")
    on_gpu = copy.deepcopy(mod).cuda()
    for impl in FAST_IMPLS:
        torch.testing.assert_close(run_impl(on_gpu, x.cuda(), impl).cpu(), ref, rtol=1e-5, atol=1e-5, msg=f"cuda {impl}")


def test_every_expert_busy_and_odd_expert_size():
    """Each expert gets tokens (large batch, k close to E); expert_size 5 breaks grouped_mm's
    16-byte stride rule, so grouped_mm falls back to the sorted segments and still agrees."""
    mod, *_ = make_moe(20, 60, 0, 12, 10, "centroid", "weighted", seed=4)
    assert mod.expert_size == 5
    x = torch.randn(64, 20, generator=torch.Generator().manual_seed(3))
    assert not moelab_kernels.grouped_ok(mod.experts, x)
    ref = run_impl(mod, x, "loop")
    for impl in FAST_IMPLS:
        torch.testing.assert_close(run_impl(mod, x, impl), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router,combine", [("centroid", "sum"), ("gate_mass", "weighted"), ("representative", "scaled")])
def test_chunked_sorted_kernel_equals_the_reference_loop(router, combine, monkeypatch):
    """The prefill kernel processes experts in cache-sized chunks: with a tiny chunk budget every
    chunk holds one or a few experts (and some none), with grouped_mm or per-expert GEMMs inside."""
    monkeypatch.setattr(moelab_kernels, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(moelab_kernels, "DENSE_SHARE", 1.0)  # these 4-neuron experts would run dense
    mod = kernel_moe(router, combine, seed=5)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    ref = run_impl(mod, x, "loop")
    torch.testing.assert_close(run_impl(mod, x, "sorted"), ref, rtol=1e-5, atol=1e-5)
    assert mod.experts.resolve_impl(x, torch.zeros(40, 3, dtype=torch.long), needs_grad=False) == "sorted"
    xg = x.clone().requires_grad_(True)  # per-expert GEMMs inside the chunks
    torch.testing.assert_close(mod(xg), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router,combine", [("softmax", "weighted"), ("gate_mass", "normalized"), ("centroid", "scaled")])
def test_gradients_equal_the_reference_loop(router, combine, monkeypatch):
    """Training runs every expert masked (top_k ≥ E / GRAD_DENSE_RATIO) or per-expert segments
    (grouped_mm has no CPU backward): both give the loop's gradients."""
    mod = kernel_moe(router, combine, seed=2)
    x = torch.randn(30, 32, generator=torch.Generator().manual_seed(9))
    grads = {}
    for impl, ratio in (("loop", 8), ("auto", 8), ("segments", 1), ("gather", 8)):
        monkeypatch.setattr(moelab_kernels, "GRAD_DENSE_RATIO", ratio)  # 3 · 8 ≥ 16 experts: masked; 3 · 1: segments
        mod.zero_grad()
        mod.experts_impl = "auto" if impl == "segments" else impl
        xi = x.clone().requires_grad_(True)
        mod(xi).pow(2).sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in mod.named_parameters() if p.grad is not None} | {"x": xi.grad}
    mod.experts_impl = "auto"
    assert "experts.gate_up_proj" in grads["loop"] and "experts.down_proj" in grads["loop"]
    for impl in ("auto", "segments", "gather"):
        assert grads[impl].keys() == grads["loop"].keys()
        for n, gr in grads["loop"].items():
            torch.testing.assert_close(grads[impl][n], gr, rtol=1e-4, atol=1e-5, msg=f"{impl}: {n}")


@pytest.mark.parametrize("impl", ["auto", "segments", "loop", "gather", "grouped_mm"])
def test_each_stacked_weight_is_read_once_per_forward(impl, monkeypatch):
    """LoRA on the stacked experts (peft ``target_parameters``) is a parametrisation: every read of
    ``gate_up_proj`` computes W + ΔW for all experts and keeps it for backward. A kernel that read
    it once per expert made a training step of the default model 440 s instead of ~10 s."""
    from torch.nn.utils import parametrize

    class Counted(torch.nn.Module):
        reads = 0

        def forward(self, w):
            Counted.reads += 1
            return w * 1.0

    mod = kernel_moe("centroid", "sum", seed=3)
    parametrize.register_parametrization(mod.experts, "gate_up_proj", Counted())
    parametrize.register_parametrization(mod.experts, "down_proj", Counted())
    if impl == "segments":
        monkeypatch.setattr(moelab_kernels, "GRAD_DENSE_RATIO", 1)
    mod.experts_impl = "auto" if impl == "segments" else impl
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    Counted.reads = 0
    mod(x).sum().backward()
    assert Counted.reads == 2, f"{impl}: {Counted.reads} reads of the parametrised weights in one forward"


def test_auto_kernel_choice_on_cpu(monkeypatch):
    """CPU ``auto``: gather for a decode step of small experts (at most GATHER_MAX_TOKENS tokens
    whose experts' blocks fit in GATHER_MAX_BYTES), every expert masked (``dense``) for more tokens when
    the selected share k/E is at least DENSE_SHARE + m/DENSE_NEURONS, grouped_mm for other batches whose activations
    fit in CHUNK_BYTES, the chunked sorted kernel above that, and never gather or grouped_mm under
    a gradient."""
    experts = kernel_moe("centroid", "sum").experts  # 16 experts of 4 neurons, d_model 32

    def pick(tokens, needs_grad=False):
        return experts.resolve_impl(torch.randn(tokens, 32), torch.zeros(tokens, 3, dtype=torch.long), needs_grad)

    grouped = "grouped_mm" if moelab_kernels._GROUPED_MM is not None else "sorted"
    assert pick(1) == pick(moelab_kernels.GATHER_MAX_TOKENS) == "gather"
    # a prefill of experts this small runs dense (3 of 16 experts of 4 neurons: 3/16 ≥ DENSE_SHARE + 4/DENSE_NEURONS) ...
    assert pick(moelab_kernels.GATHER_MAX_TOKENS + 1) == pick(100_000) == "dense"
    assert pick(100_000, needs_grad=True) == "sorted"
    # ... and sparse once the selected share is below the threshold (here: wider experts, in effect)
    monkeypatch.setattr(moelab_kernels, "DENSE_NEURONS", 4 / (3 / 16 - moelab_kernels.DENSE_SHARE) - 1)
    assert pick(moelab_kernels.GATHER_MAX_TOKENS + 1) == grouped
    assert pick(1, needs_grad=True) == pick(5, needs_grad=True) == "sorted"
    assert pick(100_000) == "sorted"  # 100k pairs' activations exceed CHUNK_BYTES
    monkeypatch.setattr(moelab_kernels, "GATHER_MAX_BYTES", 3 * 2 * 4 * 32 * 4 - 1)  # < three experts' blocks
    assert pick(1) == "gather"  # one token, column-major blocks: nothing is copied, whatever their size
    assert pick(2) == grouped
    experts = kernel_moe("gate_mass", "sum").experts  # row-major: the gather copies the blocks
    assert pick(1) == grouped


def test_legacy_state_dict_keys_load():
    """A state dict of the previous runtime (experts_gate/experts_up/experts_down) loads into the
    stacked layout (``moelab_compat``'s pre-hook), with the same experts."""
    mod = kernel_moe("centroid", "sum")
    legacy = {k: v for k, v in mod.state_dict().items() if not k.startswith("experts.")}
    legacy.update(zip(("experts_gate", "experts_up", "experts_down"), (t.detach().clone() for t in expert_rows(mod))))
    fresh = MoeFFN(mod.spec)
    fresh.load_state_dict(legacy, strict=True)
    for new, old in zip(expert_rows(fresh), expert_rows(mod)):
        assert torch.equal(new, old)
    x = torch.randn(7, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), mod(x))



#: the state-dict keys of one MoE layer per router kind, as every export so far wrote them
ROUTER_KEYS = {"centroid": ["router_weight"], "softmax": ["router_weight"], "ridge": ["router_weight", "router_offset"],
               "representative": ["router_gate", "router_up"], "gate_mass": []}


@pytest.mark.parametrize("router", sorted(ROUTER_KEYS))
def test_the_router_is_a_child_module_and_the_keys_stay(router):
    """``block.router`` is a ``MoeRouter`` (as transformers' sparse-MoE blocks own their router), but its
    parameters stay on the block under the checkpoint's names: the state-dict keys are those every
    export has (router parameters and the CM §3.3 scale ``use_scaled_combine`` adds, then the buffers in
    the order they came: skipped-expert means and bias; the shared expert and the stacked experts), and
    the router module holds none of them."""
    from moelab.engine.runtime.modeling_moelab import MoeRouter

    wg, wu, wd = random_glu(16, 40)
    extra = {"router_offset": torch.randn(4)} if router == "ridge" else {}
    mod = moe_from_dense(wg, wu, wd, "silu", torch.arange(8), torch.arange(8, 40).reshape(4, 8), 2, router, "sum",
                         skip_mean=torch.randn(4, 16), **extra)
    mod.use_scaled_combine()
    assert isinstance(mod.router, MoeRouter) and dict(mod.named_children())["router"] is mod.router
    assert mod.router.kind == mod.spec["router"] == router and mod.router.block is mod
    assert not list(mod.router.parameters()) and not list(mod.router.buffers())
    assert list(mod.state_dict()) == [*ROUTER_KEYS[router], "router_scale", "skip_mean", "router_bias",
                                      "shared_gate.weight", "shared_up.weight", "shared_down.weight",
                                      "experts.gate_up_proj", "experts.down_proj"]
    x = torch.randn(5, 16)
    twin = copy.deepcopy(mod)  # the copy's router reads the copy's parameters
    assert twin.router.block is twin
    seen = []
    mod.router.register_forward_hook(lambda _m, _args, out: seen.append(out[0]))
    with torch.no_grad():
        assert torch.equal(twin(x), mod(x))
        assert len(seen) == 1 and seen[0].shape == (5, 4)  # a hook on the router sees its scores
        if router != "gate_mass":
            twin.get_parameter(ROUTER_KEYS[router][0]).neg_()
            assert not torch.equal(twin.router(x)[0], mod.router(x)[0])

# ------------------------------------------------------------------ (c) gate_mass routing


def test_gate_mass_picks_largest_gate_activation_mass():
    mod, (wg, _, _), (_, routed) = make_moe(32, 64, 8, 7, 3, "gate_mass", act="silu", seed=11)
    seen = []
    mod.recorder = seen.append
    x = torch.randn(40, 32)
    with torch.no_grad():
        mod(x)
    mass = torch.stack([F.silu(x @ wg[routed[e]].T).abs().sum(-1) for e in range(7)], dim=-1)  # [T, E]
    expected = torch.topk(mass, 3).indices
    assert torch.equal(seen[0].sort(-1).values, expected.sort(-1).values)


# ------------------------------------------------------------------ (d) AbsTopK-GLU


def test_abstopk_glu():
    wg, wu, wd = random_glu(24, 40, seed=2)
    x = torch.randn(2, 6, 24)
    full = abstopk_from_dense(wg, wu, wd, "silu", 40)
    with torch.no_grad():
        torch.testing.assert_close(full(x), dense_glu(x, wg, wu, wd), rtol=1e-5, atol=1e-5)
    k = 10
    sparse = abstopk_from_dense(wg, wu, wd, "silu", k)
    ref = torch.zeros_like(x)
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(6)):
        v = x[idx[0], idx[1]]
        a = F.silu(wg @ v)
        keep = torch.topk(a.abs(), k).indices
        h = torch.zeros_like(a)
        h[keep] = a[keep] * (wu[keep] @ v)
        ref[idx[0], idx[1]] = wd @ h
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(abstopk_from_dense(wg, wu, wd, "silu", 0)(x), torch.zeros_like(x))
    assert sparse.spec == {"kind": "abstopk", "d_model": 24, "d_ffn": 40, "act": "silu", "k": 10}


# ------------------------------------------------------------------ (e) recorder


@pytest.mark.parametrize("top_k", [0, 2, 5])
def test_recorder_receives_selected_indices(top_k):
    mod, *_ = make_moe(32, 48, 8, 5, top_k, "centroid")
    seen = []
    mod.recorder = seen.append
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        mod(x)
    assert len(seen) == 1
    idx = seen[0]
    assert idx.shape == (2, 9, top_k) and idx.dtype == torch.long
    if top_k:
        assert idx.min() >= 0 and idx.max() < 5
        assert (idx.sort(-1).values.diff(dim=-1) > 0).all()  # distinct experts per token
    assert "recorder" not in dict(mod.named_modules()) and not any("recorder" in n for n, _ in mod.named_parameters())
    mod.recorder = None
    mod(x)
    assert len(seen) == 1


def test_spec_round_trip():
    mod, *_ = make_moe(32, 48, 8, 5, 2, "representative", "weighted")
    spec = mod.spec
    assert json.loads(json.dumps(spec)) == spec
    again = build_layer_module(spec)
    assert isinstance(again, MoeFFN) and again.spec == spec
    assert {n: p.shape for n, p in again.named_parameters()} == {n: p.shape for n, p in mod.named_parameters()}
    assert build_layer_module({"kind": "dense"}) is None and layer_spec(None) == {"kind": "dense"}


@pytest.mark.parametrize("router,combine", [("ridge", "sum"), ("gate_mass", "weighted"), ("softmax", "normalized")])
def test_down_keep_runs_the_largest_neurons_of_each_active_expert(router, combine, monkeypatch):
    """``down_keep``: per token, only the ``round(q·m)`` neurons of largest |act(gate)·up| of each selected
    expert (and of the shared expert) reach the down projection. Checked against a per-token float64
    reference built from the spec's own rule, for every kernel (the CPU decode kernel reads only the kept
    rows), with every expert active, through a gradient, and in the cost and the spec."""
    mod = kernel_moe(router, combine, down_keep=0.5)  # experts of 4 neurons: 2 kept; shared 8: 4 kept
    assert mod.experts.down_keep == 2 and mod.shared_keep == 4 and mod.spec["down_keep"] == 0.5
    assert build_layer_module(mod.spec).spec == mod.spec
    full = kernel_moe(router, combine)
    d = 32
    assert full.active_param_count() - mod.active_param_count() == d * (4 + mod.top_k * 2)  # the skipped down rows
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    with torch.no_grad():
        scores, _ = mod.router(x)
        top = scores.topk(mod.top_k, dim=-1).indices
        w = mod.router.weights(scores, top)
    xd = x.double()

    def largest(h, n):
        keep = torch.zeros_like(h)
        i = h.abs().topk(n).indices
        keep[i] = h[i]
        return keep

    want = torch.zeros(7, d, dtype=torch.float64)
    G, U, D = (t.detach().double() for t in expert_rows(mod))
    for t in range(7):
        hs = F.silu(mod.shared_gate.weight.double() @ xd[t]) * (mod.shared_up.weight.double() @ xd[t])
        want[t] = mod.shared_down.weight.double() @ largest(hs, 4)
        for j, e in enumerate(top[t].tolist()):
            h = largest(F.silu(G[e] @ xd[t]) * (U[e] @ xd[t]), 2)
            want[t] += (D[e] @ h) * (1.0 if w is None else float(w[t, j]))
    for impl in ("loop", *FAST_IMPLS):
        torch.testing.assert_close(run_impl(mod, x, impl), want.float(), rtol=1e-5, atol=1e-5, msg=impl)
    monkeypatch.setitem(moelab_kernels.KERNELS, "gather", moelab_kernels.gather_pairs)
    torch.testing.assert_close(run_impl(mod, x, "gather"), want.float(), rtol=1e-5, atol=1e-5)
    every = kernel_moe(router, combine, top_k=16, down_keep=0.5)
    assert not torch.allclose(run_impl(every, x, "loop"), run_impl(kernel_moe(router, combine, top_k=16), x, "loop"))
    for impl in FAST_IMPLS:
        torch.testing.assert_close(run_impl(every, x, impl), run_impl(every, x, "loop"), rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_(True)
    mod(xg).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="down_keep"):
        kernel_moe(router, combine, down_keep=1.5)


# ------------------------------------------------------------------ (f) real architectures


def convert_adapter(adapter, top_k, router="centroid", seed=0, n_shared=16, m=8):
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for lay in adapter.layers:
        perm = torch.randperm(lay.d_ffn, generator=g)
        n_exp = (lay.d_ffn - n_shared) // m
        shared, routed = perm[:n_shared], perm[n_shared:].reshape(n_exp, m)
        mods[lay.index] = moe_from_dense(
            lay.gate_weight(), lay.up_weight(), lay.down_weight(), adapter.activation, shared, routed,
            n_exp if top_k == "all" else top_k, router,
        )
    return mods


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "phi3"])
def test_export_round_trip_on_tiny_models(family, tiny_model, data_dir, tmp_path):
    adapter = load_model(str(tiny_model(family)), data_dir=data_dir)
    ids = torch.randint(0, adapter.model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    routers = {"llama": "centroid", "qwen3": "representative", "gemma": "gate_mass", "phi3": "softmax"}
    mods = convert_adapter(adapter, top_k=3, router=routers[family])  # 10 experts of 8 + 16 shared
    moe = build_moe_model(adapter, mods)
    assert isinstance(moe, MoelabForCausalLM) and moe.model is adapter.model  # wrapped, not copied
    with torch.no_grad():
        logits = moe(input_ids=ids, attention_mask=mask).logits
    conversion = {"method": "test", "layers": [{"d_shared": 16}] * 3, "timings": {"total_s": 0.1}}
    out = export_model(moe, tmp_path / "moe", adapter.tokenizer, conversion)
    for f in RUNTIME_FILES:  # the whole runtime travels: the modeling file imports its siblings
        assert filecmp.cmp(out / f.name, f, shallow=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == AUTO_MAP and cfg["model_type"] == "moelab"
    assert cfg["base_config"]["model_type"] == adapter.model.config.model_type
    assert [e["top_k"] for e in cfg["moe_layers"]] == [3, 3, 3]
    assert json.loads((out / "conversion.json").read_text()) == conversion
    assert not list(tmp_path.glob(".*tmp-*"))

    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "MoelabForCausalLM"
    for mod in loaded.moe_modules().values():  # saved contiguous, loaded back into the decode layouts
        assert moelab_kernels.decode_layout_of(mod.experts.down_proj)
        assert moelab_kernels.decode_layout_of(mod.experts.gate_up_proj) == (mod.router.kind != "gate_mass")
    with torch.no_grad():
        again = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again, logits)
    if adapter.model.config.tie_word_embeddings:  # gemma ties lm_head to the embeddings
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    gen_kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=adapter.tokenizer.pad_token_id)
    with torch.no_grad():
        g1 = loaded.generate(ids, **gen_kw)
        g2 = moe.generate(ids, **gen_kw)
    assert g1.shape == (2, 16) and torch.equal(g1, g2)

    # all experts active: the converted model is the dense model
    dense = load_model(str(tiny_model(family)), data_dir=data_dir)
    with torch.no_grad():
        dense_logits = dense.model(input_ids=ids, attention_mask=mask).logits
    full = build_moe_model(dense, convert_adapter(dense, top_k="all", router=routers[family]))
    with torch.no_grad():
        torch.testing.assert_close(full(input_ids=ids, attention_mask=mask).logits, dense_logits, rtol=1e-4, atol=1e-4)


def test_mixed_layer_kinds_and_reexport(tiny_model, data_dir, tmp_path):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    lay0 = adapter.layers[0]
    mods = {
        0: abstopk_from_dense(lay0.gate_weight(), lay0.up_weight(), lay0.down_weight(), "silu", 40),
        1: convert_adapter(adapter, top_k=2, router="gate_mass")[1],
    }
    moe = build_moe_model(adapter, mods)
    assert [e["kind"] for e in moe.config.moe_layers] == ["abstopk", "moe", "dense"]
    ids = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        ref = moe(input_ids=ids).logits
    out = export_model(moe, tmp_path / "m", adapter.tokenizer, {"run": 1})
    out = export_model(moe, tmp_path / "m", adapter.tokenizer, {"run": 2})  # atomic overwrite
    assert json.loads((out / "conversion.json").read_text()) == {"run": 2}
    loaded = load_exported(out)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)
    kinds = [type(b.mlp).__name__ for b in loaded.get_decoder().layers]
    assert kinds == ["AbsTopKGLU", "MoeFFN", "LlamaMLP"]
    seen: dict[int, list] = {}

    def factory(layer):
        return lambda idx: seen.setdefault(layer, []).append(idx)

    loaded.set_recorder(factory)
    with torch.no_grad():
        loaded(input_ids=ids)
    # MoE layer: expert ids [1, 9, top_k]; AbsTopK layer: the kept neuron ids [1, 9, k]
    assert seen[1][0].shape == (1, 9, 2) and seen[1][0].max() < 10
    assert seen[0][0].shape == (1, 9, 40) and 2 not in seen
    counts = torch.bincount(seen[1][0].reshape(-1), minlength=10)
    assert counts.sum() == 18


def test_fresh_model_from_config(tiny_model):
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(tiny_model("qwen3"))
    spec = {"kind": "moe", "d_model": 64, "act": "silu", "d_shared": 32, "n_experts": 8, "expert_size": 8,
            "top_k": 2, "router": "softmax", "combine": "weighted"}
    config = MoelabConfig(base_config=base.to_dict(), moe_layers=[spec, {"kind": "dense"}, spec])
    assert MoelabConfig.from_dict(config.to_dict()).moe_layers == config.moe_layers
    model = MoelabForCausalLM(config)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    out = model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, base.vocab_size) and torch.isfinite(out.loss)


def test_tied_llama_like_smollm_round_trips(tiny_model, data_dir, tmp_path):
    """SmolLM2 is a Llama whose lm_head is tied to embed_tokens: stored once, re-tied on load."""
    from safetensors import safe_open
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY

    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, **TINY))
    base.save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    adapter = load_model(str(tmp_path / "dense"), data_dir=data_dir)
    assert adapter.model.lm_head.weight is adapter.model.model.embed_tokens.weight
    moe = build_moe_model(adapter, convert_adapter(adapter, top_k=4, router="centroid"))
    assert moe.get_output_embeddings().weight is moe.get_input_embeddings().weight
    ids = torch.randint(0, len(tok), (3, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = moe(input_ids=ids).logits
    out = export_model(moe, tmp_path / "moe", tok, {})
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    loaded = load_exported(out)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)
    # save -> load -> save is stable: same tensors again
    again = export_model(loaded, tmp_path / "moe2", tok, {})
    reloaded = load_exported(again)
    for (n1, p1), (n2, p2) in zip(loaded.state_dict().items(), reloaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_build_checks_specs_against_modules(tiny_model, data_dir):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    mods = convert_adapter(adapter, top_k=2)
    with pytest.raises(ValueError, match="kind"):
        build_moe_model(adapter, {0: mods[0]}, [{"kind": "dense"}, None, None])
    with pytest.raises(ValueError, match="layer specs"):
        build_moe_model(adapter, mods, [None])
    moe = build_moe_model(adapter, {1: mods[1]}, [None, {"kind": "moe", "note": "clustered", "top_k": 99}, None])
    assert moe.config.moe_layers[0] == {"kind": "dense"}
    assert moe.config.moe_layers[1]["note"] == "clustered" and moe.config.moe_layers[1]["top_k"] == 2


def test_a_dropped_block_is_freed_at_once_and_a_copy_routes_with_its_own_router():
    """The router reads its block through a weak reference: a block (after a decode step too) is freed when its last
    reference goes, not when the cyclic collector next runs; a deep copy's router reads the copy's parameters."""
    import gc
    import weakref

    gc.disable()
    try:
        mod = make_moe(router="centroid", top_k=2)[0].eval()
        with torch.inference_mode():
            mod(torch.randn(1, 32))
        gone = weakref.ref(mod)
        del mod
        assert gone() is None
    finally:
        gc.enable()
    mod = make_moe(router="centroid", top_k=2)[0].eval()
    twin = copy.deepcopy(mod)
    assert twin.router.block is twin and mod.router.block is mod
    x = torch.randn(16, 32)
    with torch.inference_mode():
        before = mod.router.select(mod.router(x)[0])
        twin.router_weight.copy_(-twin.router_weight)
        assert torch.equal(mod.router.select(mod.router(x)[0]), before)
        assert not torch.equal(twin.router.select(twin.router(x)[0]), before)


def test_a_fresh_layer_is_drawn_in_its_storage_order_and_a_loaded_weight_is_left_alone():
    """``reset_parameters`` draws the experts (stored transposed: the decode layouts) through a view in storage order,
    the torch fast path: every weight keeps its strides and gets N(0, std) values, the same draw as a contiguous
    tensor of the storage's shape under the same seed; a weight transformers flags as loaded is not drawn."""
    from transformers import initialization

    experts = modeling_moelab.MoeExperts(16, 24, 64)
    strides = [p.stride() for p in experts.parameters()]
    assert any(not p.is_contiguous() for p in experts.parameters())
    torch.manual_seed(3)
    experts.reset_parameters(0.5)
    assert [p.stride() for p in experts.parameters()] == strides
    torch.manual_seed(3)
    for p in experts.parameters():
        storage_order = p.permute(sorted(range(p.dim()), key=lambda i: -p.stride(i)))
        assert torch.equal(storage_order, torch.empty(storage_order.shape).normal_(0.0, 0.5))
        assert abs(float(p.detach().std()) - 0.5) < 0.01
    loaded = experts.down_proj
    loaded.data.fill_(1.0)
    loaded._is_hf_initialized = True
    with initialization.guard_torch_init_functions():
        experts.reset_parameters(0.5)
    assert torch.equal(loaded.detach(), torch.ones_like(loaded))
    assert abs(float(experts.gate_up_proj.detach().std()) - 0.5) < 0.01
