"""Balanced assignment / balanced k-means / CM Eq. 17 representatives / ATopK features.

Exact references: ``scipy.optimize.linear_sum_assignment`` on the column-repeated ``n × n``
matrix (CM Eq. 9; fine for n ≤ 600 in tests only) and naive Python loops.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from moelab.engine.core.clustering import (
    atopk_features,
    balanced_assignment,
    balanced_kmeans,
    pairwise_distances,
    representative_neurons,
    solve_balanced_assignment,
)


def exact_optimum(cost: np.ndarray, cap: np.ndarray) -> float:
    ext = np.repeat(cost, cap, axis=1)  # CM Eq. 9: column j repeated cap_j times
    rows, cols = linear_sum_assignment(ext)
    return float(ext[rows, cols].sum())


def random_capacities(rng: np.random.Generator, n: int, k: int, equal: bool) -> np.ndarray:
    if equal:
        cap = np.full(k, n // k)
        cap[: n - cap.sum()] += 1
        return cap
    return rng.multinomial(n - k, rng.dirichlet(np.ones(k))) + 1


def random_cost(rng: np.random.Generator, kind: str, n: int, k: int) -> np.ndarray:
    if kind == "uniform":
        return rng.random((n, k)) * 10
    if kind == "integer":  # heavy ties
        return rng.integers(0, 6, (n, k)).astype(float)
    if kind == "sqdist":
        x, c = rng.standard_normal((n, 6)), rng.standard_normal((k, 6))
        return ((x[:, None] - c[None]) ** 2).sum(-1)
    if kind == "identical_rows":
        return np.tile(rng.random(k), (n, 1))
    if kind == "large_magnitude":
        return 1e9 + rng.random((n, k)) * 1e3
    if kind == "rank_one":
        return rng.random((n, 1)) * rng.random((1, k))
    if kind == "heavy_tailed":  # the spread R is set by a few outliers, the optimum is tiny
        return rng.exponential(1.0, (n, k)) ** 3
    raise AssertionError(kind)


KINDS = ["uniform", "integer", "sqdist", "identical_rows", "large_magnitude", "rank_one", "heavy_tailed"]


# --------------------------------------------------------------------------------------------
# balanced_assignment
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_assignment_matches_exact_solver(kind):
    """≥ 10 random instances per kind (n ≤ 400, k 2–8, equal and unequal capacities)."""
    rng = np.random.default_rng(100 + KINDS.index(kind))
    for t in range(10):
        n = int(rng.integers(2, 401))
        k = int(rng.integers(2, min(8, n) + 1))
        cap = random_capacities(rng, n, k, equal=t % 2 == 0)
        cost = random_cost(rng, kind, n, k)
        res = solve_balanced_assignment(cost, cap)
        opt = exact_optimum(cost, cap)
        np.testing.assert_array_equal(np.bincount(res.labels, minlength=k), cap)
        assert res.objective == pytest.approx(cost[np.arange(n), res.labels].sum(), rel=1e-12)
        scale = max(1.0, abs(opt))
        assert res.objective <= opt * 1.01 + 1e-9 * scale  # brief: within 1 % ...
        assert res.objective - opt <= n * res.eps + 1e-9 * scale  # ... and the n·ε guarantee
        assert res.lower_bound <= opt + 1e-9 * scale  # the dual bound is a valid bound
        assert res.objective <= opt + 1e-8 * scale  # and in practice the default ε is ~exact


def test_integer_costs_are_solved_exactly():
    rng = np.random.default_rng(7)
    for _ in range(10):
        n, k = int(rng.integers(20, 300)), int(rng.integers(2, 9))
        cap = random_capacities(rng, n, k, equal=False)
        cost = rng.integers(-50, 50, (n, k))
        labels, obj = balanced_assignment(cost, cap)
        assert obj == exact_optimum(cost.astype(float), cap)
        np.testing.assert_array_equal(np.bincount(labels, minlength=k), cap)


@pytest.mark.parametrize("n,k", [(12, 3), (224, 8), (600, 6), (1000, 40)])
def test_equal_capacity_gives_exact_sizes(n, k):
    rng = np.random.default_rng(n)
    for kind in KINDS:
        cost = random_cost(rng, kind, n, k)
        labels, obj = balanced_assignment(cost, n // k)
        np.testing.assert_array_equal(np.bincount(labels, minlength=k), np.full(k, n // k))
        assert labels.dtype == np.int64 and labels.shape == (n,)
        assert obj == pytest.approx(cost[np.arange(n), labels].sum())


def test_capacity_one_is_a_plain_assignment():
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 60, 250):
        cost = rng.random((n, n))
        labels, obj = balanced_assignment(cost, 1)
        rows, cols = linear_sum_assignment(cost)
        assert sorted(labels.tolist()) == list(range(n))
        assert obj == pytest.approx(cost[rows, cols].sum(), abs=1e-9)


def test_degenerate_inputs():
    rng = np.random.default_rng(2)
    # k = 1: everything in the single cluster
    labels, obj = balanced_assignment(rng.random((9, 1)), 9)
    assert labels.tolist() == [0] * 9
    # a constant matrix: any balanced split is optimal, returned in row order
    labels, obj = balanced_assignment(np.full((6, 3), 4.0), 2)
    assert labels.tolist() == [0, 0, 1, 1, 2, 2] and obj == 24.0
    # identical rows with distinct columns: still exactly balanced
    cost = np.tile([3.0, 1.0, 2.0, 0.5], (40, 1))
    labels, obj = balanced_assignment(cost, 10)
    np.testing.assert_array_equal(np.bincount(labels), [10] * 4)
    assert obj == pytest.approx(10 * cost[0].sum())
    # zero capacities are allowed; those clusters receive nothing
    cost = rng.random((30, 4))
    cap = np.array([10, 0, 20, 0])
    res = solve_balanced_assignment(cost, cap)
    np.testing.assert_array_equal(np.bincount(res.labels, minlength=4), cap)
    assert res.objective == pytest.approx(exact_optimum(cost, cap))
    assert np.isnan(res.prices[[1, 3]]).all()
    # only one cluster with room
    labels, _ = balanced_assignment(rng.random((5, 3)), [0, 5, 0])
    assert labels.tolist() == [1] * 5
    # empty input
    labels, obj = balanced_assignment(np.zeros((0, 3)), 0)
    assert labels.shape == (0,) and obj == 0.0


def test_large_magnitude_costs_scale_eps_to_the_spread():
    """A 1e12 offset (and a 1e6 column scale) must not make ε coarse or the result inexact."""
    rng = np.random.default_rng(3)
    n, k = 300, 5
    base = rng.random((n, k))
    cap = random_capacities(rng, n, k, equal=False)
    for offset, scale in [(1e12, 1.0), (0.0, 1e6), (-1e9, 1e-6)]:
        cost = offset + scale * base  # at 1e12 float64 keeps only ~1e-4 of `base`: compare on `cost`
        res = solve_balanced_assignment(cost, cap)
        assert res.eps <= 1e-6 * scale  # relative to the spread, not the magnitude
        shifted = (cost - offset) / scale  # exact shift of what the solver saw, back to O(1) values
        obj = shifted[np.arange(n), res.labels].sum()
        assert obj <= exact_optimum(shifted, cap) + 1e-9


def test_user_eps_and_certificate():
    rng = np.random.default_rng(4)
    n, k = 400, 8
    cost = random_cost(rng, "sqdist", n, k)
    opt = exact_optimum(cost, np.full(k, n // k))
    for eps in (1e-1, 1e-3, 1e-8):
        res = solve_balanced_assignment(cost, n // k, eps=eps)
        assert res.eps == eps
        assert res.lower_bound <= opt + 1e-9 <= res.objective + 2e-9
        assert res.objective - res.lower_bound <= n * eps + 1e-7
        # prices certify ε-optimality row by row: c_i,label + p_label ≤ min_j (c_ij + p_j) + ε
        reduced = cost + res.prices
        assert np.all(reduced[np.arange(n), res.labels] <= reduced.min(axis=1) + eps + 1e-9)


def test_warm_start_prices():
    """A previous solve's prices restart a perturbed problem; any prices still give the optimum."""
    rng = np.random.default_rng(8)
    n, k = 400, 8
    cap = random_capacities(rng, n, k, equal=False)
    cost = random_cost(rng, "sqdist", n, k)
    first = solve_balanced_assignment(cost, cap)
    moved = cost + 0.05 * rng.standard_normal(cost.shape)
    opt = exact_optimum(moved, cap)
    for warm in (first.prices, np.zeros(k), 50 * rng.standard_normal(k)):
        res = solve_balanced_assignment(moved, cap, warm_start=warm)
        np.testing.assert_array_equal(np.bincount(res.labels, minlength=k), cap)
        assert res.objective == pytest.approx(opt, rel=1e-12)
    with pytest.raises(ValueError, match=r"warm_start must be \[8\] cluster prices"):
        solve_balanced_assignment(moved, cap, warm_start=np.zeros(3))


def test_deterministic():
    rng = np.random.default_rng(5)
    cost = random_cost(rng, "integer", 500, 5)
    a = balanced_assignment(cost, 100)
    b = balanced_assignment(cost.copy(), 100)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]


def test_no_n_by_n_memory():
    """n = 6000: an n × n float64 matrix would be 288 MB; the solver stays within a few n·k arrays."""
    rng = np.random.default_rng(6)
    n, k = 6000, 20
    cost = random_cost(rng, "sqdist", n, k)
    tracemalloc.start()
    labels, _ = balanced_assignment(cost, n // k)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12 * n * k * 8, f"peak {peak / 2**20:.1f} MiB"  # ≈ 11 MiB ≪ 288 MB
    np.testing.assert_array_equal(np.bincount(labels), np.full(k, n // k))


@pytest.mark.parametrize(
    "cost,capacity,match",
    [
        (np.zeros((10, 3)), 3, r"capacity 3 × 3 clusters = 9 slots, but there are 10 rows"),
        (np.zeros((10, 3)), [3, 3, 3], r"capacities sum to 9 .* must sum to n = 10"),
        (np.zeros((10, 3)), [5, 5], r"array of 3 per-cluster capacities"),
        (np.zeros((10, 3)), [11, -1, 0], r"non-negative"),
        (np.zeros((10, 3)), 2.5, r"non-negative integer"),
        (np.zeros((10, 3)), [3.5, 3.5, 3], r"integers"),
        (np.zeros(10), 3, r"2-D"),
        (np.zeros((10, 0)), 3, r"at least one cluster"),
        (np.array([[0.0, np.nan], [1.0, 2.0]]), 1, r"NaN or inf"),
    ],
)
def test_assignment_bad_inputs(cost, capacity, match):
    with pytest.raises(ValueError, match=match):
        balanced_assignment(cost, capacity)


def test_assignment_bad_eps():
    with pytest.raises(ValueError, match="eps must be a positive"):
        balanced_assignment(np.zeros((4, 2)), 2, eps=0.0)


# --------------------------------------------------------------------------------------------
# balanced_kmeans
# --------------------------------------------------------------------------------------------


def planted(rng: np.random.Generator, k: int, m: int, q: int, spread: float, noise: float):
    centers = rng.standard_normal((k, q)) * spread
    truth = rng.permutation(np.repeat(np.arange(k), m))
    return centers[truth] + rng.standard_normal((k * m, q)) * noise, truth


def same_partition(clusters: np.ndarray, truth: np.ndarray) -> bool:
    return all(len(set(truth[c].tolist())) == 1 for c in clusters) and len({truth[c[0]] for c in clusters}) == len(clusters)


def test_kmeans_recovers_planted_clusters():
    rng = np.random.default_rng(10)
    x, truth = planted(rng, k=8, m=30, q=12, spread=3.0, noise=1.0)
    res = balanced_kmeans(x, 8, seed=0)
    assert res.converged
    assert same_partition(res.clusters, truth)
    # from deliberately bad starting centroids (all drawn from 2 of the 8 groups) it still gets there
    bad = x[np.flatnonzero(truth < 2)[:8]]
    res = balanced_kmeans(x, 8, init=bad)
    assert res.converged and res.n_iter > 1
    assert same_partition(res.clusters, truth)


def test_kmeans_objective_monotone_and_consistent():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((480, 10)).astype(np.float32)  # unstructured: many iterations
    res = balanced_kmeans(x, 12, seed=3, max_iter=50)
    hist = np.array(res.objective_history)
    assert len(hist) == res.n_iter >= 3
    assert np.all(np.diff(hist) <= 1e-9 * hist[0]), hist
    # result invariants
    k, m = 12, 40
    assert res.clusters.shape == (k, m) and res.labels.shape == (480,)
    assert np.all(np.diff(res.clusters, axis=1) > 0)  # ascending within clusters
    assert np.all(np.diff(res.clusters[:, 0]) > 0)  # clusters ordered by smallest member
    np.testing.assert_array_equal(np.sort(res.clusters.ravel()), np.arange(480))
    for j, members in enumerate(res.clusters):
        assert np.all(res.labels[members] == j)
        np.testing.assert_allclose(res.centroids[j], x[members].astype(np.float64).mean(0), atol=1e-12)
    naive = sum(float(((x[i].astype(np.float64) - res.centroids[res.labels[i]]) ** 2).sum()) for i in range(480))
    assert res.objective == pytest.approx(naive, rel=1e-10)
    assert res.objective == hist[-1]
    # a converged result is a fixed point: one more assignment against its centroids changes nothing
    if res.converged:
        again = solve_balanced_assignment(pairwise_distances(x, res.centroids), m)
        assert again.objective >= res.objective * (1 - 1e-12)


def test_kmeans_deterministic_and_seeded():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((300, 8))
    a = balanced_kmeans(x, 10, seed=5)
    b = balanced_kmeans(x.copy(), 10, seed=5)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert a.objective_history == b.objective_history
    c = balanced_kmeans(x, 10, seed=6)
    assert c.seed == 6 and c.clusters.shape == (10, 30)


def test_kmeans_max_iter_and_metrics():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((200, 5))
    one = balanced_kmeans(x, 4, max_iter=1)
    assert one.n_iter == 1 and not one.converged and len(one.objective_history) == 1
    eu = balanced_kmeans(x, 4, metric="euclidean")
    d = np.sqrt(((x - eu.centroids[eu.labels]) ** 2).sum(1))
    assert eu.objective == pytest.approx(d.sum(), rel=1e-9)
    np.testing.assert_array_equal(np.bincount(eu.labels), [50] * 4)


def test_kmeans_binary_features_with_duplicates():
    """ATopK-style 0/1 features: many identical rows (e.g. never-activated neurons) and ties."""
    rng = np.random.default_rng(14)
    x = (rng.random((256, 40)) < 0.08)
    x[:60] = False  # 60 identical all-zero rows
    res = balanced_kmeans(x, 16, seed=0)
    np.testing.assert_array_equal(np.bincount(res.labels), [16] * 16)
    assert np.all(np.diff(res.objective_history) <= 1e-9)


def test_kmeans_explicit_init_cmoe_style():
    """CMoE: centroids = features of the top-activation-rate neurons."""
    rng = np.random.default_rng(15)
    idx = rng.integers(0, 64, (500, 6))
    feats = atopk_features(idx, 64)
    rates = feats.mean(1)
    init = feats[np.argsort(-rates, kind="stable")[:8]]
    res = balanced_kmeans(feats, 8, init=init, metric="euclidean")
    np.testing.assert_array_equal(np.bincount(res.labels), [8] * 8)


@pytest.mark.parametrize(
    "n,k,kwargs,match",
    [
        (10, 3, {}, r"n divisible by n_clusters: n=10 .* 3 equal clusters .* pass 9 or 12 neurons"),
        (10, 11, {}, r"exceeds the number of neurons"),
        (10, 0, {}, r"positive integer"),
        (10, 2, {"metric": "cosine"}, r"metric must be"),
        (10, 2, {"init": np.zeros((3, 4))}, r"init must be \[n_clusters, n_features\] = \[2, 4\]"),
        (10, 2, {"max_iter": 0}, r"max_iter"),
    ],
)
def test_kmeans_bad_inputs(n, k, kwargs, match):
    with pytest.raises(ValueError, match=match):
        balanced_kmeans(np.zeros((n, 4)), k, **kwargs)


def test_kmeans_rejects_non_finite_features():
    x = np.zeros((8, 3))
    x[5, 1] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        balanced_kmeans(x, 2)


# --------------------------------------------------------------------------------------------
# representative_neurons (CM Eq. 17) and atopk_features (CM Eq. 4)
# --------------------------------------------------------------------------------------------


def test_representative_neurons_matches_naive_loop():
    rng = np.random.default_rng(20)
    x = rng.standard_normal((240, 7)).astype(np.float32)
    res = balanced_kmeans(x, 6, seed=1)
    reps = representative_neurons(x, res.clusters, res.centroids)
    for j, members in enumerate(res.clusters):
        best, best_d = None, np.inf
        for i in members:
            d = np.sqrt(((x[i].astype(np.float64) - res.centroids[j]) ** 2).sum())
            if d < best_d:
                best, best_d = i, d
        assert reps[j] == best
    assert reps.dtype == np.int64 and reps.shape == (6,)


def test_representative_neurons_ragged_clusters_and_ties():
    x = np.array([[0.0], [2.0], [1.0], [5.0], [3.0], [4.0]])
    clusters = [[1, 0], [3, 5, 4]]  # unequal sizes, unsorted members
    centroids = np.array([[1.0], [4.0]])  # cluster 0: members 1 and 0 tie at distance 1
    np.testing.assert_array_equal(representative_neurons(x, clusters, centroids), [1, 5])
    with pytest.raises(ValueError, match="centroids must be"):
        representative_neurons(x, clusters, np.zeros((3, 1)))
    with pytest.raises(ValueError, match="outside"):
        representative_neurons(x, [[0, 9]], np.zeros((1, 1)))


def test_atopk_features_matches_naive_loop():
    rng = np.random.default_rng(21)
    n_neurons, t, kk = 50, 300, 5
    idx = np.stack([rng.choice(n_neurons, kk, replace=False) for _ in range(t)])
    feats = atopk_features(idx, n_neurons)
    naive = np.zeros((n_neurons, t), dtype=np.float32)
    for tok in range(t):
        for neuron in idx[tok]:
            naive[neuron, tok] = 1.0
    assert feats.dtype == np.float32 and feats.shape == (n_neurons, t)
    np.testing.assert_array_equal(feats, naive)
    np.testing.assert_array_equal(feats.sum(0), np.full(t, kk))  # K markers per token
    # narrow int dtypes as stored by profiling, and repeated indices
    np.testing.assert_array_equal(atopk_features(idx.astype(np.int16), n_neurons), naive)
    dup = atopk_features(np.array([[1, 1], [0, 2]]), 3)
    np.testing.assert_array_equal(dup, [[0, 1], [1, 0], [0, 1]])
    assert atopk_features(np.zeros((0, 4), dtype=np.int64), 7).shape == (7, 0)


@pytest.mark.parametrize(
    "idx,n,match",
    [
        (np.array([[0, 5]]), 5, r"\[0, 5\)"),
        (np.array([[-1, 2]]), 5, r"\[0, 5\)"),
        (np.array([0, 1]), 5, r"2-D"),
        (np.array([[0.5, 1.0]]), 5, r"integers"),
        (np.array([[0, 1]]), 0, r"positive integer"),
    ],
)
def test_atopk_features_bad_inputs(idx, n, match):
    with pytest.raises(ValueError, match=match):
        atopk_features(idx, n)
