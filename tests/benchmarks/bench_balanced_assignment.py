"""Balanced assignment and balanced k-means at Llama-3-8B scale (one FFN layer's routed pool).

    python tests/benchmarks/bench_balanced_assignment.py [--repeats 3] [--verify-highs]

Data (seed 0): ``X = default_rng(0).standard_normal((14336, 240))``; centroids = 64 distinct
rows of X drawn with the same generator; cost = squared L2 distances (float64 expansion),
capacity 14336 / 64 = 224 per cluster (CM Eq. 7).

* assignment: :func:`solve_balanced_assignment` timed ``--repeats`` times (median + min),
  with its certified gap ``objective − lower_bound`` (the LP dual bound of the solver's final
  cluster prices: the optimum lies in between) and the gap to the cheap unconstrained bound
  ``Σ_i min_j cost_ij`` (every neuron at its nearest centroid, capacities ignored);
* ``--verify-highs`` additionally solves the transportation LP exactly with scipy's HiGHS
  (n·k = 917,504 variables; ~2 minutes here) and reports the auction's gap to it;
* k-means: one full :func:`balanced_kmeans` run on X (64 clusters, seed 0, k-means++ init,
  max_iter 50): seconds, iterations, convergence, objective.

Writes ``tests/benchmarks/results/bench_balanced_assignment.json`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.core.clustering import balanced_kmeans, pairwise_distances, solve_balanced_assignment  # noqa: E402

N, K, Q = 14336, 64, 240


def highs_optimum(cost: np.ndarray, cap: int) -> tuple[float, float]:
    import scipy.sparse as sp
    from scipy.optimize import linprog

    n, k = cost.shape
    a_eq = sp.vstack([sp.kron(sp.eye(n), np.ones((1, k))), sp.kron(np.ones((1, n)), sp.eye(k))]).tocsr()
    b_eq = np.concatenate([np.ones(n), np.full(k, cap)])
    t0 = time.perf_counter()
    res = linprog(cost.ravel(), A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"HiGHS failed: {res.message}")
    return float(res.fun), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verify-highs", action="store_true")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "tests" / "benchmarks" / "results" / "bench_balanced_assignment.json")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, Q))
    centroids = x[rng.choice(N, K, replace=False)]
    t0 = time.perf_counter()
    cost = pairwise_distances(x, centroids)
    dist_s = time.perf_counter() - t0
    cap = N // K

    times, res = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        res = solve_balanced_assignment(cost, cap)
        times.append(time.perf_counter() - t0)
    assert res is not None
    sizes_ok = bool(np.all(np.bincount(res.labels, minlength=K) == cap))
    unconstrained = float(cost.min(axis=1).sum())
    record: dict = {
        "n": N, "k": K, "q": Q, "capacity": cap,
        "threads": torch.get_num_threads(),
        "distance_matrix_s": dist_s,
        "assignment": {
            "seconds": times,
            "median_s": statistics.median(times),
            "min_s": min(times),
            "objective": res.objective,
            "dual_lower_bound": res.lower_bound,
            "certified_gap": res.objective - res.lower_bound,
            "certified_rel_gap": (res.objective - res.lower_bound) / res.objective,
            "guarantee_n_eps": N * res.eps,
            "eps": res.eps,
            "auction_rounds": res.n_rounds,
            "shortest_path_searches": res.n_searches,
            "exact_sizes": sizes_ok,
            "unconstrained_lower_bound": unconstrained,
            "rel_gap_vs_unconstrained": (res.objective - unconstrained) / unconstrained,
        },
    }
    if args.verify_highs:
        opt, highs_s = highs_optimum(cost, cap)
        record["assignment"].update(highs_optimum=opt, highs_s=highs_s,
                                    rel_gap_vs_highs=(res.objective - opt) / opt)

    t0 = time.perf_counter()
    km = balanced_kmeans(x, K, seed=0, max_iter=50)
    km_s = time.perf_counter() - t0
    hist = km.objective_history
    record["kmeans"] = {
        "seconds": km_s,
        "n_iter": km.n_iter,
        "converged": km.converged,
        "objective": km.objective,
        "objective_first_iter": hist[0],
        "monotone": bool(all(b <= a for a, b in zip(hist, hist[1:]))),
        "seconds_per_iter": km_s / km.n_iter,
        "exact_sizes": bool(np.all(np.bincount(km.labels, minlength=K) == cap)),
    }
    record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")

    a = record["assignment"]
    highs = f", vs HiGHS exact {a['rel_gap_vs_highs']:+.1e}" if args.verify_highs else ""
    print(
        f"bench_balanced_assignment: {N}x{K} cap {cap}: assignment {a['median_s']:.2f}s median "
        f"(min {a['min_s']:.2f}s; {a['auction_rounds']} auction rounds + {a['shortest_path_searches']} "
        f"shortest-path searches), certified gap vs dual bound "
        f"{a['certified_gap']:.1e} ({a['certified_rel_gap']:.1e} rel), "
        f"+{a['rel_gap_vs_unconstrained']:.2%} over unconstrained bound{highs}; "
        f"k-means {km_s:.1f}s, {km.n_iter} iters ({'converged' if km.converged else 'max_iter'}), "
        f"objective {km.objective:.6g}"
    )


if __name__ == "__main__":
    main()
