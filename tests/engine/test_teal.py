"""TEAL baseline (``core.teal``, ``runtime.moelab_teal``): exactness at zero sparsity, calibrated
sparsities and cost, greedy against uniform, a planted sparse down input, and the evaluation row."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from tests.engine.conftest import tiny_conversion
from moelab.engine.core.fitting import collect_inputs
from moelab.engine.core.teal import (
    calibrate_layer, quantile_threshold, teal_cost, teal_flops_fraction, teal_from_dense, teal_layers, teal_modules,
)
from moelab.engine.models import dense_weights, load_model
from moelab.engine.progress import NO_PROGRESS
from moelab.engine.runtime.modeling_moelab import LAYER_KINDS, build_layer_module, layer_spec
from moelab.engine.runtime import moelab_native
from moelab.engine.runtime.moelab_teal import TealGLU
from moelab.engine.evaluation.kernel_gain import LABEL as KERNEL_LABEL, NAME as KERNEL_DENSE, sparsity_gain


def dense_glu(x, wg, wu, wd, act="silu"):
    return F.linear(ACT2FN[act](F.linear(x, wg)) * F.linear(x, wu), wd)


def random_glu(d_model, d_ffn, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = d_model ** -0.5
    return (torch.randn(d_ffn, d_model, generator=g) * s, torch.randn(d_ffn, d_model, generator=g) * s,
            torch.randn(d_model, d_ffn, generator=g) * d_ffn ** -0.5)


@pytest.fixture(scope="module")
def tiny(tiny_model, data_dir, one_thread):
    """The tiny random-weight Llama and its MLP inputs on 4 × 64 random tokens."""
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    windows = torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(3))
    return adapter, collect_inputs(adapter, windows)


@pytest.fixture(scope="module")
def built(tiny):
    """``(allocation, cost)`` -> the TEAL modules of the tiny model."""
    adapter, inputs = tiny
    return {(a, c): teal_modules(adapter, inputs, c, a) for a in ("uniform", "greedy") for c in (0.75, 0.5)}


def _dense_macs(adapter) -> int:
    return sum(3 * adapter.d_model * lay.d_ffn for lay in adapter.layers)


def test_zero_sparsity_is_the_dense_mlp_exactly(tiny):
    wg, wu, wd = random_glu(24, 40, seed=2)
    x = torch.randn(2, 6, 24)
    mod = teal_from_dense(wg, wu, wd, "silu", 0.0, 0.0, 0.0, 0.0)
    with torch.no_grad():
        assert torch.equal(mod(x), dense_glu(x, wg, wu, wd))
    assert mod.active_param_count() == 3 * 24 * 40
    # calibrated at the dense cost: thresholds 0, so no entry of any token is ever zeroed
    adapter, inputs = tiny
    full = calibrate_layer(inputs.mlp_inputs[0], *dense_weights(adapter, 0), adapter.activation, 1.0)
    assert (full.t_in, full.t_mid, full.s_in, full.s_mid) == (0.0, 0.0, 0.0, 0.0) and full.calibration_error == 0.0
    with torch.no_grad():
        assert torch.equal(full(x.new_ones(3, 64) * 1e-30), dense_glu(x.new_ones(3, 64) * 1e-30, *dense_weights(adapter, 0)))


def test_spec_round_trip_and_layer_kind():
    wg, wu, wd = random_glu(16, 24, seed=1)
    mod = teal_from_dense(wg, wu, wd, "silu", 0.25, 0.5, 0.3, 0.4)
    assert mod.spec == {"kind": "teal", "d_model": 16, "d_ffn": 24, "act": "silu", "t_in": 0.25, "t_mid": 0.5,
                        "s_in": 0.3, "s_mid": 0.4}
    assert LAYER_KINDS["teal"] is TealGLU and layer_spec(mod) == mod.spec
    again = build_layer_module(mod.spec)
    again.load_state_dict(mod.state_dict())
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.equal(again(x), mod(x))
    assert mod.active_param_count() == round(16 * 24 * (2 * 0.7 + 0.6))
    with pytest.raises(ValueError, match="kind 'teal'"):
        TealGLU({**mod.spec, "kind": "abstopk"})


def test_quantile_threshold_zeroes_the_requested_fraction():
    m = torch.rand(1000)
    for s in (0.0, 0.1, 0.5, 0.999, 1.0):
        assert (m < quantile_threshold(m, s)).float().mean().item() == pytest.approx(s, abs=1e-3)
    assert quantile_threshold(m, 0.0) == 0.0 and math.isfinite(quantile_threshold(m, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_one_pass_sparsification_zeroes_exactly_the_entries_below_the_threshold(dtype):
    """``magnitude_sparsify``'s ``hardshrink`` against TEAL's definition in three passes: thresholds equal to entries'
    magnitudes (which stay), between them, subnormal, below float32's smallest, past float32's range and infinite."""
    from moelab.engine.runtime.moelab_teal import magnitude_sparsify

    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")], dtype=dtype)
    for t in x.abs().flatten()[3:40].tolist() + [0.31, 1e-46, 1e-45, 1e-41, 1e39, 1e300, math.inf]:
        assert torch.equal(magnitude_sparsify(x, t).nan_to_num(7.0), x.masked_fill(x.abs() < t, 0.0).nan_to_num(7.0)), t
    assert magnitude_sparsify(x, 0.0) is x


def test_calibrated_sparsities_are_measured_on_the_calibration_inputs(tiny, built):
    adapter, inputs = tiny
    act = ACT2FN[adapter.activation]
    for (alloc, cost), modules in built.items():
        for i, mod in modules.items():
            x = inputs.mlp_inputs[i]
            xs = torch.where(x.abs() < mod.t_in, 0.0, x)
            h = act(xs @ mod.gate_proj.weight.T) * (xs @ mod.up_proj.weight.T)
            assert (xs == 0).float().mean().item() == pytest.approx(mod.s_in, abs=0.02), (alloc, cost, i)
            assert (h.abs() < mod.t_mid).float().mean().item() == pytest.approx(mod.s_mid, abs=0.02), (alloc, cost, i)
            with torch.no_grad():  # the module computes exactly that
                hs = torch.where(h.abs() < mod.t_mid, 0.0, h)
                torch.testing.assert_close(mod(x), hs @ mod.down_proj.weight.T)


def test_both_allocations_hit_the_cost(tiny, built):
    adapter, _ = tiny
    for (alloc, cost), modules in built.items():
        assert teal_flops_fraction(modules, _dense_macs(adapter)) == pytest.approx(cost, abs=1e-3), alloc
        for mod in modules.values():
            assert mod.active_param_count() / (3 * mod.d_model * mod.d_ffn) == pytest.approx(cost, abs=1e-3)
            assert teal_cost(mod.s_in, mod.s_mid) == pytest.approx(cost, abs=1e-9)
        if alloc == "uniform":
            assert all(m.s_in == m.s_mid == pytest.approx(1 - cost) for m in modules.values())
    report = teal_layers(built[("greedy", 0.5)])
    assert report["layers"] == [0, 1, 2] and len(report["s_in"]) == len(report["s_mid"]) == 3


def test_greedy_is_no_worse_than_uniform_per_layer(built):
    for cost in (0.75, 0.5):
        greedy, uniform = built[("greedy", cost)], built[("uniform", cost)]
        for i in greedy:
            assert greedy[i].calibration_error <= uniform[i].calibration_error + 1e-6, (cost, i)
            assert greedy[i].calibration_error > 0


def test_greedy_spends_a_planted_sparse_down_input_first():
    wg, wu, wd = random_glu(32, 64, seed=4)
    wg[::2] = 0.0  # silu(0) = 0: half of the down projection's input is exactly zero on every token
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(5))
    free = 1 - 0.5 / 3  # zeroing those costs no error and saves a sixth of the FFN
    mod = calibrate_layer(x, wg, wu, wd, "silu", free)
    assert mod.s_mid == pytest.approx(0.5, abs=1e-9) and mod.s_in == pytest.approx(0.0, abs=1e-9)
    assert mod.calibration_error < 1e-6
    assert calibrate_layer(x, wg, wu, wd, "silu", free, "uniform").calibration_error > 0.01
    deeper = calibrate_layer(x, wg, wu, wd, "silu", 0.6)
    assert deeper.s_mid >= 0.5 - 1e-9 and teal_cost(deeper.s_in, deeper.s_mid) == pytest.approx(0.6)


def test_export_round_trip(tiny_model, data_dir, tmp_path, built):
    """A TEAL layer is a runtime layer kind: it exports (moelab format) and loads back to the same logits."""
    from moelab.engine.runtime.export import build_moe_model, export_model, load_exported

    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)  # its own copy: build_moe_model wraps it in place
    teal = built[("greedy", 0.5)][1]
    moe = build_moe_model(adapter, {1: teal_from_dense(*dense_weights(adapter, 1), adapter.activation, teal.t_in,
                                                          teal.t_mid, teal.s_in, teal.s_mid)})
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = moe(input_ids=ids).logits
    loaded = load_exported(export_model(moe, tmp_path / "m", adapter.tokenizer, {"run": 1}))
    assert [e["kind"] for e in loaded.config.moe_layers] == ["dense", "teal", "dense"]
    assert type(loaded.moe_modules()[1]).__name__ == "TealGLU"
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)


def test_refused_by_the_native_export():  # GGUF: tests/engine/test_gguf_export.py
    from moelab.engine.runtime.native_export import NativeExportError, _refuse_layer_kinds

    with pytest.raises(NativeExportError, match="TEAL activation-sparse GLU"):
        _refuse_layer_kinds([None, {"kind": "teal"}])


@pytest.fixture(scope="module")
def conversion(tiny_model, data_dir, tmp_path_factory):
    return tiny_conversion(tiny_model, data_dir, tmp_path_factory, n_experts=4, alpha_min=0.2, alpha_max=0.7)


def test_evaluation_has_a_teal_row_at_the_conversions_cost(conversion, data_dir, one_thread):
    from moelab.engine.runs import read_conversion, run_evaluation

    report = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0)
    teal = report["results"]["teal"]
    cost = read_conversion(conversion)["summary"]["ffn_flops_fraction"]
    assert teal["ffn_flops_fraction"] == pytest.approx(cost, abs=1e-3)
    assert math.isfinite(teal["perplexity"]) and teal["perplexity"] > 1
    assert teal["allocation"] == "greedy" and teal["calibration_tokens"] >= 256 and len(teal["s_in"]) == 3
    assert "column-skipping" in report["notes"]["teal"] and report["timings"]["teal_build_s"] > 0
    assert len(teal["reconstruction_error"]) == 3


def test_a_second_evaluation_reuses_the_stored_thresholds_for_the_same_numbers(conversion, data_dir, one_thread):
    from moelab.engine.evaluation import reference_scores
    from moelab.engine.runs import run_evaluation

    kw = dict(data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0)
    for stale in (data_dir / reference_scores.TEAL_DIR).glob("*.json"):
        stale.unlink()  # thresholds an earlier run of the suite stored: this test calibrates first
    first = run_evaluation(conversion, **kw)["results"]["teal"]
    again = run_evaluation(conversion, **kw)["results"]["teal"]
    assert "thresholds_reused" not in first and again["thresholds_reused"] is True
    for key in ("perplexity", "s_in", "s_mid", "calibration_error", "ffn_flops_fraction", "calibration_tokens"):
        assert again[key] == pytest.approx(first[key], rel=1e-6, nan_ok=True), key


def test_evaluation_goes_on_without_teal_when_the_profile_is_gone(tiny, tmp_path):
    from moelab.engine.runs import _teal_baseline

    record = {"summary": {"ffn_flops_fraction": 0.75}, "params": {}, "profile": str(tmp_path / "deleted")}
    modules, info = _teal_baseline(tiny[0], record, None, NO_PROGRESS)
    assert modules is None and "TEAL not built" in info["note"] and "no such profile" in info["note"]


@pytest.mark.parametrize("native", [True, False])
def test_the_row_skipping_decode_kernel_computes_the_dense_products(native, monkeypatch, tmp_path):
    """TEAL's CPU decode step gives what the dense products with the zeros in give: the native call
    (``moelab_native.teal_decode``: the whole FFN, reading the rows some token of the step needs, each once for them)
    up to ``DECODE_TOKENS`` tokens, and without it torch's ``skip_rows`` (one bag per thread over the rows of nonzero
    inputs) up to ``ROW_SKIP_MAX_TOKENS``; a token with every input zeroed gives zeros; more tokens, or a gradient,
    take the dense path; the weights stay in the decode layout through ``use_decode_layout``. Natively a token's
    output has the same bits alone as in a step of any size up to eight, with any thread count."""
    from moelab.engine.runtime import moelab_native, moelab_teal
    from moelab.engine.runtime.moelab_teal import row_major_t, skip_rows

    monkeypatch.setenv("MOELAB_KERNEL_CACHE", str(tmp_path))
    if not native:
        monkeypatch.setenv("MOELAB_NATIVE_KERNELS", "0")
    monkeypatch.setattr(moelab_native, "_tried", False)
    monkeypatch.setattr(moelab_native, "_library", None)
    if native and moelab_native.library() is None:
        pytest.skip("needs a C compiler")
    wg, wu, wd = random_glu(48, 80, seed=4)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(5))
    x[1] = 0.01  # every input under the threshold: no row read, an output of zeros
    mod = teal_from_dense(wg, wu, wd, "silu", 0.5, 0.05, 0.4, 0.3)
    assert mod.gate_proj.weight.stride() == (1, 80) and mod.down_proj.weight.stride() == (1, 48)  # decode layout
    sparse = moelab_teal.magnitude_sparsify(x, 0.5)
    torch.testing.assert_close(skip_rows(sparse[:2], row_major_t(wg)), sparse[:2] @ wg.t(), rtol=1e-5, atol=1e-6)
    h = ACT2FN["silu"](F.linear(sparse, wg)) * F.linear(sparse, wu)
    want = F.linear(moelab_teal.magnitude_sparsify(h, 0.05), wd)
    most = moelab_native.DECODE_TOKENS if native else moelab_teal.ROW_SKIP_MAX_TOKENS
    decoded = mod._native_call if native else mod._row_product
    steps = {}
    for threads in (1, 2, 3):  # the native call: output columns per thread; skip_rows: a bag per thread and token
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        with torch.no_grad():
            for n in range(1, most + 1):
                assert decoded(x[:n])
                steps[threads, n] = mod(x[:n])
                torch.testing.assert_close(steps[threads, n], want[:n], rtol=1e-5, atol=1e-5)
            assert torch.equal(mod(x[:2])[1], torch.zeros(48))
    assert not decoded(x[: most + 1])
    assert not decoded(x[:1].clone().requires_grad_())  # training: the dense products
    if native:  # alone, in a step of four or eight, on 1-3 threads: the same sums in the same order, the same bits
        assert all(torch.equal(out, steps[1, most][: len(out)]) for out in steps.values())
        assert mod._native_call(x[:1].double()) is None and not mod._row_product(x[: most + 1])


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("d_model, d_ffn", [(48, 96), (40, 72)])
def test_the_native_teal_call_zeroes_what_torch_zeroes(act, d_model, d_ffn):
    """``teal_decode`` at widths the 24-column micro-kernels tile (48 / 96) and ones they do not (40 / 72), for every
    activation the kernels have: the torch path's values; thresholds of 0 zero nothing (the dense MLP); an input
    exactly at the threshold is kept, as ``magnitude_sparsify`` keeps it; a threshold with no float32 below it (one that
    rounds to 0) takes the torch path."""
    from moelab.engine.runtime.moelab_teal import magnitude_sparsify

    if moelab_native.library() is None:
        pytest.skip("needs a C compiler")
    wg, wu, wd = random_glu(d_model, d_ffn, seed=7)
    x = torch.randn(8, d_model, generator=torch.Generator().manual_seed(8))
    x[0, :4] = 0.5  # at the threshold: kept (|x| < t is zeroed)
    for t_in, t_mid in ((0.5, 0.05), (0.0, 0.0)):
        mod = teal_from_dense(wg, wu, wd, act, t_in, t_mid, 0.4, 0.3)
        xs = magnitude_sparsify(x, t_in)
        want = F.linear(magnitude_sparsify(ACT2FN[act](F.linear(xs, wg)) * F.linear(xs, wu), t_mid), wd)
        with torch.no_grad():
            assert mod._native_call(x) is not None
            torch.testing.assert_close(mod(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want, dense_glu(x, wg, wu, wd, act))  # the last pair zeroed nothing
    assert teal_from_dense(wg, wu, wd, act, 1e-50, 0.0, 0.4, 0.3)._native_call(x) is None


def test_the_evaluation_times_teal_beside_the_conversion(conversion, data_dir, one_thread):
    """TEAL is timed like the conversion (same rounds, the dense model with its MLPs swapped in): the speed report
    holds its seconds and speed-ups per phase, the CLI text names it, and the dense model is left as it was."""
    from moelab.engine.evaluation.speed import SpeedProtocol, describe
    from moelab.engine.runs import run_evaluation

    protocol = SpeedProtocol(repeats=1, decode_steps=2, prefill_tokens=32)
    report = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0,
                            speed=protocol)
    kernels = moelab_native.library() is not None  # the dense model in moelab's kernels is timed beside them
    for phase, entry in report["speed"]["phases"].items():
        assert set(entry["seconds"]) == {"dense", "converted", "teal", *([KERNEL_DENSE] if kernels else [])}, phase
        assert entry["speedup"]["teal"] == pytest.approx(entry["seconds"]["dense"] / entry["seconds"]["teal"])
    text = "\n".join(line for line in describe(report["speed"]) if "busy machine" not in line)  # a busy CI host adds one
    assert text.count("teal ") == 3 and text.count("converted ") == 3 + kernels
    if kernels:  # the conversion's speed over that baseline, per phase, as the rounds give it
        gain = sparsity_gain(report["speed"])
        assert text.count(f"{KERNEL_LABEL} ") == 3 and set(gain) == set(report["speed"]["phases"])
        assert ("converted over the dense model in moelab's kernels (the sparsity's own gain): decode, batch 1 "
                f"{gain['decode_b1']:.2f}×, decode, batch 8 {gain['decode_b8']:.2f}×, prefill {gain['prefill']:.2f}×") in text
    again = run_evaluation(conversion, data_dir=data_dir, n_windows=2, seq_len=16, write=False, mc_per_task=0,
                           baselines=False, speed=protocol)
    assert again["results"]["dense"]["perplexity"] == pytest.approx(report["results"]["dense"]["perplexity"])
    assert "teal" not in again["speed"]["phases"]["prefill"]["seconds"]
