"""The native CPU kernels (``runtime/moelab_native.py``) against the torch reference loop."""

from __future__ import annotations

import copy
import io
import shutil

import pytest
import torch

from moelab.engine.runtime import moelab_native

from .test_moe_runtime import kernel_moe, run_impl as run

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MOELAB_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))
    monkeypatch.setattr(moelab_native, "_tried", False)
    monkeypatch.setattr(moelab_native, "_library", None)
    monkeypatch.setattr(moelab_native, "_shares", {})


def calls(monkeypatch, fused: list[int] | None = None) -> list[int]:
    """Counts the native kernels' calls (tokens per call) from now on: the routed experts' (``moe_routed``) and the
    whole block's at a decode step (``FusedDecode``, ``moe_ffn_decode``'s kept arguments), those also in ``fused`` when given."""
    seen: list[int] = []

    def counting(real, into):
        def counted(x, *args, **kwargs):
            for out in into:
                out.append(x.shape[0])
            return real(x, *args, **kwargs)
        return counted

    monkeypatch.setattr("moelab.engine.runtime.moelab_moe.moe_routed", counting(moelab_native.moe_routed, [seen]))
    real_call = moelab_native.FusedDecode.__call__

    def fused_call(self, x):
        for out in [seen] + ([fused] if fused is not None else []):
            out.append(x.shape[0])
        return real_call(self, x)

    monkeypatch.setattr(moelab_native.FusedDecode, "__call__", fused_call)
    return seen


def test_the_kernel_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_KERNEL_CACHE", str(tmp_path))
    assert moelab_native.library() is not None
    built = list(tmp_path.glob("moelab_native-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("tmp*")), "one library, no temporary left"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(moelab_native, "_tried", False)
    assert moelab_native.library() is not None
    assert built[0].stat().st_mtime_ns == stamp, "the cached library is reused"


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("combine", ["sum", "weighted", "normalized"])
@pytest.mark.parametrize("down_keep", [1.0, 0.5])
def test_decode_and_prefill_equal_the_reference_loop(act, combine, down_keep, monkeypatch):
    """Decode steps (1-8 tokens: the selected experts shared among threads) and prefills (9 and more: tokens shared
    among threads, in blocks of four and the rest one by one) on the native kernel == the reference loop, with the
    skipped-expert means."""
    mod = kernel_moe("ridge", combine, act=act, down_keep=down_keep, skip_mean=torch.randn(16, 32))
    seen = calls(monkeypatch)
    g = torch.Generator().manual_seed(3)
    for T in (1, 3, 8, 9, 64, 203):
        x = torch.randn(T, 32, generator=g)
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    assert seen == [1, 3, 8, 9, 64, 203]


@pytest.mark.parametrize("top_k, d_model", [(3, 32), (7, 40), (8, 32), (9, 40)])
def test_the_skipped_means_by_either_sum_equal_the_reference_loop(top_k, d_model, monkeypatch):
    """A prefill adds the skipped experts' means as every mean less the selected ones' where a token selects fewer
    than half the experts (top-3 and top-7 of 16; 32 columns at a time, then one by one), else as the skipped ones'
    sum (top-8, top-9); a decode step sums the skipped ones, its threads sharing the columns. Each == the reference
    loop."""
    mod = kernel_moe("ridge", "weighted", top_k=top_k, d_model=d_model, skip_mean=torch.randn(16, d_model))
    seen = calls(monkeypatch)
    g = torch.Generator().manual_seed(7)
    for T in (1, 8, 64):
        x = torch.randn(T, d_model, generator=g)
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    assert seen == [1, 8, 64]


@pytest.mark.parametrize("d_model, expert_size", [(40, 13), (576, 12), (72, 12), (50, 40)])
def test_odd_sizes_take_the_remainder_paths(d_model, expert_size, monkeypatch):
    """Widths that are not multiples of the kernels' 24-number tiles (d_model 40 and 50, 2m 26 and 80), a d_model
    that AVX-512's 48-column down tiles leave 24 of (72), and the quickselect of experts wider than 32 neurons
    (down_keep 0.5 of 40) == the reference loop."""
    mod = kernel_moe("ridge", "weighted", d_model=d_model, n_experts=6, top_k=3, d_shared=0, d_ffn=6 * expert_size,
                     down_keep=0.5)
    seen = calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    for T in (1, 8, 37):
        x = torch.randn(T, d_model, generator=g)
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    assert seen == [1, 8, 37]


def test_the_kernel_keeps_the_largest_products_and_the_lower_index_on_ties(monkeypatch):
    """down_keep 0.5 of 4 neurons: the two largest |act(gate)·up| run their down rows; where all four tie, the
    first two (the module docstring's choice), where they differ the two largest whatever their order."""
    mod = kernel_moe("ridge", "sum", n_experts=2, d_shared=0, d_ffn=8, top_k=1, down_keep=0.5)
    E, m, d = 2, 4, 32
    seen = calls(monkeypatch)
    down = torch.randn(m, d)
    with torch.no_grad():
        mod.experts.down_proj.copy_(down.T.expand(E, d, m))  # both experts alike: either may be selected
        for up, kept in ((torch.ones(m), [0, 1]), (torch.tensor([0.5, 3.0, -4.0, 1.0]), [1, 2])):
            gate_up = torch.cat([torch.ones(m, d) / d, up[:, None] * torch.ones(m, d) / d])  # on ones: gate 1, up `up`
            mod.experts.gate_up_proj.copy_(gate_up.expand(E, 2 * m, d))
            x = torch.ones(1, d)
            g = torch.nn.functional.silu(torch.ones(m)) * up
            want = (g[kept, None] * down[kept]).sum(0, keepdim=True)
            torch.testing.assert_close(run(mod, x, "auto"), want, rtol=1e-5, atol=1e-6)
    assert seen == [1, 1]


def test_same_inputs_same_bits(monkeypatch):
    """Decode: each thread sums into its own accumulator and they are added in thread order; prefill: each token's
    row is summed by one thread in expert order. No run-to-run jitter, and a prefill's bits do not depend on the
    thread count."""
    mod = kernel_moe("ridge", "weighted", n_experts=16, top_k=5, skip_mean=torch.randn(16, 32))
    for T in (8, 100):
        x = torch.randn(T, 32)
        first = run(mod, x, "auto")
        for _ in range(5):
            assert torch.equal(run(mod, x, "auto"), first)
    experts = mod.experts
    top = torch.randn(T, 16).topk(5, dim=1).indices
    routed = lambda: moelab_native.moe_routed(x, top, torch.rand(T, 5), experts.gate_up_proj.transpose(1, 2),  # noqa: E731
                                              experts.down_proj.transpose(1, 2), 4, 4, "silu", mod.skip_mean)
    threads = torch.get_num_threads()
    try:
        torch.manual_seed(0)
        first = routed()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            assert torch.equal(routed(), first), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_the_torch_kernels_run_where_the_native_one_does_not(monkeypatch):
    """A gradient, float64, the gate-mass router (its scores reuse the gate products), an explicit kernel choice and
    MOELAB_NATIVE_KERNELS=0 all run the torch kernels."""
    seen = calls(monkeypatch)
    mod = kernel_moe("ridge", "sum")
    run(mod, torch.randn(1, 32), "gather")
    run(mod, torch.randn(64, 32), "dense")
    mod(torch.randn(1, 32, requires_grad=True)).sum().backward()
    run(kernel_moe("gate_mass", "sum"), torch.randn(1, 32), "auto")
    run(kernel_moe("ridge", "sum").double(), torch.randn(1, 32, dtype=torch.float64), "auto")
    assert seen == []
    monkeypatch.setenv("MOELAB_NATIVE_KERNELS", "0")
    run(mod, torch.randn(1, 32), "auto")
    assert seen == [] and moelab_native.library() is None


@pytest.mark.parametrize("n", [12, 20, 40])
def test_ties_keep_the_lower_index_on_both_ranking_paths(n):
    """The kept products with ties among them: up to 32 neurons each entry's rank (one or two vectors of ranks),
    past that the bit-by-bit threshold with the ties beyond the first ones dropped; either way the ``keep`` largest
    |act(gate)·up|, a tie going to the lower index, on every row of a call that shares its rows among threads."""
    keep = n // 2
    gate = torch.full((64, n), 2.0)
    g = torch.Generator().manual_seed(n)
    levels = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 3.0])  # few magnitudes: every row has ties at its threshold
    up = levels[torch.randint(0, len(levels), (64, n), generator=g)]
    got = moelab_native.glu_keep(gate, up, keep, "relu")
    prod = 2.0 * up
    for row, out in zip(prod, got):  # the reference: rank by (-|g|, index)
        order = sorted(range(n), key=lambda i: (-abs(float(row[i])), i))[:keep]
        want = torch.zeros(n)
        want[order] = row[order]
        assert torch.equal(out, want)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_shared_experts_kept_products_equal_torchs(act, monkeypatch):
    """The shared expert under down_keep (``glu_keep``: one call, its rows shared among threads past a decode step)
    == torch's keep_largest of its products; 24 neurons rank, 40 quickselect."""
    mods = [kernel_moe("ridge", "sum", d_shared=n, d_ffn=n + 64, act=act, down_keep=0.5) for n in (24, 40)]
    x = torch.randn(50, 32)
    with torch.no_grad():
        native = [mod._shared(rows) for mod in mods for rows in (x[:1], x[:3], x)]
    monkeypatch.setattr(moelab_native, "_library", None)
    monkeypatch.setattr(moelab_native, "_tried", True)
    with torch.no_grad():
        reference = [mod._shared(rows) for mod in mods for rows in (x[:1], x[:3], x)]
    for a, b in zip(native, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combine", ["sum", "weighted"])
def test_a_layer_with_every_expert_selected_runs_the_native_kernel(combine, monkeypatch):
    """top_k = n_routed (a budget plan's layer that keeps every expert): the native kernel with every expert selected
    == the torch GLU over all of them with each expert's kept products (down_keep 0.5), decode and prefill."""
    mod = kernel_moe("ridge", combine, n_experts=8, top_k=8, down_keep=0.5)
    seen = calls(monkeypatch)
    x = torch.randn(40, 32)
    with torch.no_grad():
        native = [mod(x[:1]), mod(x[:8]), mod(x)]
    assert seen == [1, 8, 40]
    monkeypatch.setattr(moelab_native, "_library", None)
    monkeypatch.setattr(moelab_native, "_tried", True)
    with torch.no_grad():
        reference = [mod(x[:1]), mod(x[:8]), mod(x)]
    for a, b in zip(native, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("router", ["centroid", "softmax", "ridge"])
@pytest.mark.parametrize("combine", ["sum", "weighted", "normalized"])
@pytest.mark.parametrize("d_shared, down_keep", [(8, 1.0), (40, 0.5), (0, 0.5)])
def test_a_decode_step_runs_the_whole_block_in_one_call(router, combine, d_shared, down_keep, monkeypatch):
    """1-8 tokens, a linear router: the shared expert (its kept products' down rows read from its [d_shared, d]
    storage), the scores, each token's top-k, the combine weights, the routed experts and the skipped experts' means
    in one native call (``moe_ffn_decode``) == the reference loop; the experts it records are torch's top-k, best
    first. Past a decode step the routed kernel alone runs."""
    mod = kernel_moe(router, combine, d_shared=d_shared, d_ffn=d_shared + 64, down_keep=down_keep,
                     skip_mean=torch.randn(16, 32))
    assert d_shared == 0 or mod.shared_down.weight.t().is_contiguous()
    fused: list[int] = []
    seen = calls(monkeypatch, fused)
    recorded: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(11)
    for T in (1, 3, 8, 9, 40):
        x = torch.randn(T, 32, generator=g)
        mod.recorder = recorded.append
        got = run(mod, x, "auto")
        mod.recorder = None
        torch.testing.assert_close(got, run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            want = mod.router.select(mod.router(x)[0], sort=True)
        assert torch.equal(recorded[-1], want)
    assert fused == [1, 3, 8] and seen == [1, 3, 8, 9, 40]


def test_the_whole_block_call_gives_way_where_it_does_not_apply(monkeypatch):
    """Scores that are not linear (representative), the scaled combine, expert groups, a gradient, a shared expert
    under a parametrisation (as an adapter wraps it) or with its down projection stored by output row: the
    previous path, with the same result as the reference loop."""
    from torch.nn.utils import parametrize

    class Same(torch.nn.Module):
        def forward(self, w):
            return w

    grouped = kernel_moe("ridge", "sum", expert_groups=[e // 2 for e in range(16)])
    adapted = kernel_moe("ridge", "sum")
    parametrize.register_parametrization(adapted.shared_gate, "weight", Same())
    by_row = kernel_moe("ridge", "sum")
    by_row.shared_down.weight.data = by_row.shared_down.weight.data.contiguous()
    fused: list[int] = []
    calls(monkeypatch, fused)
    x = torch.randn(2, 32)
    for mod in (kernel_moe("representative", "sum"), kernel_moe("ridge", "scaled"), grouped, adapted, by_row):
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    kernel_moe("ridge", "sum")(torch.randn(1, 32, requires_grad=True)).sum().backward()
    assert fused == []


def test_the_whole_block_call_gives_the_same_bits_each_time(monkeypatch):
    mod = kernel_moe("ridge", "weighted", d_shared=40, d_ffn=104, down_keep=0.5, skip_mean=torch.randn(16, 32))
    fused: list[int] = []
    calls(monkeypatch, fused)
    x = torch.randn(8, 32)
    first = run(mod, x, "auto")
    for _ in range(5):
        assert torch.equal(run(mod, x, "auto"), first)
    assert fused == [8] * 6


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_whole_block_call_on_wide_rows_and_odd_slices(threads, monkeypatch):
    """d_model 100 (the shared down projection's column slices take the 24-wide tiles, the 8-wide ones and single
    columns), a shared expert under down_keep, blocks of four tokens and single ones: == the reference loop."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    mod = kernel_moe("ridge", "weighted", d_model=100, d_shared=40, d_ffn=40 + 16 * 6, down_keep=0.5,
                     skip_mean=torch.randn(16, 100))
    fused: list[int] = []
    calls(monkeypatch, fused)
    g = torch.Generator().manual_seed(13)
    for T in (1, 5, 8):
        x = torch.randn(T, 100, generator=g)
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    assert fused == [1, 5, 8]


def test_the_kept_whole_block_call_follows_the_layers_weights_and_settings(monkeypatch):
    """``MoeFFN`` keeps its checked call (``FusedDecode``) from step to step; a weight's data replaced (as
    ``realign_parameters`` does), a Parameter replaced, another top-k, or the native kernels switched off are each
    seen at the next step: == the reference loop every time, through the call while it applies."""
    from moelab.engine.runtime.moelab_kernels import decode_layout

    mod = kernel_moe("ridge", "weighted", d_shared=40, d_ffn=104, down_keep=0.5, skip_mean=torch.randn(16, 32))
    fused: list[int] = []
    calls(monkeypatch, fused)
    x = torch.randn(3, 32)

    def step_equals_the_loop():
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)

    step_equals_the_loop()
    mod.experts.down_proj.data = decode_layout(mod.experts.down_proj.data.contiguous() * 2)
    step_equals_the_loop()
    mod.router_weight = torch.nn.Parameter(-mod.router_weight.detach())
    step_equals_the_loop()
    mod.shared_up.weight.data = mod.shared_up.weight.data * 3
    mod.skip_mean.data = mod.skip_mean.data + 1
    step_equals_the_loop()
    mod.top_k = 2
    step_equals_the_loop()
    assert fused == [3] * 5
    copied = copy.deepcopy(mod)  # a layer that ran a decode step copies (and pickles) as any module does
    torch.testing.assert_close(run(copied, x, "auto"), run(mod, x, "auto"), rtol=0, atol=0)
    torch.save(copied, io.BytesIO())
    assert fused == [3] * 7
    monkeypatch.setenv("MOELAB_NATIVE_KERNELS", "0")
    step_equals_the_loop()
    assert fused == [3] * 7


def test_the_kept_call_is_checked_cheaply_and_sees_what_no_setattr_of_the_block_does(monkeypatch):
    """Unchanged, a layer's steps reuse one kept call (``_KeptDecode``, checked by a layout epoch, the native switch
    and the weights' data pointers, not by rebuilding a key of settings and types a layer); what changes the layer
    without an attribute of the block, its experts or its router being set is seen too: the shared expert's Linear
    given a new weight Parameter, a parametrisation on it, the block converted to float64 and back, also into new
    Parameter and buffer objects, then changed in place. Each change is made alike to a copy that runs the reference
    loop (nothing set between the steps, so nothing else marks the layout changed): == it every time, through the
    whole-block call where it applies."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    mod = kernel_moe("ridge", "weighted", d_shared=40, d_ffn=104, down_keep=0.5, skip_mean=torch.randn(16, 32))
    ref = copy.deepcopy(mod)
    ref.experts_impl = "loop"  # never the whole-block call
    fused: list[int] = []
    calls(monkeypatch, fused)
    x = torch.randn(1, 32)

    def step_after(change, dtype=torch.float32):
        for m in (mod, ref):
            change(m)
        with torch.no_grad():
            tol = 1e-5 if dtype == torch.float32 else 1e-9
            torch.testing.assert_close(mod(x.to(dtype)), ref(x.to(dtype)), rtol=tol, atol=tol)

    def overwritten(m):  # new Parameter and buffer objects (torch's _apply sets them in the dicts: no hook runs)
        overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            m.double().float()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        with torch.no_grad():
            for t in (m.shared_down.weight, m.experts.gate_up_proj, m.skip_mean):
                t.mul_(3)

    with torch.no_grad():
        first = mod(x)
        kept = mod.__dict__["_fused_kept"]
        assert torch.equal(mod(x), first) and mod.__dict__["_fused_kept"] is kept and fused == [1, 1]
    step_after(lambda m: setattr(m.shared_gate, "weight", torch.nn.Parameter(-m.shared_gate.weight.detach())))
    assert fused == [1] * 3
    step_after(lambda m: parametrize.register_parametrization(m.shared_up, "weight", Doubled()))
    assert fused == [1] * 3  # no whole-block call under a parametrisation
    step_after(lambda m: parametrize.remove_parametrizations(m.shared_up, "weight"))
    step_after(lambda m: m.double(), torch.float64)
    step_after(lambda m: m.float())
    step_after(overwritten)
    assert fused == [1] * 6


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("combine", ["sum", "weighted"])
@pytest.mark.parametrize("down_keep", [1.0, 0.5])
def test_a_prefill_that_selects_most_experts_runs_them_all_in_two_gemms(act, combine, down_keep, monkeypatch):
    """Past a decode step, where each token selects the machine's ``dense_share`` of the experts or more (here the
    fixed shares, as on the Xeon they were measured on), the routed experts run as two GEMMs over all of them with
    the selected ones' kept products between (``_routed_dense``), with the skipped experts' means: == the reference
    loop; below that share the pairs kernel runs."""
    monkeypatch.setattr(moelab_native, "dense_shares",
                        lambda: (moelab_native.NATIVE_DENSE_SHARE, moelab_native.NATIVE_DENSE_SHARE_LONG))
    E = 16
    dense_k = int(moelab_native.NATIVE_DENSE_SHARE * E + 0.999)
    dense_calls: list[int] = []
    real = moelab_native._routed_dense
    monkeypatch.setattr(moelab_native, "_routed_dense", lambda x, *a: dense_calls.append(x.shape[0]) or real(x, *a))
    x = torch.randn(40, 32)
    for k in (dense_k - 1, dense_k, E - 1):
        mod = kernel_moe("ridge", combine, act=act, top_k=k, down_keep=down_keep, skip_mean=torch.randn(E, 32))
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run(mod, x[:5], "auto"), run(mod, x[:5], "loop"), rtol=1e-5, atol=1e-5)
    assert dense_calls == [40, 40]
    long_k = int(moelab_native.NATIVE_DENSE_SHARE_LONG * E + 0.999)
    assert long_k < dense_k  # a long prefill takes the GEMMs from a lower share
    mod = kernel_moe("ridge", combine, act=act, top_k=long_k, down_keep=down_keep, skip_mean=torch.randn(E, 32))
    x = torch.randn(moelab_native.NATIVE_LONG_TOKENS + 1, 32)
    torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    assert dense_calls == [40, 40, x.shape[0]]


def test_where_the_pairs_kernel_beats_the_gemms_at_every_share_a_prefill_never_takes_them(monkeypatch):
    """A machine whose measured shares are above 1 (the pairs kernel faster than two GEMMs however many experts are
    selected, as on a Zen 4 EPYC) runs every prefill by pairs, at every top-k and length."""
    monkeypatch.setattr(moelab_native, "dense_shares", lambda: (1.02, 1.01))
    dense_calls: list[int] = []
    real = moelab_native._routed_dense
    monkeypatch.setattr(moelab_native, "_routed_dense", lambda x, *a: dense_calls.append(x.shape[0]) or real(x, *a))
    mod = kernel_moe("ridge", "sum", top_k=15, down_keep=0.5, skip_mean=torch.randn(16, 32))
    for tokens in (40, moelab_native.NATIVE_LONG_TOKENS + 1):
        x = torch.randn(tokens, 32)
        torch.testing.assert_close(run(mod, x, "auto"), run(mod, x, "loop"), rtol=1e-5, atol=1e-5)
    assert dense_calls == []


def test_the_machines_shares_are_measured_once_and_kept_beside_the_build(tmp_path, monkeypatch):
    """``dense_shares`` measures once per build and thread count, writes JSON beside the library (atomically: no
    temporary left), and a later process reads it there without measuring; a file cut short is measured again."""
    monkeypatch.setenv("MOELAB_KERNEL_CACHE", str(tmp_path))
    measured: list[int] = []
    monkeypatch.setattr(moelab_native, "measure_dense_shares", lambda: measured.append(1) or (0.8, 0.6))
    assert moelab_native.dense_shares() == (0.8, 0.6) and moelab_native.dense_share(512) == 0.8
    assert moelab_native.dense_share(moelab_native.NATIVE_LONG_TOKENS + 1) == 0.6
    stored = list(tmp_path.glob(f"moelab_native-*-shares-{torch.get_num_threads()}.json"))
    assert len(stored) == 1 and not list(tmp_path.glob("tmp*"))
    assert stored[0].name.startswith(f"moelab_native-{moelab_native.build_key()}")
    monkeypatch.setattr(moelab_native, "_shares", {})  # a new process: the file, not the measurement
    assert moelab_native.dense_shares() == (0.8, 0.6) and measured == [1]
    stored[0].write_text('{"shares": [0.8')
    monkeypatch.setattr(moelab_native, "_shares", {})
    assert moelab_native.dense_shares() == (0.8, 0.6) and measured == [1, 1]


def test_the_measured_share_is_where_the_pairs_kernel_would_cost_what_the_gemms_do(monkeypatch):
    """With half the experts selected the pairs kernel taking 40 ms and the GEMMs 64 ms, the pairs cost as much as the
    GEMMs at 0.5 · 64 / 40 = 0.8 of the experts selected (their time grows with the share, the GEMMs' does not); the
    real kernels give a finite positive share at both lengths. (Sleeps long enough that a loaded host's few ms of
    oversleep stay within the tolerance.)"""
    import time

    timed = moelab_native.measure_dense_shares(rounds=1)
    assert len(timed) == 2 and all(0 < share < 10 for share in timed)
    monkeypatch.setattr(moelab_native, "_routed_pairs", lambda *a: time.sleep(0.040))
    monkeypatch.setattr(moelab_native, "_routed_dense", lambda *a: time.sleep(0.064))
    for share in moelab_native.measure_dense_shares(rounds=3):
        assert share == pytest.approx(0.8, abs=0.08)


#: targets whose vector registers hold 4 floats, where the kernels' 8-float vectors take two: the register pins must
#: not be asked of them (an impossible asm constraint failed the whole build on aarch64, and the torch kernels ran)
NARROW_TARGETS = {"x86-64 without AVX": ("gcc", "-march=x86-64"), "aarch64": ("aarch64-linux-gnu-gcc", "-march=armv8-a")}


@pytest.mark.parametrize("target", NARROW_TARGETS)
def test_the_kernels_build_where_a_register_holds_four_floats(target, tmp_path):
    import platform

    compiler, march = NARROW_TARGETS[target]
    if target.startswith("x86") and platform.machine() != "x86_64":
        pytest.skip("an x86-64 compiler target")
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed (Debian: gcc-aarch64-linux-gnu)")
    _build_for(compiler, march, tmp_path / "k.so")


def _build_for(compiler: str, march: str, lib):
    """The kernels' source compiled with ``compiler`` for ``march`` (the build's other flags) into ``lib``."""
    import subprocess

    src = lib.with_suffix(".c")
    src.write_text(moelab_native._SOURCE)
    flags = [f for f in moelab_native._FLAGS if f != "-march=native"]
    done = subprocess.run([compiler, *flags, march, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_build_key_names_an_arm_cpu_as_well_as_an_x86_one():
    """``-march=native`` code may not run on another CPU, so a kernel cache shared between machines keeps a build per
    CPU: aarch64's /proc/cpuinfo has no model name or flags line, and its implementer, part and features name it."""
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\n"
    arm = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
           "CPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n\nprocessor\t: 1\nFeatures\t: other\n")
    assert moelab_native.cpu_identity(x86) == "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f"
    other_part = arm.replace("0xd40", "0xd4f")  # a Neoverse V1 against a V2: same features line
    assert moelab_native.cpu_identity(arm) != moelab_native.cpu_identity(other_part)
    assert "Features\t: fp asimd sve" in moelab_native.cpu_identity(arm) and "other" not in moelab_native.cpu_identity(arm)


#: x86 builds narrower than this CPU's that it can still run: the micro-kernels' token blocks are 8 wide only under
#: AVX-512, 4 wide otherwise
NARROWER_X86 = {"AVX2": ("-march=x86-64-v3", "avx2"), "SSE2": ("-march=x86-64", "sse2")}


@pytest.mark.parametrize("build", NARROWER_X86)
def test_the_teal_and_linear_calls_of_a_narrower_x86_build_give_the_same_outputs(build, tmp_path, monkeypatch):
    """``moelab_teal_decode`` built for AVX2 or plain x86-64 (blocks of four tokens, a step of eight in two) and run here
    gives this machine's build's outputs for 1-8 tokens at widths the 24-column kernels tile (48 / 96, with 2 threads
    a slice of 48) and ones they do not (40 / 72); and ``moelab_linear_decode`` (tokens in pairs there, in fours under
    AVX-512) the same outputs, to the rounding another build's code allows."""
    import platform

    march, flag = NARROWER_X86[build]
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    if platform.machine() != "x86_64" or flag not in flags or moelab_native.library() is None:
        pytest.skip(f"needs an x86-64 CPU with {flag} and a C compiler")
    _build_for("gcc", march, tmp_path / "narrow.so")
    narrow_library = moelab_native.load(tmp_path / "narrow.so")
    narrow = narrow_library.moelab_teal_decode
    g = torch.Generator().manual_seed(11)
    for d, D in ((48, 96), (40, 72)):
        wg, wu = torch.randn(d, D, generator=g) / d ** 0.5, torch.randn(d, D, generator=g) / d ** 0.5
        wd = torch.randn(D, d, generator=g) / D ** 0.5
        x = torch.randn(8, d, generator=g)
        for T in range(1, 9):
            for threads in (1, 2):
                monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)  # what teal_decode passes on
                want = moelab_native.teal_decode(x[:T], 0.3, 0.02, wg, wu, wd, "silu")
                got = torch.empty(T, d)
                narrow(T, d, D, 0, x[:T].contiguous().data_ptr(), 0.3, 0.02, wg.data_ptr(), wu.data_ptr(),
                       wd.data_ptr(), got.data_ptr(), threads)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{build} d={d} T={T}")
                want = moelab_native.linear_decode(x[:T], wd, None)  # [d_ffn, d] rows: D outputs of x's d inputs
                got = torch.empty(T, D)
                narrow_library.moelab_linear_decode(T, d, D, x[:T].contiguous().data_ptr(), wd.data_ptr(), None,
                                                    got.data_ptr(), threads)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{build} linear d={d} T={T}")
