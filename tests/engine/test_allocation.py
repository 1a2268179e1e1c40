import numpy as np
import pytest

from moelab.engine.core.allocation import specialisation_ratio, summarize
from moelab.engine.core.params import ConversionError
from moelab.engine.methods import cmoe, get_method
from moelab.engine.methods.cmoe import CMoEParams
from moelab.engine.methods.expertweaver import ExpertWeaverParams as AllocationParams
from moelab.engine.methods.expertweaver import plan, preview


def cvs(L=6, d=1536, seed=0):
    rng = np.random.default_rng(seed)
    return [np.abs(rng.normal(0.2 + 0.15 * i, 0.4, size=d)) for i in range(L)]


def test_expertweaver_equations_4_to_6():
    cv = cvs()
    p = AllocationParams(alpha_min=0.2, alpha_max=0.7, tau=0.6, n_experts=64, sparsity=0.25)
    rows = plan(cv, p)
    for row, c in zip(rows, cv):
        r = np.mean(c > 0.6)  # Eq. 4
        alpha = 0.7 - 0.5 * r  # Eq. 5
        n_se = round(round(alpha * 1536) / 24)  # Eq. 6
        k = round(0.75 * 64)
        assert row.r == pytest.approx(r)
        assert row.n_shared == min(n_se, k) and row.n_routed == 64 - row.n_shared
        assert row.top_k == k - row.n_shared and row.d_expert == 24
        assert row.active_neurons == 0.75 * 1536 and not row.clamped
    # More specialised layers get a smaller shared part.
    assert rows[0].n_shared >= rows[-1].n_shared
    np.testing.assert_allclose(specialisation_ratio(cv, 0.6), [row.r for row in rows])


def test_clamps_and_says_so_when_shared_exceeds_active_budget():
    cv = [np.zeros(1536), np.full(1536, 5.0)]  # r = 0 -> alpha = alpha_max; r = 1 -> alpha_min
    rows = plan(cv, AllocationParams(alpha_min=0.2, alpha_max=0.7, sparsity=0.5))
    assert rows[0].clamped and rows[0].static and rows[0].top_k == 0 and rows[0].n_shared == 32
    assert "static prune" in rows[0].note and "alpha_basis='active'" in rows[0].note
    assert not rows[1].clamped and rows[1].top_k > 0
    assert summarize(rows)["clamped_layers"] == [0]
    # The alternative reading: alpha is a share of the active budget, so routing always survives.
    active = plan(cv, AllocationParams(alpha_min=0.2, alpha_max=0.7, sparsity=0.5, alpha_basis="active"))
    assert not any(r.clamped or r.static for r in active)
    assert active[0].d_shared == round(0.7 * 0.5 * 1536 / 24) * 24


def test_indivisible_width_keeps_every_neuron_in_the_shared_part():
    rows = plan([np.zeros(1000)], AllocationParams(n_experts=64, sparsity=0.25, alpha_min=0.1, alpha_max=0.1))
    row = rows[0]
    assert row.d_expert == 15 and 1000 - 64 * 15 == 40
    assert row.d_shared + row.n_routed * row.d_expert == 1000
    assert row.d_shared == row.n_shared * 15 + 40


def test_cmoe_sae_plan():
    rows = cmoe.plan([len(c) for c in cvs(3)], CMoEParams(shared=3, active=3, n_experts=8))
    assert all((r.n_shared, r.top_k, r.n_routed, r.d_expert) == (3, 3, 5, 192) for r in rows)
    assert summarize(rows)["active_fraction"] == pytest.approx(6 / 8)


@pytest.mark.parametrize(
    "params, message",
    [
        (AllocationParams(alpha_min=0.8, alpha_max=0.7), "alpha_min"),
        (AllocationParams(tau=0.0), "tau"),
        (AllocationParams(sparsity=1.0), "sparsity"),
        (AllocationParams(sparsity=0.0), "sparsity"),
        (AllocationParams(n_experts=4096), "do not fit"),
        (AllocationParams(alpha_max=1.5), "alpha_max=1.5: must be ≤ 1"),
        (CMoEParams(shared=5, active=4, n_experts=8), "exceeds"),
        (CMoEParams(shared=8, active=0, n_experts=8), None),
    ],
)
def test_invalid_parameters_are_explained(params, message):
    make = plan if params.method == "expertweaver" else lambda cv, p: cmoe.plan([len(c) for c in cv], p)
    if message is None:  # S = E with A = 0 is a legal (if static) plan
        make([np.zeros(64)], params)
        return
    with pytest.raises(ConversionError, match=message):
        make([np.zeros(1536)], params)


def test_unknown_method_is_explained():
    with pytest.raises(ConversionError, match="unknown conversion method 'moefication'"):
        get_method("moefication")


def test_preview_returns_the_whole_plan():
    class FakeProfile:  # the preview only needs per-layer CVs
        def cv_by_layer(self):
            return cvs(L=4)

    out = preview(FakeProfile(), AllocationParams(alpha_max=0.6, tau=0.5))
    assert len(out["layers"]) == 4 and out["params"]["tau"] == 0.5
    assert set(out["summary"]) >= {"active_fraction", "static_layers", "clamped_layers"}
