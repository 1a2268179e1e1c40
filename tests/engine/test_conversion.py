"""Conversion on a tiny random model: every equation's defining property, checked exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.engine.test_profiling import make_set
from types import SimpleNamespace

from moelab.engine.core.clustering import atopk_features
from moelab.engine.core.params import ConversionError
from moelab.engine.core.slicing import abstopk_modules, build_modules, partition_layers
from moelab.engine.methods import cmoe, expertweaver
from moelab.engine.methods.cmoe import CMoEParams
from moelab.engine.methods.expertweaver import ExpertWeaverParams, uniform_params
from moelab.engine.evaluation.metrics import (
    bootstrap_ci, evaluate_variants, heldout_windows, load_cv, reconstruction_errors, swapped_mlps,
)
from moelab.engine.core.allocation import summarize
from moelab.engine.models import load_model
from moelab.engine.profiling.store import StoredProfile, write_profile
from moelab.engine.profiling.profiler import ProfileSettings, profile_model


@pytest.fixture(scope="module")
def setup(tiny_model, data_dir, tmp_path_factory):
    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    cset = make_set(n=24, tasks=4, seed=5)
    res = profile_model(adapter, cset, ProfileSettings(max_tokens=48, batch_tokens=192, atopk_k=8))
    path = write_profile(res, cset, tmp_path_factory.mktemp("prof") / "p")
    return adapter, StoredProfile.open(path)


def convert(adapter, prof, params):
    """Plan, experts and runtime modules of a partition method, without exporting."""
    method = expertweaver if params.method == "expertweaver" else cmoe
    rows = method.plan_for(prof, params)
    experts = partition_layers(adapter, prof, rows, method.layer_builder(prof, params))
    return SimpleNamespace(plan=rows, experts=experts, modules=build_modules(adapter, experts, params))


def partition_ok(e, d_ffn):
    used = np.concatenate([e.shared, e.routed.reshape(-1)])
    assert sorted(used.tolist()) == list(range(d_ffn)), "every neuron exactly once"
    assert e.routed.shape[0] == 0 or len(set(map(len, e.routed))) == 1, "equal routed experts"


def test_expertweaver_shared_routed_and_centroid_router(setup):
    adapter, prof = setup
    params = ExpertWeaverParams(n_experts=8, sparsity=0.25, alpha_min=0.2, alpha_max=0.5, tau=0.3)
    conv = convert(adapter, prof, params)
    abs_mean = prof.column_by_layer("abs_mean")
    for e, row in zip(conv.experts, conv.plan):
        partition_ok(e, 96)
        assert len(e.shared) == row.d_shared and e.top_k == row.top_k
        # Eq. 7: the shared part holds the largest |mean activation| neurons.
        if len(e.shared) and len(e.routed):
            assert abs_mean[e.layer][e.shared].min() >= abs_mean[e.layer][e.routed.reshape(-1)].max()
        # Eq. 9: router row i = mean of the gate rows of cluster i.
        gate = adapter.layers[e.layer].gate_weight().detach().numpy()
        np.testing.assert_allclose(e.router_weights["router_weight"], gate[e.routed].mean(1), rtol=1e-6)
        assert e.router == "centroid" and e.n_iter >= 1
        # Balanced k-means objective never increases (EW Eq. 13, squared L2).
        hist = e.objective_history
        assert all(b <= a + 1e-9 for a, b in zip(hist, hist[1:]))
    assert summarize(conv.plan)["active_fraction"] == pytest.approx(0.75)
    assert conv.experts[0].summary()["objective"] is not None


def test_cmoe_rates_and_representative_router(setup):
    adapter, prof = setup
    conv = convert(adapter, prof, CMoEParams(shared=2, active=2, n_experts=8))
    rate = prof.column_by_layer("rate")
    for e in conv.experts:
        partition_ok(e, 96)
        assert rate[e.layer][e.shared].min() >= rate[e.layer][e.routed.reshape(-1)].max()  # CM Eq. 5
        gate = adapter.layers[e.layer].gate_weight().detach().numpy()
        up = adapter.layers[e.layer].up_weight().detach().numpy()
        feats = atopk_features(prof.atopk(e.layer), 96)
        for i, members in enumerate(e.routed):
            rows = np.flatnonzero((gate[members] == e.router_weights["router_gate"][i]).all(1))
            assert len(rows) == 1, "router row i is the gate row of one member of expert i (Eq. 18)"
            rep = members[rows[0]]
            np.testing.assert_array_equal(e.router_weights["router_up"][i], up[rep])
            centroid = feats[members].mean(0)
            dists = ((feats[members] - centroid) ** 2).sum(1)
            assert dists[rows[0]] == dists.min(), "the representative is closest to the centroid (Eq. 17)"


def test_all_experts_active_reproduces_the_dense_model(setup):
    adapter, prof = setup
    x = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        dense = adapter.model(input_ids=x).logits
    for router in ("representative", "gate_mass"):
        conv = convert(adapter, prof, CMoEParams(shared=3, active=5, n_experts=8, router=router))
        with swapped_mlps(adapter, conv.modules), torch.no_grad():
            moe = adapter.model(input_ids=x).logits
        torch.testing.assert_close(moe, dense, rtol=1e-4, atol=1e-4)
    with swapped_mlps(adapter, abstopk_modules(adapter, 1.0)), torch.no_grad():
        torch.testing.assert_close(adapter.model(input_ids=x).logits, dense, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # and the dense MLPs are back in place afterwards
        torch.testing.assert_close(adapter.model(input_ids=x).logits, dense, rtol=0, atol=0)


def test_indivisible_width_keeps_every_neuron(setup):
    adapter, prof = setup
    conv = convert(adapter, prof, ExpertWeaverParams(n_experts=7, sparsity=0.3, alpha_min=0.1, alpha_max=0.3))
    for e in conv.experts:
        partition_ok(e, 96)
        assert e.routed.shape[1] == 96 // 7 and (len(e.shared) - 96 % 7) % (96 // 7) == 0


def test_gate_mass_router_and_uniform_baseline(setup):
    adapter, prof = setup
    params = ExpertWeaverParams(n_experts=8, sparsity=0.5, tau=0.3, alpha_basis="active", router="gate_mass")
    conv = convert(adapter, prof, params)
    assert all(e.router == "gate_mass" and not e.router_weights for e in conv.experts)
    uni = uniform_params(params, [r.alpha for r in conv.plan])
    assert uni.alpha_min == uni.alpha_max
    uconv = convert(adapter, prof, uni)
    assert sum(r.d_shared for r in uconv.plan) == pytest.approx(sum(r.d_shared for r in conv.plan), abs=8 * 12)


def test_profile_of_another_model_is_refused(setup, tiny_model, data_dir):
    _, prof = setup
    other = load_model(str(tiny_model("phi3")), data_dir=data_dir)
    other.layers.pop()  # a model with a different depth than the profile's
    with pytest.raises(ConversionError, match="profile this model first"):
        convert(other, prof, ExpertWeaverParams())


def test_evaluation_dense_vs_converted_in_one_run(setup, data_dir):
    adapter, prof = setup
    conv = convert(adapter, prof, CMoEParams(shared=2, active=2, n_experts=8))
    windows = heldout_windows(adapter.tokenizer, data_dir, seq_len=32, n_windows=4)
    assert windows.shape == (4, 32)
    res = evaluate_variants(adapter, {"dense": None, "converted": conv.modules, "abstopk": abstopk_modules(adapter, 0.5)}, windows)
    assert res["dense"]["perplexity_ratio"] == 1.0 and res["converted"]["perplexity"] > 0
    errs = res["converted"]["reconstruction_error"]
    assert len(errs) == 3 and all(0 < e < 10 for e in errs)
    # One shared dense pass scores every variant exactly as a pass of its own would.
    assert reconstruction_errors(adapter, {"alone": conv.modules}, windows)["alone"] == pytest.approx(errs, rel=1e-12)
    load = res["converted"]["routing"]["load"]
    for layer, counts in load.items():
        assert sum(counts) == 4 * 32 * 2  # every token picks `active` = 2 routed experts
        assert res["converted"]["routing"]["load_cv"][layer] == pytest.approx(load_cv(np.array(counts)))
    assert "routing" not in res["abstopk"]
    # perplexity is exp of the mean per-window NLL (every window has the same length), with intervals over windows
    for name, r in res.items():
        assert r["perplexity"] == pytest.approx(math.exp(np.mean(r["window_nll"])), rel=1e-12) and len(r["window_nll"]) == 4
        lo, hi = r["perplexity_ci"]
        assert lo <= r["perplexity"] <= hi
    lo, hi = res["converted"]["perplexity_ratio_ci"]
    assert lo <= res["converted"]["perplexity_ratio"] <= hi and "perplexity_ratio_ci" not in res["dense"]
    assert res["converted"]["perplexity_ratio_ci"] == bootstrap_ci(res["converted"]["window_nll"], res["dense"]["window_nll"])


def test_bootstrap_intervals_resample_windows_in_pairs():
    rng = np.random.default_rng(1)
    dense = rng.normal(3.0, 0.5, size=16)  # windows of very different difficulty
    # the same shift on every window: the paired ratio is exactly exp(0.1), however noisy the windows are
    assert bootstrap_ci(dense + 0.1, dense) == pytest.approx([math.exp(0.1)] * 2, rel=1e-12)
    lo, hi = bootstrap_ci(dense)
    assert lo < math.exp(dense.mean()) < hi and hi / lo > 1.3  # unpaired: the windows' spread shows
    noisy = dense + rng.normal(0.1, 0.2, size=16)
    a, b = bootstrap_ci(noisy, dense)
    assert a < math.exp(np.mean(noisy - dense)) < b and bootstrap_ci(noisy, dense) == [a, b]  # seeded: reproducible
    assert bootstrap_ci([2.0]) is None and bootstrap_ci([2.0, 2.1], [2.0]) is None


def test_load_cv_is_mi_eq_7():
    assert load_cv(np.array([5, 5, 5, 5])) == 0.0
    c = np.array([1.0, 3.0])
    assert load_cv(c) == pytest.approx(np.sqrt(((c - 2) ** 2).mean()) / 2)


def test_choice_loglikelihoods_match_unbatched_scoring(setup, tmp_path):
    """moelab's own scorer (the harness's check, ``choice_loglikelihoods``) batched and padded equals one choice at a
    time, on BIG-bench items (the fake install), and the BIG-bench lm-eval task reads the same items."""
    from tests.engine.test_calibration import make_bigbench_sdist
    from moelab.engine.data.builtin import install_bigbench
    from moelab.engine.evaluation.lm_tasks.moelab_tasks import bigbench_mc
    from moelab.engine.evaluation.metrics import bigbench_choice_items, choice_loglikelihoods

    data = tmp_path / "data"
    install_bigbench(data, sdist=make_bigbench_sdist(tmp_path / "bigbench-1.0.0.tar.gz"))
    items = bigbench_choice_items(data, per_task=4)
    assert {it.task for it in items} == {"goal_step_wikihow/goal_inference", "general_knowledge", "code_line_description"}
    adapter, _ = setup
    sums, counts = choice_loglikelihoods(adapter.model, adapter.tokenizer, items, batch_size=5)
    tok = adapter.tokenizer
    for i, it in enumerate(items):  # reference: one choice at a time, no padding
        prompt = tok(it.prompt, add_special_tokens=False)["input_ids"]
        for j, c in enumerate(it.choices):
            cont = tok(" " + c, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + cont])
            with torch.no_grad():
                lp = adapter.model(input_ids=ids).logits.log_softmax(-1)[0, :-1]
            want = lp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), torch.tensor(cont)].double().sum().item()
            assert sums[i, j] == pytest.approx(want, abs=1e-4) and counts[i, j] == len(cont)
    rows = bigbench_mc(data_dir=str(data))["test"]
    assert len(rows) == len(bigbench_choice_items(data, per_task=10**6))
    assert [r["task"] for r in rows.select(range(3))] == ["goal_step_wikihow/goal_inference", "general_knowledge",
                                                         "code_line_description"]  # interleaved: limit 3n reads n of each
    first = items[0]
    assert (rows[0]["prompt"], rows[0]["choices"], rows[0]["gold"]) == (first.prompt, first.choices, first.answer)


def test_the_next_token_nll_is_the_cross_entropy_within_float64_rounding():
    """metrics.next_token_nll (logsumexp − target logit) against float64 cross-entropy on vocabulary-wide
    random logits: closer than float32's own ``F.cross_entropy`` over a transposed view, and shaped per window."""
    import torch.nn.functional as F

    from moelab.engine.evaluation.metrics import next_token_nll

    g = torch.Generator().manual_seed(0)
    logits, ids = 4 * torch.randn(3, 65, 49152, generator=g), torch.randint(0, 49152, (3, 65), generator=g)
    exact = F.cross_entropy(logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none")
    got = next_token_nll(logits, ids)
    assert got.shape == (3, 64) and got.dtype == torch.float32
    assert (got.double() - exact).abs().max() < 1e-5
    assert torch.allclose(next_token_nll(logits.bfloat16(), ids).double(), F.cross_entropy(
        logits.bfloat16()[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none"), atol=1e-4)


def test_scoring_windows_records_no_autograd_graph():
    """window_nll scores under inference mode: a forward with gradients on would keep every layer's activations
    (an evaluation's memory) and cost a finetune's bounded micro-batches their bound."""
    from moelab.engine.evaluation.metrics import window_nll

    grad_on: list[bool] = []

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 50)

        def forward(self, input_ids, use_cache=False):
            grad_on.append(torch.is_grad_enabled())
            return SimpleNamespace(logits=self.emb(input_ids))

    nll, _ = window_nll(Logits(), torch.randint(0, 50, (3, 9)), batch_size=2)
    assert grad_on == [False, False] and nll.shape == (3,) and (nll > 0).all()
