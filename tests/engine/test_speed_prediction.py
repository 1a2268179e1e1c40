"""A plan's speed predicted from measured kernel times (``core.speed_prediction``, ``evaluation.speed_table``): the fit
recovers known costs, the prediction scales the dense model's FFN share by the planned layers' time over the dense
FFN's, the table measures that share with the model's FFNs zeroed in the same rounds, tables are found and
cached per model and machine, a profile measures them once, a conversion records its prediction, and on the default
model the prediction meets the measurement within 20%."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from moelab.engine.core.speed_prediction import (FEATURES, TABLE_DIR, TABLE_VERSION, busy_words, describe_predicted, find_table, fit, layer_features,
                                                  plan_layers, predict, predicted_summary, runs_dense,
                                                  kernel_dense_layers, kernel_dense_words)

COEF = np.array([2e-5, 1e-9, 3e-9, 2e-9, 1e-6, 1e-10, 4e-10, 5e-10])  # seconds per unit of each feature


def _grid_rows() -> list[dict]:
    rows = []
    for m in (8, 16, 32, 64):
        for shared, k, keep in ((0, 2, 1.0), (64, 4, 1.0), (128, 1, 1.0), (64, 4, 0.5)):
            layer = {"kind": "moe", "d_shared": shared, "n_routed": (512 - shared) // m, "expert_size": m, "top_k": k,
                     "down_keep": keep}
            rows.append({"layer": layer, "seconds": {p: float(layer_features(layer, t) @ COEF)
                                                     for p, t in (("decode_b1", 1), ("prefill", 512))}})
    return rows


def _table(rows: list[dict]) -> dict:
    phases = {p: {"tokens": t, "dense_model_s": 0.05 * t ** 0.5, "dense_ffn_s": float(layer_features({"kind": "dense", "d_ffn": 512}, t) @ COEF),
                  "ffn_share": 0.6, "coef": fit(rows, t, p).tolist()} for p, t in (("decode_b1", 1), ("prefill", 512))}
    return {"version": TABLE_VERSION, "model": {"source": "m"}, "d_ffn": 512, "n_layers": 4, "machine": "cpu: test", "dtype": "float32",
            "threads": 2, "measured_at": "2026-01-01T00:00:00+00:00", "phases": phases}


def test_the_fit_recovers_the_costs_and_the_prediction_adds_the_planned_layers():
    rows = _grid_rows()
    table = _table(rows)
    for phase in table["phases"].values():  # every grid layout's time back from the fitted coefficients
        got = [float(layer_features(r["layer"], phase["tokens"]) @ np.asarray(phase["coef"])) for r in rows]
        want = [float(layer_features(r["layer"], phase["tokens"]) @ COEF) for r in rows]
        np.testing.assert_allclose(got, want, rtol=1e-3)
    plan = [{"kind": "dense"}, {"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "top_k": 6},
            {"kind": "dense"}, {"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "top_k": 6, "down_keep": 0.5}]
    out = predict(table, plan)
    for phase, entry in table["phases"].items():
        t = entry["tokens"]
        # the model's FFNs take 60% of its time; each planned layer takes its time alone over the dense FFN's of that
        ratios = [float(layer_features(l if l["kind"] == "moe" else {"kind": "dense", "d_ffn": 512}, t) @ COEF) / entry["dense_ffn_s"]
                  for l in plan]
        want = entry["dense_model_s"] * (0.4 + 0.6 * sum(ratios) / 4)
        assert out[phase]["seconds"] == pytest.approx(want, rel=1e-3)
        assert out[phase]["speedup"] == pytest.approx(entry["dense_model_s"] / want, rel=1e-3)
    # all layers dense: the dense model's own time
    assert predict(table, [{"kind": "dense"}] * 4)["prefill"]["speedup"] == pytest.approx(1.0, rel=1e-3)
    assert len(FEATURES) == len(COEF)


def test_the_prediction_runs_the_kernels_the_runtime_chooses():
    """``runs_dense`` (numpy, for the API) answers as ``moelab_kernels.select_kernel`` does on CPU, and a layer run
    dense at prefill costs its routed rows as dense rows, no pairs."""
    from moelab.engine.core import speed_prediction
    from moelab.engine.runtime import moelab_kernels
    from moelab.engine.runtime.moelab_moe import MoeExperts

    assert speed_prediction.DENSE_NEURONS == moelab_kernels.DENSE_NEURONS
    assert speed_prediction.DENSE_SHARE == moelab_kernels.DENSE_SHARE
    assert speed_prediction.GATHER_MAX_TOKENS == moelab_kernels.GATHER_MAX_TOKENS
    for e, m, k in ((128, 12, 40), (64, 24, 8), (64, 24, 16), (16, 96, 4), (16, 96, 12), (8, 64, 1)):
        experts = MoeExperts(e, m, 32)
        layer = {"kind": "moe", "d_shared": 0, "n_routed": e, "expert_size": m, "top_k": k}
        for tokens in (1, 8, 9, 512):
            top = torch.zeros(tokens, k, dtype=torch.long)
            chosen = experts.resolve_impl(torch.zeros(tokens, 32), top, needs_grad=False)
            assert runs_dense(layer, tokens) == (chosen == "dense"), (e, m, k, tokens, chosen)
    dense_at_prefill = layer_features({"kind": "moe", "d_shared": 0, "n_routed": 128, "expert_size": 12, "top_k": 40}, 512)
    assert dense_at_prefill[3] == dense_at_prefill[4] == 0 and dense_at_prefill[6] == 512 * 128 * 12


def test_a_prefill_of_large_experts_runs_torchs_kernels_and_the_prediction_says_the_same(monkeypatch):
    """Past ``NATIVE_PREFILL_MAX_EXPERT_BYTES`` an expert leaves a prefill (the native pairs kernel walks each selected
    expert's weights once per block of a few tokens) to torch's GEMMs, however many are selected; decode steps stay
    native. The block's choice, the kernel table's mirror (numpy) and the features agree, and both paths compute the
    same block."""
    from moelab.engine.core import speed_prediction
    from moelab.engine.runtime import moelab_native
    from moelab.engine.runtime.moelab_moe import MoeFFN

    assert speed_prediction.NATIVE_PREFILL_MAX_EXPERT_BYTES == moelab_native.NATIVE_PREFILL_MAX_EXPERT_BYTES
    assert moelab_native.DECODE_TOKENS == speed_prediction.GATHER_MAX_TOKENS
    d = 256
    for m, e, k in ((64, 8, 2), (512, 8, 2), (512, 8, 6), (1024, 4, 1)):
        spec = {"kind": "moe", "d_model": d, "d_shared": 0, "n_routed": e, "expert_size": m, "top_k": k,
                "router": "centroid", "combine": "sum"}
        block = MoeFFN(spec).eval()
        block.use_decode_layout()
        large = 3 * m * d * 4 > moelab_native.NATIVE_PREFILL_MAX_EXPERT_BYTES
        for tokens in (1, 8, 9, 512, 2048):
            want = tokens <= 8 or not large
            x = torch.zeros(tokens, d)
            assert speed_prediction.runs_native_prefill(tokens, m, d) == want, (m, e, k, tokens)
            assert moelab_native.runs_native_prefill(tokens, m, d) == want, (m, e, k, tokens)
            if moelab_native.library() is not None:
                with torch.no_grad():
                    assert block._native_routed(x, None) == want, (m, e, k, tokens)
            layer = {"kind": "moe", "d_shared": 0, "n_routed": e, "expert_size": m, "top_k": k, "down_keep": 0.5}
            native = layer_features(layer, tokens, native=True, d_model=d)
            assert np.array_equal(native, layer_features(layer, tokens, native=want, d_model=0 if want else d))
    with torch.inference_mode():  # torch's kernels and the native ones compute the same block
        spec = {"kind": "moe", "d_model": d, "d_shared": 32, "n_routed": 8, "expert_size": 512, "top_k": 2,
                "router": "centroid", "combine": "sum"}
        block = MoeFFN(spec).eval()
        block.use_decode_layout()
        x = torch.randn(64, d)
        ours = block(x)
        monkeypatch.setattr("moelab.engine.runtime.moelab_moe.runs_native_prefill", lambda *a: True)
        assert torch.allclose(ours, block(x), atol=1e-5, rtol=1e-4)


def test_where_the_native_kernels_run_a_prefill_computes_the_selected_pairs_with_their_down_rows_whole():
    """The native kernels (the table says whether they ran when it was measured) compute the selected pairs only
    below ``NATIVE_DENSE_SHARE`` (every expert from there, at a prefill), and their prefill multiplies every down
    row of a selected expert; a decode step reads the kept ones."""
    from moelab.engine.runtime import moelab_native

    from moelab.engine.core import speed_prediction

    for name in ("NATIVE_DENSE_SHARE", "NATIVE_DENSE_SHARE_LONG", "NATIVE_LONG_TOKENS"):
        assert getattr(speed_prediction, name) == getattr(moelab_native, name)
    layer = {"kind": "moe", "d_shared": 0, "n_routed": 128, "expert_size": 12, "top_k": 40, "down_keep": 0.5}
    assert runs_dense(layer, 512) and not runs_dense(layer, 512, native=True)
    most = {**layer, "top_k": 96}  # 3/4 of the experts selected: every expert in two GEMMs at a prefill, pairs at a step
    assert runs_dense(most, 512, native=True) and not runs_dense(most, 8, native=True)
    assert layer_features(most, 512, native=True)[6] == 512 * 128 * 12
    many = {**layer, "top_k": 80}  # 5/8: pairs at 512 tokens, two GEMMs at 2,048
    assert not runs_dense(many, 512, native=True) and runs_dense(many, 2048, native=True)
    # a machine whose pairs kernel beats the GEMMs at every share (its table holds the shares it measured)
    assert not runs_dense(most, 512, native=True, shares=[1.02, 1.01])
    assert not runs_dense(many, 2048, native=True, shares=[1.02, 1.01])
    assert runs_dense(many, 2048, native=True, shares=[1.02, 0.6])
    assert layer_features(most, 512, native=True, shares=[1.02, 1.01])[6] == 0
    prefill, step = layer_features(layer, 512, native=True), layer_features(layer, 1, native=True)
    assert prefill[6] == 0 and prefill[3] == 512 * 40 * 12 and prefill[4] == 512 * 40
    assert step[3] == pytest.approx(40 * 12 * 2.5 / 3) and (step == layer_features(layer, 1)).all()


def test_a_batch_touches_fewer_experts_than_it_selects_and_down_rows_kept_count():
    layer = {"kind": "moe", "d_shared": 0, "n_routed": 16, "expert_size": 32, "top_k": 4}
    one, eight = layer_features(layer, 1), layer_features(layer, 8)
    assert one[2] == pytest.approx(4 * 32)  # one token touches its k experts
    assert 4 * 32 < eight[2] < 16 * 32 and eight[3] == 8 * 4 * 32  # eight touch fewer than 8·k distinct ones
    half = layer_features({**layer, "down_keep": 0.5}, 1)
    assert half[3] == pytest.approx(one[3] * 2.5 / 3)


def test_a_native_decode_step_reads_the_shared_experts_kept_down_rows_only():
    """The whole-block decode call reads the kept rows of the shared down projection (``[d_shared, d]`` storage); a
    prefill's GEMM, or the torch path, multiplies all of them."""
    layer = {"kind": "moe", "d_shared": 300, "n_routed": 16, "expert_size": 32, "top_k": 4, "down_keep": 0.4}
    whole = {**layer, "down_keep": 1.0}
    for tokens in (1, 8):
        assert layer_features(layer, tokens, native=True)[1] == pytest.approx(tokens * 300 * 2.4 / 3)
        assert layer_features(whole, tokens, native=True)[1] == layer_features(layer, tokens)[1] == tokens * 300
    assert layer_features(layer, 512, native=True)[1] == 512 * 300


def test_down_keep_ranks_the_products_the_layer_computes():
    """Keeping each token's largest products costs a ranking of every product computed: the shared expert's and the
    selected experts' (every expert's where a prefill runs them all in two GEMMs); without down_keep, none."""
    layer = {"kind": "moe", "d_shared": 300, "n_routed": 16, "expert_size": 32, "top_k": 4, "down_keep": 0.5}
    for tokens in (1, 8, 512):
        assert layer_features(layer, tokens, native=True)[7] == tokens * (300 + 4 * 32)
        assert layer_features({**layer, "down_keep": 1.0}, tokens, native=True)[7] == 0
    most = {**layer, "top_k": 14}
    assert runs_dense(most, 512, native=True) and layer_features(most, 512, native=True)[7] == 512 * (300 + 16 * 32)
    assert layer_features({"kind": "dense", "d_ffn": 512}, 512)[7] == 0


def test_a_layer_is_no_slower_than_dense_up_to_the_top_k_where_its_predicted_time_passes_the_dense_ffns():
    from moelab.engine.core.speed_prediction import layer_ratios, top_k_no_slower

    table = _table(_grid_rows())
    layout = {"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "down_keep": 1.0}
    ratios = layer_ratios(table, layout)
    assert ratios.shape == (2, 29)
    for i, entry in enumerate(table["phases"].values()):  # each top-k's time over the dense FFN's, as predicted
        for k in (0, 7, 28):
            want = float(layer_features({**layout, "top_k": k}, entry["tokens"]) @ np.asarray(entry["coef"]))
            assert ratios[i, k] == pytest.approx(want / entry["dense_ffn_s"])
    ok = top_k_no_slower(table, layout)
    assert ok.tolist() == (ratios <= 1).all(axis=0).tolist()
    assert ok[0] and not ok[-1]  # the shared part alone beats dense; every expert and a router does not
    assert ok[: int(np.argmin(ok))].all()  # the time rises with k here: a prefix of top-k is offered
    # a margin offers the top-k predicted at most 1 - margin of the dense FFN's time: fewer, and each of them in time
    held = top_k_no_slower(table, layout, margin=0.1)
    assert held.tolist() == (ratios <= 0.9).all(axis=0).tolist()
    assert held.sum() < ok.sum() and not (held & ~ok).any()
    # a native table predicts the prefill's choice the machine measured: its shares, else the fixed ones
    native = {**table, "native": True}
    prefill = list(table["phases"]).index("prefill")
    for shares, gemms_from in ((None, 0.7), ([1.02, 1.01], None), ([0.5, 0.4], 0.5)):
        ratios = layer_ratios({**native, **({"native_dense_shares": shares} if shares else {})}, layout)
        entry = table["phases"]["prefill"]
        for k in (7, 20, 27):
            feats = layer_features({**layout, "top_k": k}, entry["tokens"], native=True)
            assert (feats[6] > 0) == (k >= 28 * 0.7)  # the fixed shares': every expert from 0.7 selected
            want = layer_features({**layout, "top_k": k}, entry["tokens"], native=True, shares=shares)
            assert (want[6] > 0) == (gemms_from is not None and k >= 28 * gemms_from)
            assert ratios[prefill, k] == pytest.approx(float(want @ np.asarray(entry["coef"])) / entry["dense_ffn_s"])


def test_a_converted_layers_measured_touched_experts_replace_the_uniform_count():
    """A batch of real sequences repeats experts: a converted layer's measured count (``experts_touched``: distinct
    experts per position over the batch's rows) replaces the uniform ``E·(1-(1-k/E)^T)`` at that many tokens only."""
    layer = {"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "top_k": 6, "down_keep": 1.0}
    seen = {**layer, "touched": {"8": 9.5}}
    assert layer_features(seen, 8)[2] == pytest.approx(9.5 * 16)
    assert layer_features(layer, 8)[2] == pytest.approx(28 * (1 - (1 - 6 / 28) ** 8) * 16)
    np.testing.assert_array_equal(layer_features(seen, 1), layer_features(layer, 1))  # other token counts: uniform
    table = _table(_grid_rows())
    assert predict(table, [seen])["decode_b1"] == predict(table, [layer])["decode_b1"]
    assert "uniform" in predicted_summary(table, [layer])["note"] and "measured" in predicted_summary(table, [seen])["note"]


def test_plan_rows_become_layers_and_words_say_slower_phases():
    rows = [{"d_shared": 96, "n_routed": 60, "d_expert": 24, "top_k": 10}]
    assert plan_layers(rows, 0.5) == [{"kind": "moe", "d_shared": 96, "n_routed": 60, "expert_size": 24, "top_k": 10, "down_keep": 0.5}]
    table = _table(_grid_rows())
    plan = [{"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "top_k": 6}] * 4
    summary = predicted_summary(table, plan)
    assert set(summary["phases"]) == {"decode_b1", "prefill"} and summary["machine"] == "cpu: test"
    words = describe_predicted(summary)
    for phase, v in summary["phases"].items():
        assert f"{v['speedup']:.2f}×" in words
    slow = [p for p, v in summary["phases"].items() if v["speedup"] < 1]
    assert ("SLOWER than dense" in words) == bool(slow)
    close = {**summary, "phases": {"decode_b1": {"speedup": 1.03}, "prefill": {"speedup": 0.98}}}
    assert "; SLOWER than dense in prefill (0.98×) and within the prediction's 5% error of dense in decode batch 1 " \
           "(1.03×): it may measure slower" in describe_predicted(close)
    close["phases"]["prefill"]["speedup"] = 1.06
    assert "; no phase slower than dense, but within the prediction's 5% error of dense in decode batch 1 (1.03×): " \
           "it may measure slower" in describe_predicted(close)
    assert "measured (once" in predicted_summary(None, plan)["note"]
    assert "low-rank" in predicted_summary(table, [{"kind": "low-rank"}])["note"]
    assert "kernel_dense" not in summary and "moelab's kernels" not in words  # a table without the native kernels


def test_a_plan_is_predicted_beside_the_dense_model_in_moelabs_kernels():
    """A table of the native kernels predicts the dense model with every layer all-shared (the grid's layout that a
    decode step runs in the whole-block call) beside the plan, and the words give both and the plan over it."""
    table = {**_table(_grid_rows()), "native": True}
    table["phases"]["decode_b1"]["dense_ffn_s"] *= 2  # torch's dense MLP twice the native call's time at a decode step
    plan = [{"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "top_k": 6}] * 4
    summary = predicted_summary(table, plan)
    assert kernel_dense_layers(table) == [{"kind": "dense"}] * 4
    kernels = {p: v["speedup"] for p, v in predict(table, kernel_dense_layers(table)).items()}
    assert summary["kernel_dense"] == kernels and set(kernels) == set(summary["phases"])
    ratio = [summary["phases"][p]["speedup"] / kernels[p] for p in ("decode_b1", "prefill")]
    want = (f"; the dense model in moelab's kernels {kernels['decode_b1']:.2f}× / {kernels['prefill']:.2f}×, "
            f"the plan over it {ratio[0]:.2f}× / {ratio[1]:.2f}×")
    assert kernel_dense_words(summary) == want and want in describe_predicted(summary)
    assert kernel_dense_words({**summary, "kernel_dense": {}}) == ""
    # a kept-dense layer decodes as the grid's all-shared layout (runtime.moelab_dense) and prefills as the dense MLP
    all_shared = [{"kind": "moe", "d_shared": 512, "n_routed": 0, "expert_size": 0, "top_k": 0, "down_keep": 1.0}] * 4
    assert kernels["decode_b1"] == pytest.approx(predict(table, all_shared)["decode_b1"]["speedup"])
    assert kernels["decode_b1"] == pytest.approx(1 / (0.4 + 0.6 / 2)) and kernels["prefill"] == pytest.approx(1.0)


def test_the_newest_table_of_the_models_source_is_found(tmp_path):
    folder = tmp_path / TABLE_DIR
    folder.mkdir()
    for name, source, when in (("a", "m", "2026-01-01"), ("b", "m", "2026-02-01"), ("c", "other", "2026-03-01")):
        (folder / f"{name}.json").write_text(json.dumps({"version": TABLE_VERSION, "model": {"source": source}, "measured_at": when}))
    (folder / "broken.json").write_text("{")
    assert find_table(tmp_path, "m")["measured_at"] == "2026-02-01"
    assert find_table(tmp_path, "nope") is None and find_table(tmp_path / "missing", "m") is None


def data_without_tables(data_dir, tmp_path):
    """A data directory with the suite's models and built-in sets and an empty speed-table folder."""
    data = tmp_path / "data"
    data.mkdir()
    for entry in os.listdir(data_dir):
        if entry != TABLE_DIR:
            (data / entry).symlink_to(data_dir / entry)
    return data


def test_a_profile_measures_the_table_once_and_a_conversion_records_its_prediction(tiny_model, data_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.engine.test_profiling import make_set
    from moelab.engine.methods.expertweaver import ExpertWeaverParams
    from moelab.engine.profiling.profiler import ProfileSettings
    from moelab.engine.runs import run_conversion, run_profile

    data = data_without_tables(data_dir, tmp_path)
    model = str(tiny_model("llama"))
    run_profile(model, make_set(n=12, tasks=3, seed=1), tmp_path / "p0", ProfileSettings(max_tokens=32, batch_tokens=128),
                samples=None, data_dir=data, time_kernels=False)  # MOELAB_TIME_KERNELS=0
    assert not list((data / TABLE_DIR).glob("*.json"))
    prof = run_profile(model, make_set(n=12, tasks=3, seed=1), tmp_path / "p", ProfileSettings(max_tokens=32, batch_tokens=128),
                       samples=None, data_dir=data)
    (path,) = (data / TABLE_DIR).glob("*.json")
    table = json.loads(path.read_text())
    assert table["model"]["source"] == prof.manifest["model"]["source"] and table["n_layers"] == 3
    assert len(table["grid"]) >= 8 and set(table["phases"]) == {"decode_b1", "decode_b8", "prefill"}
    assert all(len(p["coef"]) == len(FEATURES) and p["dense_model_s"] > p["dense_ffn_s"] > 0 and 0 <= p["ffn_share"] < 1
               for p in table["phases"].values()), table["phases"]
    from moelab.engine.runtime import moelab_native

    if table["native"]:  # the prefill's choice the grid ran under, as the prediction must make it
        assert table["native_dense_shares"] == list(moelab_native.dense_shares())
    stamp = path.stat().st_mtime_ns
    run_profile(model, make_set(n=12, tasks=3, seed=2), tmp_path / "p2", ProfileSettings(max_tokens=32, batch_tokens=128),
                samples=None, data_dir=data)
    assert path.stat().st_mtime_ns == stamp  # measured once per model and machine
    record = run_conversion(tmp_path / "p", ExpertWeaverParams(n_experts=4, alpha_max=0.5), tmp_path / "c", data_dir=data)
    predicted = record["summary"]["predicted_speed"]
    layers = json.loads((tmp_path / "c" / "config.json").read_text())["moe_layers"]
    assert predicted["phases"]["decode_b1"]["speedup"] == pytest.approx(predict(table, layers)["decode_b1"]["speedup"])
    assert json.loads((tmp_path / "c" / "conversion.json").read_text())["summary"]["predicted_speed"] == predicted
    # the prediction counts the experts 8 held-out sequences touch per step, measured on the converted model
    from moelab.engine.evaluation.metrics import experts_touched, heldout_windows, routed_modules
    from moelab.engine.runtime.export import load_exported

    assert "touches measured on held-out text" in predicted["note"]
    converted = load_exported(tmp_path / "c").eval()
    seen = experts_touched(converted, heldout_windows(AutoTokenizer.from_pretrained(tmp_path / "c"), data, 64, 8))
    routed = routed_modules(converted)
    assert seen and set(seen) == {i for i, m in routed.items() if m.top_k > 0}
    assert all(routed[i].top_k <= n <= min(routed[i].n_routed, 8 * routed[i].top_k) for i, n in seen.items()), seen


def test_a_guarded_conversion_times_the_kernels_its_profile_did_not(tiny_model, data_dir, tmp_path):
    """A profile made with the timing off, or before the native kernels changed, leaves no table of this build here: a
    conversion whose plan this machine's kernel times guard (``speed_guard="machine"``, part of ``--recipe best``)
    times them first, once, and the guard applies; with ``time_kernels=False`` (MOELAB_TIME_KERNELS=0) it does not
    and the record says so."""
    from moelab.engine.methods.expertweaver import ExpertWeaverParams
    from moelab.engine.profiling.profiler import ProfileSettings
    from moelab.engine.runs import run_conversion, run_profile

    data = data_without_tables(data_dir, tmp_path)
    run_profile(str(tiny_model("llama")), "builtin:mixed", tmp_path / "p",
                ProfileSettings(max_tokens=32, batch_tokens=128), samples=12, data_dir=data,
                time_kernels=False)  # built-in text: the fit reloads it
    params = ExpertWeaverParams(n_experts=8, sparsity=0.25, router="ridge", alpha_basis="active", plan="budget",
                                down_keep=0.5, speed_guard="machine")
    off = run_conversion(tmp_path / "p", params, tmp_path / "off", data_dir=data, time_kernels=False)
    assert not off["fit"]["speed_guard"]["applied"] and "no kernel timings" in off["summary"]["speed_guard"]
    assert not list((data / TABLE_DIR).glob("*.json"))
    on = run_conversion(tmp_path / "p", params, tmp_path / "on", data_dir=data)
    (path,) = (data / TABLE_DIR).glob("*.json")
    guard = on["fit"]["speed_guard"]
    assert guard["applied"] and guard["measured_at"] == json.loads(path.read_text())["measured_at"]
    assert on["summary"]["speed_guard"].startswith("each layer offered only the top-k")
    stamp = path.stat().st_mtime_ns
    run_conversion(tmp_path / "p", params, tmp_path / "again", data_dir=data)
    assert path.stat().st_mtime_ns == stamp  # timed once


@pytest.mark.slow
def test_on_the_default_model_the_prediction_meets_the_measurement_within_20_percent(data_dir, tmp_path):
    """The default model profiled briefly, converted (ExpertWeaver, 0.5 sparsity), and timed against dense in one
    process, with the dense model in moelab's kernels beside them: each phase's predicted speed over dense within 20%
    of the measured one, the conversion's and that baseline's."""
    from moelab.engine.evaluation.kernel_dense import kernel_dense_mlps
    from moelab.engine.evaluation.kernel_gain import NAME as KERNEL_DENSE
    from moelab.engine.evaluation.metrics import heldout_windows, swapped_mlps
    from moelab.engine.evaluation.speed import SpeedProtocol, time_phases
    from moelab.engine.evaluation.speed_table import layers_with_touched, measure_table
    from moelab.engine.methods.expertweaver import ExpertWeaverParams
    from moelab.engine.models import load_model
    from moelab.engine.profiling.profiler import ProfileSettings
    from moelab.engine.runs import run_conversion, run_profile
    from moelab.engine.runtime.export import load_exported

    prof = run_profile("default", "builtin:mixed", tmp_path / "p", ProfileSettings(max_tokens=64, batch_tokens=1024), samples=8,
                       data_dir=data_dir)
    record = run_conversion(prof.path, ExpertWeaverParams(sparsity=0.5), tmp_path / "c", data_dir=data_dir)
    adapter = load_model("default", data_dir=data_dir)
    windows = heldout_windows(adapter.tokenizer, data_dir, seq_len=128, n_windows=4)
    table = find_table(data_dir, prof.manifest["model"]["source"])  # what the profile measured (or found) for the designer
    # a table timed while other processes took the CPUs says so and is not a basis for the check: timed again here
    if table is None or table["threads"] != torch.get_num_threads() or busy_words(table):
        table = measure_table(adapter.model.eval(), windows, {"source": "default", "d_model": adapter.d_model,
                                                               "d_ffn": adapter.layers[0].d_ffn, "n_layers": len(adapter.layers)})
    layers = json.loads((tmp_path / "c" / "config.json").read_text())["moe_layers"]
    converted = load_exported(tmp_path / "c").eval()
    # as the conversion predicts: with the experts a batch touches measured on held-out text
    layers = layers_with_touched(converted, adapter.tokenizer, layers, data_dir)
    predicted = predict(table, layers)
    if record["summary"]["predicted_speed"]["machine"] == table["machine"] and table["threads"] == torch.get_num_threads():
        assert record["summary"]["predicted_speed"]["phases"]["decode_b8"]["speedup"] == pytest.approx(
            predicted["decode_b8"]["speedup"], rel=1e-6)  # what `moelab convert` printed
    # beside them the dense model in moelab's kernels, as an evaluation times it, and its prediction (where native)
    kernels = {KERNEL_DENSE: adapter.model} if table.get("native") else {}
    mlps = kernel_dense_mlps(adapter) if kernels else None
    measured = time_phases({"dense": adapter.model, "converted": converted, **kernels}, windows, protocol=SpeedProtocol(repeats=5),
                           setups={KERNEL_DENSE: lambda: swapped_mlps(adapter, mlps)} if kernels else None)
    expected = {"converted": predicted, **({KERNEL_DENSE: predict(table, kernel_dense_layers(table))} if kernels else {})}
    seen = {(name, p): (round(expected[name][p]["speedup"], 3), round(m["speedup"][name], 3))
            for p, m in measured["phases"].items() for name in expected}
    print("predicted, measured speed-up per phase:", seen, f"({torch.get_num_threads()} threads)")
    for key, (want, got) in seen.items():
        assert want == pytest.approx(got, rel=0.2), seen


def test_a_decode_timing_cycles_through_as_many_copies_as_the_model_has_layers_or_as_defeat_the_cache():
    """A layer whose copies would exceed the cache cycles only through what does; a small model's layers, which fit
    the cache together, cycle through one copy per layer of the model, as its decode step reads them."""
    from moelab.engine.evaluation.speed_table import MAX_COPIES, copies, working_set_bytes

    cpu = torch.device("cpu")
    ws = working_set_bytes(cpu)
    big = 10_616_832  # the default model's dense FFN in float32
    assert copies(big, 30, cpu) == min(30, -(-ws // big))
    assert copies(100_000, 3, cpu) == 3  # a tiny model: its three layers, not 128 copies of one
    assert copies(1_000, 10_000, cpu) == MAX_COPIES
    assert copies(ws * 2, 30, cpu) == 1


def test_a_new_build_of_the_native_kernels_is_timed_again(tmp_path, monkeypatch):
    """The cached table belongs to the kernels it timed: a changed kernel source (or flags, or CPU) measures anew."""
    from moelab.engine.evaluation import speed_table
    from moelab.engine.runtime import moelab_native

    if moelab_native.library() is None:
        pytest.skip("no native kernels on this machine")
    measured = []
    monkeypatch.setattr(speed_table, "measure_table", lambda model, tokens, info: measured.append(1) or {"n": len(measured)})
    model, info = torch.nn.Linear(4, 4), {"source": "m", "d_model": 4, "d_ffn": 8, "n_layers": 1}
    assert speed_table.ensure_table(model, None, info, tmp_path) == {"n": 1}
    assert speed_table.ensure_table(model, None, info, tmp_path) == {"n": 1}  # cached
    monkeypatch.setattr(moelab_native, "build_key", lambda: "another build")
    assert speed_table.ensure_table(model, None, info, tmp_path) == {"n": 2}
    assert len(list((tmp_path / TABLE_DIR).glob("*.json"))) == 2


def test_this_machines_table_comes_before_a_newer_one_of_another_machine_and_the_note_says_whose(tmp_path):
    folder = tmp_path / TABLE_DIR
    folder.mkdir()
    for name, machine, threads, when in (("here2", "cpu: here", 2, "2026-01-01"), ("here4", "cpu: here", 4, "2026-01-02"),
                                         ("there", "cpu: there", 2, "2026-03-01")):
        (folder / f"{name}.json").write_text(json.dumps({"version": TABLE_VERSION, "model": {"source": "m"}, "machine": machine,
                                                         "threads": threads, "measured_at": when}))
    assert find_table(tmp_path, "m")["machine"] == "cpu: there"  # nothing said of where: the newest
    assert find_table(tmp_path, "m", "cpu: here")["measured_at"] == "2026-01-02"
    assert find_table(tmp_path, "m", "cpu: here", 2)["measured_at"] == "2026-01-01"
    assert find_table(tmp_path, "m", "cpu: elsewhere")["machine"] == "cpu: there"
    table = {**_table(_grid_rows()), "machine": "cpu: there"}
    plan = [{"kind": "moe", "d_shared": 64, "n_routed": 28, "expert_size": 16, "top_k": 6}] * 4
    assert "this machine's" in predicted_summary(table, plan, "cpu: there")["note"]
    other = predicted_summary(table, plan, "cpu: here")
    assert "another machine, cpu: there" in other["note"] and "this machine's" not in other["note"]
    assert "another machine, cpu: there" in describe_predicted(other)


def test_a_layout_off_the_fit_is_timed_again_and_a_busy_table_says_so(monkeypatch):
    """A grid layout whose first timing reads 20x its fit (a neighbour's burst during its rounds) is timed again, the
    second timing kept and the first recorded; the table records the CPU share other processes took, and a busy
    table's predictions say they are not to be trusted and how to measure it again."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from moelab.engine.evaluation import speed_table

    calls = []
    real = speed_table._layer_seconds

    def first_burst(make, *args, **kwargs):
        out = real(make, *args, **kwargs)
        calls.append(make().spec)
        return {p: s * 20 for p, s in out.items()} if len(calls) == 4 else out

    monkeypatch.setattr(speed_table, "_layer_seconds", first_burst)
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=256)).eval()
    info = {"source": "tiny", "d_model": 64, "d_ffn": 256, "n_layers": 4}
    table = speed_table._ffn_table(mlp, info, {"decode_b1": 1, "decode_b8": 8, "prefill": 64}, torch.device("cpu"),
                                   torch.float32, 1)
    hit = speed_table.grid(256)[3]
    assert hit in [r["layer"] for r in table["retimed"]]
    first = next(r["first_seconds"] for r in table["retimed"] if r["layer"] == hit)
    again = next(r["seconds"] for r in table["grid"] if r["layer"] == hit)
    assert all(again[p] < first[p] / 4 for p in first)  # the burst's timing is not the one kept
    assert len(calls) == len(speed_table.grid(256)) + len(table["retimed"])
    assert 0.0 <= table["others_cpu_share"] <= 1.0

    busy = {**_table(_grid_rows()), "others_cpu_share": 0.35}
    note = predicted_summary(busy, [{"kind": "dense"}] * 4)["note"]
    assert note.endswith("; the kernel times were measured while other processes took 35% of the CPUs, which slows the "
                         "MoE layers' many small parallel calls more than the dense FFN's: unreliable (delete the table "
                         "under speed-tables/ and profile again with the machine to itself)")
    assert "other processes" not in predicted_summary({**busy, "others_cpu_share": 0.05}, [{"kind": "dense"}] * 4)["note"]
