"""Balanced clustering of FFN neurons into equal-size experts.

Both ExpertWeaver (EW §3.3, App. G, Eqs. 13–14) and CMoE (CM §3.1, Eqs. 6–10, 17) split the
routed-neuron pool of a layer into ``k`` experts of exactly ``m = n / k`` neurons with
*balanced k-means*: alternate

* **assign** — with the centroids fixed, solve the capacitated assignment / transportation
  problem ``min Σ_i D[i, label_i]`` s.t. every cluster receives exactly its capacity (CM Eq. 7), and
* **update** — move every centroid to the mean of its members (EW Eq. 14, CM Eq. 8).

CMoE's reference code solves the assignment step by repeating every column of the ``n × k``
distance matrix ``m`` times (CM Eq. 9) and running a dense ``n × n`` Hungarian solver: hundreds of
MB and minutes per layer. EW App. G falls back to a greedy approximation. Here the assignment
step is solved exactly, directly on the ``n × k`` matrix, as a transportation / min-cost-flow
problem: an ε-scaled auction (clusters bidding in bulk, vectorised) finds near-equilibrium
cluster prices, then successive shortest augmenting paths on the ``k``-node cluster graph make
the solution optimal. See :func:`solve_balanced_assignment` for the algorithm and its ``n·ε``
guarantee (ε = 1e-12 of the cost spread by default: optimal up to float rounding).

Public API
----------
* :func:`balanced_assignment` / :func:`solve_balanced_assignment` — the assignment step;
* :func:`balanced_kmeans` → :class:`BalancedKMeansResult` — the whole clustering
  (:func:`pairwise_distances` is its float64 distance kernel);
* :func:`representative_neurons` — CM Eq. 17, the member closest to each centroid;
* :func:`atopk_features` — CM Eq. 4 ATopK marker rows → dense binary neuron×token features.

Errors on bad inputs are :class:`ValueError` with a message saying what to change.
Imports numpy and torch (``torch.topk`` for the auction's per-round top-s selection) only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch

Metric = Literal["sqeuclidean", "euclidean"]

__all__ = [
    "AssignmentResult",
    "BalancedKMeansResult",
    "atopk_features",
    "balanced_assignment",
    "balanced_kmeans",
    "pairwise_distances",
    "representative_neurons",
    "solve_balanced_assignment",
]

# Balanced assignment: auction warm start (ε from R/16, ÷10 per phase, stop once ε ≤ 1e-2·R or after
# a round budget), then exact successive shortest paths with tie tolerance DEFAULT_REL_TOL·R.
_AUCTION_EPS_START = 1 / 16
_AUCTION_EPS_STOP = 1e-2
_EPS_SCALING_FACTOR = 10.0
_AUCTION_MAX_ROUNDS = 3000  # only a warm start: when exhausted, the exact phase takes over
_ARGMAX_TOPK = 2  # rounds where every bidding cluster misses < this many rows use argmax, else torch.topk
_WARM_MIN_SEARCHES = 200  # a warm start may use max(200, n/20) searches before falling back
DEFAULT_REL_TOL = 1e-12  # default tie tolerance, relative to the largest per-row cost spread R


# --------------------------------------------------------------------------------------------
# Balanced assignment (transportation problem): auction warm start + successive shortest paths
# --------------------------------------------------------------------------------------------


@dataclass
class AssignmentResult:
    """Outcome of :func:`solve_balanced_assignment`.

    ``lower_bound`` is the dual value of the final prices, a certificate:
    ``lower_bound ≤ optimum ≤ objective ≤ lower_bound + n·eps`` (up to float rounding), so
    ``objective − lower_bound`` is a proven bound on the distance to the optimum.
    """

    labels: np.ndarray  # [n] int64, cluster of every row
    objective: float  # Σ_i cost[i, labels[i]]
    lower_bound: float  # dual bound Σ_i min_j (cost_ij + p_j) − Σ_j cap_j p_j
    prices: np.ndarray  # [k] cluster prices p_j: every row is in an ε-cheapest cluster of cost_ij + p_j
    # (NaN for zero-capacity clusters; defined up to a common constant; a warm start for a similar cost)
    eps: float  # tie tolerance ε (cost units): n·eps bounds objective − optimum
    n_rounds: int  # bidding rounds of the auction warm start
    n_searches: int  # shortest-path (Dijkstra) searches of the exact phase


def _check_capacity(capacity: int | np.ndarray | Sequence[int], n: int, k: int) -> np.ndarray:
    if np.ndim(capacity) == 0:
        try:
            cap_val = int(capacity)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"capacity must be an integer or a sequence of integers, got {capacity!r}") from None
        if cap_val != capacity or cap_val < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {capacity!r}")
        if cap_val * k != n:
            raise ValueError(
                f"capacity {cap_val} × {k} clusters = {cap_val * k} slots, but there are {n} rows; "
                f"equal capacities need n divisible by k (capacity = n / k = {n / k:g}), "
                f"or pass one capacity per cluster summing to {n}"
            )
        return np.full(k, cap_val, dtype=np.int64)
    cap = np.asarray(capacity)
    if cap.shape != (k,):
        raise ValueError(f"capacity must be an int or an array of {k} per-cluster capacities (one per cost column), "
                         f"got shape {cap.shape}")
    if not np.issubdtype(cap.dtype, np.integer):
        if not np.all(np.isfinite(cap)) or not np.all(cap == np.round(cap)):
            raise ValueError(f"capacities must be integers, got {cap!r}")
    cap = cap.astype(np.int64)
    if np.any(cap < 0):
        raise ValueError(f"capacities must be non-negative, got minimum {int(cap.min())}")
    if int(cap.sum()) != n:
        raise ValueError(
            f"capacities sum to {int(cap.sum())} but the cost matrix has {n} rows; "
            f"every row is assigned to exactly one cluster, so the capacities must sum to n = {n}"
        )
    return cap


def _auction(benefit: np.ndarray, cap: np.ndarray, eps_final: float, eps_start: float,
             theta: float, max_rounds: int) -> tuple[np.ndarray, int, int]:
    """Approximately maximise Σ benefit[i, label_i] s.t. |{i: label_i = j}| = cap[j]
    (all cap > 0, Σ cap = n, k ≥ 2) by a reverse (cluster-bidding) Jacobi auction with ε-scaling
    from ``eps_start`` down to ``eps_final`` — see solve_balanced_assignment. Stops early after
    ``max_rounds`` bidding rounds. Returns (cluster prices P_j = max_i (benefit_ij − π_i),
    n_phases, n_rounds); with them every row held by j is within ε of its best cluster.
    """
    n, k = benefit.shape
    bT = np.ascontiguousarray(benefit.T)  # [k, n]: row j = every item's benefit for cluster j
    pi = np.zeros(n)  # item prices π_i; they only rise
    owner = np.full(n, -1, dtype=np.int64)
    row_of = np.full(k + 1, -1, dtype=np.int64)  # cluster -> row among this round's bidders; [-1] for owner -1
    eps = max(eps_start, eps_final)
    n_phases = n_rounds = 0
    while True:
        n_phases += 1
        if n_phases > 1:
            _restore_eps_cs(bT, pi, owner, eps)
        count = np.bincount(owner[owner >= 0], minlength=k)
        while True:
            short = np.flatnonzero(count < cap)
            if short.size == 0:
                break
            if n_rounds >= max_rounds:
                break
            n_rounds += 1
            _bidding_round(bT, pi, owner, count, cap, short, row_of, eps)
        if eps <= eps_final or n_rounds >= max_rounds:
            break
        eps = max(eps / theta, eps_final)
    return (bT - pi).max(axis=1), n_phases, n_rounds


def _restore_eps_cs(bT: np.ndarray, pi: np.ndarray, owner: np.ndarray, eps: float) -> None:
    """The auction's warm start for a smaller ε (updates the item prices ``pi`` and the owners in place).

    Keep the prices and the assignment, except that (a) every cluster re-bids its held rows down to
    the value of its best non-held row B_j (a price rise, as a bid would do), and (b) rows now worth
    < B_j − ε are released. Then every held row is worth within ε of max_l value(l, j): ε-CS holds again.
    """
    k = bT.shape[0]
    held = np.flatnonzero(owner >= 0)
    j_held = owner[held]
    values = bT - pi
    held_val = values[j_held, held]
    values[j_held, held] = -np.inf
    best_free = values.max(axis=1)[j_held]
    over = held_val > best_free
    pi[held[over]] = bT[j_held[over], held[over]] - best_free[over]
    keep = held_val >= best_free - eps
    owner[held[~keep]] = -1
    # (c) Released rows were released for being expensive; left at that price, nobody
    # wants them until every other price has been bid past theirs — a hole wandering
    # for thousands of rounds, one ε-raise each (ties make it worse). Outside a phase
    # prices may drop as long as ε-CS survives: lower every free row to the least price
    # at which it is worth ≤ L_j + ε to every cluster j (L_j = j's lowest held value).
    free = np.flatnonzero(owner < 0)
    if free.size and keep.any():
        low = np.full(k, np.inf)
        np.minimum.at(low, j_held[keep], np.minimum(held_val, best_free)[keep])
        pi[free] = np.minimum(pi[free], (bT[:, free] - low[:, None]).max(axis=0) - eps)


def _top_candidates(values: np.ndarray, smax: int) -> tuple[np.ndarray, np.ndarray]:
    """``(items, values)`` ``[S, smax + 1]``: the ``smax + 1`` best items of every row of ``values``,
    best first (``values`` is overwritten)."""
    n_short = values.shape[0]
    rows = np.arange(n_short)
    if smax < _ARGMAX_TOPK:  # one missing row (the usual tail): two argmax passes
        cand = np.empty((n_short, smax + 1), dtype=np.int64)
        cand_val = np.empty((n_short, smax + 1))
        for r in range(smax + 1):
            top = values.argmax(axis=1)
            cand[:, r] = top
            cand_val[:, r] = values[rows, top]
            values[rows, top] = -np.inf
        return cand, cand_val
    # torch.topk is 3-20× faster than np.argpartition + sort here
    top_val, top_idx = torch.topk(torch.from_numpy(values), smax + 1, dim=1, sorted=True)
    return top_idx.numpy(), top_val.numpy()


def _bidding_round(bT: np.ndarray, pi: np.ndarray, owner: np.ndarray, count: np.ndarray, cap: np.ndarray,
                   short: np.ndarray, row_of: np.ndarray, eps: float) -> None:
    """One Jacobi round of the auction: every cluster in ``short`` (short of rows) bids at once.
    Updates ``pi``, ``owner`` and ``count`` in place (``row_of``: scratch, all −1 between rounds)."""
    k = bT.shape[0]
    need = cap[short] - count[short]  # s_j ≥ 1
    n_short = short.size
    row_of[short] = np.arange(n_short)
    values = bT[short] - pi  # [S, n]
    held = np.flatnonzero(row_of[owner] >= 0)  # items held by a bidding cluster
    held_row = row_of[owner[held]]
    values[held_row, held] = -np.inf  # a cluster bids on its top-s *non-held* items
    rows = np.arange(n_short)
    # The s_j + 1 best non-held rows of every bidding cluster, best first.
    cand, cand_val = _top_candidates(values, int(need.max()))
    threshold = cand_val[rows, need]  # (s_j + 1)-th best non-held value t_j
    bid_row = np.repeat(rows, need)
    bid_item = cand[bid_row, np.arange(bid_row.size) - np.repeat(np.cumsum(need) - need, need)]
    bid_cluster = short[bid_row]
    # Bid for each wanted row the price that leaves it worth t_j − ε to j (≥ π_i + ε).
    bid = bT[bid_cluster, bid_item] - threshold[bid_row] + eps
    # Highest bid per row wins (ties: lowest cluster); the price becomes the winning bid.
    order = np.lexsort((bid_cluster, -bid, bid_item))
    item_sorted = bid_item[order]
    first = np.ones(order.size, dtype=bool)
    first[1:] = item_sorted[1:] != item_sorted[:-1]
    win = order[first]
    won_item = bid_item[win]
    lost_by = owner[won_item]
    owner[won_item] = bid_cluster[win]
    pi[won_item] = bid[win]
    count += np.bincount(bid_cluster[win], minlength=k)
    count -= np.bincount(lost_by[lost_by >= 0], minlength=k)
    # Every bidder also raises the prices of the rows it kept from before so that they,
    # like the rows it just won, are worth exactly t_j − ε to it: a unilateral raise, not a
    # competing bid (an incumbent defending its rows turns into an ε-per-round price war),
    # which moves the whole cluster's price level at once. All its rows are then worth
    # t_j − ε ≥ (everything it does not hold) − ε: ε-CS.
    kept = held[owner[held] == short[held_row]]
    kept_row = row_of[owner[kept]]
    pi[kept] = np.maximum(pi[kept], bT[short[kept_row], kept] - threshold[kept_row] + eps)
    row_of[short] = -1


def _shortest_paths(reduced: np.ndarray, cap: np.ndarray, price: np.ndarray, tol: float,
                    max_searches: int | None = None) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Exact capacitated assignment by successive shortest paths, warm-started from ``price``.

    Invariant: every assigned row i is in a cluster within ``tol`` of ``min_j (c_ij + p_j)``.
    Returns (labels, prices p, number of Dijkstra searches), or None once more than
    ``max_searches`` searches would be needed (the prices were a poor start).
    """
    k = reduced.shape[1]
    price = price.astype(np.float64, copy=True)
    owner, count, slot, pending = _greedy_start(reduced, cap, price)
    # delta[l, j] = min over rows i in cluster l of (c_ij − c_il): the cost of moving l's
    # cheapest-to-move row to j (price-independent); via[l, j] is that row.
    delta = np.full((k, k), np.inf)
    via = np.full((k, k), -1, dtype=np.int64)

    def recompute(l: int, cols: np.ndarray) -> None:
        members = slot[l, : count[l]]
        moves = reduced[np.ix_(members, cols)] - reduced[members, l][:, None]
        arg = moves.argmin(axis=0)
        delta[l, cols] = moves[arg, np.arange(cols.size)]
        via[l, cols] = members[arg]
        delta[l, l] = np.inf

    def admit(l: int, i: int) -> None:  # row i joined cluster l: it may be the new cheapest mover
        moves = reduced[i] - reduced[i, l]
        better = moves < delta[l]
        better[l] = False
        delta[l, better] = moves[better]
        via[l, better] = i

    all_cols = np.arange(k)
    for l in np.flatnonzero(count):
        recompute(int(l), all_cols)
    n_search = 0
    for s in pending:
        s = int(s)
        cost_s = reduced[s] + price
        lowest = cost_s.min()
        open_ = count < cap
        open_cost = np.where(open_, cost_s, np.inf)
        j = int(open_cost.argmin())
        if open_cost[j] <= lowest + tol:  # a cheapest cluster (up to tol) has room
            owner[s] = j
            slot[j, count[j]] = s
            count[j] += 1
            admit(j, s)
            continue
        # Dijkstra from row s over the k clusters: s -> j costs c_sj + p_j − lowest; l -> j costs
        # delta[l, j] + p_j − p_l (≥ −tol by the invariant; clipped at 0). Stop at the first
        # cluster with room.
        n_search += 1
        if max_searches is not None and n_search > max_searches:
            return None
        j, dist, pred = _nearest_open(cost_s - lowest, open_, delta, price)
        # New prices keep every row within tol of its cheapest cluster; the path becomes tight.
        price -= np.minimum(dist, dist[j])
        path = [j]
        while pred[path[-1]] >= 0:
            path.append(int(pred[path[-1]]))
        path.reverse()
        incoming = s
        for a, b in zip(path[:-1], path[1:]):  # a receives `incoming` and passes via[a, b] on to b
            out = int(via[a, b])
            where = int(np.flatnonzero(slot[a, : count[a]] == out)[0])
            slot[a, where] = incoming
            owner[incoming] = a
            stale = np.flatnonzero(via[a] == out)
            recompute(a, stale)
            admit(a, incoming)
            incoming = out
        owner[incoming] = j
        slot[j, count[j]] = incoming
        count[j] += 1
        admit(j, incoming)
    return owner, price, n_search


def _greedy_start(reduced: np.ndarray, cap: np.ndarray, price: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The shortest-path solver's start: each cluster keeps, among the rows for which it is cheapest
    (under ``price``), the ``cap_j`` rows with the largest regret. Every kept row sits at its exact
    argmin: a partial optimum. Returns ``(owner [n] (−1: pending), count [k], slot table [k, max cap],
    pending rows, largest regret first)``; the slot table holds every cluster's members (row l, first
    ``count[l]`` slots), so a move along a path swaps one slot in place."""
    n, k = reduced.shape
    rows = np.arange(n)
    shifted = reduced + price
    best = shifted.argmin(axis=1)
    lowest = shifted[rows, best]
    shifted[rows, best] = np.inf
    regret = shifted.min(axis=1) - lowest  # what a row loses if it cannot have its best cluster
    del shifted
    order = np.lexsort((-regret, best))
    best_sorted = best[order]
    rank = rows - np.searchsorted(best_sorted, np.arange(k))[best_sorted]
    fits = rank < cap[best_sorted]
    owner = np.full(n, -1, dtype=np.int64)
    owner[order[fits]] = best_sorted[fits]
    count = np.bincount(best_sorted[fits], minlength=k)
    pending = order[~fits]
    pending = pending[np.argsort(-regret[pending], kind="stable")]
    slot = np.full((k, int(cap.max())), -1, dtype=np.int64)
    slot[best_sorted[fits], rank[fits]] = order[fits]
    return owner, count, slot, pending


def _nearest_open(dist: np.ndarray, open_: np.ndarray, delta: np.ndarray, price: np.ndarray
                  ) -> tuple[int, np.ndarray, np.ndarray]:
    """Dijkstra over the ``k`` clusters from a row whose edge to cluster j costs ``dist[j]``
    (updated in place); ``l -> j`` costs ``delta[l, j] + p_j − p_l`` (≥ −tol by the invariant;
    clipped at 0). Stops at the first cluster with room; returns ``(that cluster, dist, pred)``."""
    key = dist.copy()
    pred = np.full(dist.size, -1, dtype=np.int64)
    while True:
        j = int(key.argmin())
        if open_[j]:
            return j, dist, pred
        key[j] = np.inf  # settled; its dist can no longer improve (steps are ≥ 0)
        step = delta[j] + price
        step -= price[j]
        np.maximum(step, 0.0, out=step)
        step += dist[j]
        upd = step < dist
        dist[upd] = step[upd]
        key[upd] = step[upd]
        pred[upd] = j


def solve_balanced_assignment(cost: np.ndarray, capacity: int | np.ndarray | Sequence[int], *,
                              eps: float | None = None,
                              warm_start: np.ndarray | None = None) -> AssignmentResult:
    r"""Capacitated assignment: ``min Σ_i cost[i, label_i]`` s.t. cluster ``j`` gets ``capacity[j]`` rows.

    This is the transportation problem of CM Eq. 7 (and EW Eq. 13's assignment step), solved on
    the ``n × k`` matrix itself — no ``n × n`` column-repeated matrix (CM Eq. 9) is ever built.
    Costs are first shifted per row (``c_ij − min_l c_il``; this changes every feasible objective
    by the same constant); ``R`` is the largest per-row spread of the shifted costs.

    **Algorithm.** The LP dual has one price ``p_j`` per cluster: a solution is optimal iff every
    row sits in a cheapest cluster of ``c_ij + p_j``. Two stages:

    1. *Prices (warm start)* — a reverse (cluster-bidding) Jacobi auction with ε-scaling
       (Bertsekas & Castañon 1989, "The auction algorithm for the transportation problem";
       Bertsekas, *Network Optimization*, 1998). Rows carry prices ``π_i``; cluster ``j`` values
       row ``i`` at ``b_ij − π_i`` (``b = −c``). Each round every cluster short of rows bids at
       once, in bulk: missing ``s_j`` rows, it bids for its ``s_j`` best rows it does not hold at
       the price that leaves each worth ``t_j − ε`` (``t_j``: its ``(s_j+1)``-th best value),
       each row goes to its highest bid, and every bidder raises its kept rows to the same level,
       so ε-complementary slackness holds throughout. ε goes ``R/16 → R/160`` (÷10 per phase,
       stopping once ε ≤ 10⁻²·R or after 3000 rounds); the result are cluster prices ``P_j`` at
       which the clusters are nearly balanced. Only the prices are kept. (Auctions alone are slow to
       finish here: with 224 identical slots per cluster and many tied rows — ATopK features have
       thousands of identical all-zero rows — the last few rows trigger long ε-sized price wars;
       the row-bidding textbook auction did not finish the 14,336 × 64 benchmark in 2·10⁶ rounds.)
       ``warm_start`` (e.g. the previous k-means iteration's ``prices``) replaces this stage; if
       those prices need more than ``max(200, n/20)`` searches in stage 2, the auction runs after all.
    2. *Exact: successive shortest paths* (min-cost flow; the Hungarian method for
       transportation problems). Every row goes to a cheapest cluster under ``p`` while there
       is room (rows with the largest regret first). Each remaining row ``s`` starts a Dijkstra
       search over the ``k`` clusters: ``s → j`` costs ``c_sj + p_j − min_l (c_sl + p_l)`` and
       ``l → j`` costs ``Δ_lj + p_j − p_l`` with ``Δ_lj = min_{i ∈ l} (c_ij − c_il)`` (moving
       ``l``'s cheapest-to-move row to ``j``; kept per cluster pair and refreshed only for the
       clusters a path touches). The nearest cluster with room ends the search; the rows along
       the path shift one cluster each and ``p_j −= min(d_j, d_target)``, which keeps every row
       in a cheapest cluster. ``O(k²)`` per search plus ``O(m·k)`` per touched cluster. On the
       14,336 × 64 benchmark: 33 auction rounds + 344 searches (~0.2–0.4 s on 2 cores); with a
       k-means warm start 10–150 searches (~0.1 s).

    **ε and guarantee.** ε is the tie tolerance of stage 2: a row may join a cluster with room
    whose ``c_ij + p_j`` is within ε of the cheapest, and edge costs ``≥ −ε`` are clipped to 0.
    Every row therefore ends within ε of its cheapest cluster under the final prices ``p``, and
    LP duality gives ``lower_bound = Σ_i min_j (c_ij + p_j) − Σ_j cap_j p_j ≤ optimum ≤
    objective ≤ lower_bound + n·ε``. ``eps`` sets ε (cost units); the default ``1e-12 · R`` is
    float64 noise, i.e. the result is optimal up to rounding (exact for integer costs while
    ``n·R < 10¹²``). The
    certificate is returned (``lower_bound``, ``prices``). Memory is ``O(n·k)``.

    Degenerate inputs: ``k = 1`` or a single cluster with positive capacity (all rows go
    there); capacity 1 (plain assignment, ``k = n``); identical rows or an all-constant matrix
    (ties are broken deterministically; zero spread returns rows in order, cluster by cluster);
    large-magnitude costs (the row shift removes offsets and ε is relative to ``R``, not to the
    raw values). Zero capacities are allowed (those clusters get nothing). Deterministic.

    Args:
        cost: ``[n, k]`` finite costs (any float/int dtype; computed in float64).
        capacity: one int (every cluster gets it; ``k·capacity`` must equal ``n``) or ``[k]``
            non-negative ints summing to ``n``.
        eps: tie tolerance ε in cost units (> 0); ``None`` for ``1e-12 · R``.
        warm_start: ``[k]`` cluster prices to start from (``AssignmentResult.prices`` of a
            similar problem); the result is exact either way.
    """
    cost, cap, warm = _checked_assignment_inputs(cost, capacity, eps, warm_start)
    n, k = cost.shape
    if n == 0:
        return AssignmentResult(np.zeros(0, np.int64), 0.0, 0.0, np.zeros(k), float(eps or 0.0), 0, 0)

    active = np.flatnonzero(cap > 0)
    sub = cost[:, active]
    row_min = sub.min(axis=1)
    reduced = sub - row_min[:, None]
    spread = float(reduced.max())
    tol = float(eps) if eps is not None else DEFAULT_REL_TOL * spread
    sub_labels, prices_active, n_rounds, n_search = _solve_reduced(
        reduced, cap[active], spread, tol, None if warm is None else warm[active])
    if np.any(sub_labels < 0) or not np.array_equal(np.bincount(sub_labels, minlength=active.size), cap[active]):
        raise RuntimeError("balanced_assignment: infeasible result; please report this input")  # pragma: no cover
    labels = active[sub_labels].astype(np.int64)
    objective = float(cost[np.arange(n), labels].sum())
    lower_bound = float(np.min(reduced + prices_active, axis=1).sum()
                        - np.dot(cap[active], prices_active) + row_min.sum())
    prices = np.full(k, np.nan)
    prices[active] = prices_active
    return AssignmentResult(labels, objective, lower_bound, prices, tol, n_rounds, n_search)


def _checked_assignment_inputs(cost: np.ndarray, capacity: int | np.ndarray | Sequence[int], eps: float | None,
                               warm_start: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``solve_balanced_assignment``'s inputs checked: ``(cost as float64 [n, k], capacities [k],
    warm-start prices [k] or None)``; a ``ValueError`` says what to change."""
    cost = np.asarray(cost)
    if cost.ndim != 2:
        raise ValueError(f"cost must be a 2-D [n_rows, n_clusters] matrix, got shape {cost.shape}")
    n, k = cost.shape
    if k == 0:
        raise ValueError("cost has no columns: need at least one cluster")
    cost = cost.astype(np.float64, copy=False)
    if not np.all(np.isfinite(cost)):
        raise ValueError("cost contains NaN or inf; replace them with finite values (e.g. a large finite penalty)")
    cap = _check_capacity(capacity, n, k)
    if eps is not None and not (np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number (cost units) or None, got {eps!r}")
    warm = None
    if warm_start is not None:
        warm = np.asarray(warm_start, dtype=np.float64)
        if warm.shape != (k,):
            raise ValueError(f"warm_start must be [{k}] cluster prices (AssignmentResult.prices), got shape {warm.shape}")
    return cost, cap, warm


def _solve_reduced(reduced: np.ndarray, cap: np.ndarray, spread: float, tol: float, warm: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The two stages of ``solve_balanced_assignment`` on row-shifted costs ``[n, k]`` whose clusters
    all have room (``cap > 0``): ``(labels, prices, auction rounds, shortest-path searches)``."""
    n, k = reduced.shape
    if k == 1 or spread == 0.0:
        return np.repeat(np.arange(k), cap), np.zeros(k), 0, 0
    solved = None
    n_rounds = 0
    if warm is not None:
        # Warm prices (e.g. the previous k-means iteration's) usually need only a few dozen
        # shortest-path searches; if they need more than n/20, they were a poor start.
        warm_prices = np.nan_to_num(warm, nan=0.0, posinf=0.0, neginf=0.0)
        solved = _shortest_paths(reduced, cap, warm_prices, tol, max_searches=max(_WARM_MIN_SEARCHES, n // 20))
    if solved is None:
        # Cold start: auction prices. With b = −reduced, its cluster prices P_j are cost-side
        # prices: b_ij − P_j ≥ max_l (b_il − P_l) − ε  ⇔  c_ij + P_j ≤ min_l (c_il + P_l) + ε.
        eps_stop = max(_AUCTION_EPS_STOP * spread, tol)
        auction_prices, _, n_rounds = _auction(
            -reduced, cap, eps_stop, max(_AUCTION_EPS_START * spread, eps_stop), _EPS_SCALING_FACTOR,
            _AUCTION_MAX_ROUNDS)
        solved = _shortest_paths(reduced, cap, auction_prices, tol)
    labels, prices, n_search = solved
    return labels, prices, n_rounds, n_search


def balanced_assignment(cost: np.ndarray, capacity: int | np.ndarray | Sequence[int], *,
                        eps: float | None = None) -> tuple[np.ndarray, float]:
    """Labels ``[n]`` and objective ``Σ cost[i, label_i]`` of the capacitated assignment.

    Every cluster ``j`` receives exactly ``capacity[j]`` rows (an int capacity applies to all
    clusters). Solved as a transportation problem on the ``n × k`` matrix — auction prices, then
    exact successive shortest paths; see :func:`solve_balanced_assignment`. The objective is
    within ``n·ε`` of the optimum, ε = ``eps`` or by default ``1e-12 · R`` (``R`` = largest per-row
    cost spread): optimal up to float rounding. Memory ``O(n·k)``; no ``n × n`` matrix is built.
    """
    res = solve_balanced_assignment(cost, capacity, eps=eps)
    return res.labels, res.objective


# --------------------------------------------------------------------------------------------
# Balanced k-means
# --------------------------------------------------------------------------------------------


@dataclass
class BalancedKMeansResult:
    """Outcome of :func:`balanced_kmeans`.

    Clusters are ordered by their smallest member and ``labels``/``centroids`` follow that order:
    ``clusters[labels[i]]`` contains ``i`` and ``centroids[j]`` is the mean of ``clusters[j]``.
    """

    labels: np.ndarray  # [n] int64
    clusters: np.ndarray  # [k, n/k] int64 neuron indices, ascending within each row
    centroids: np.ndarray  # [k, q] float64 (EW Eq. 14 means of the final clusters)
    objective: float  # EW Eq. 13: Σ_i dist(x_i, centroid of its cluster) under ``metric``
    objective_history: list[float] = field(default_factory=list)  # objective after each update
    n_iter: int = 0  # assignment+update iterations run
    converged: bool = False  # True if the assignment stopped changing before max_iter
    metric: str = "sqeuclidean"
    seed: int = 0


def _as_float_features(features: np.ndarray, name: str = "features") -> np.ndarray:
    x = np.asarray(features)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [n_neurons, n_features] array, got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
            or x.dtype == np.bool_):
        raise ValueError(f"{name} must be numeric, got dtype {x.dtype}")
    if x.dtype == np.bool_:
        x = x.astype(np.float32)  # exact for 0/1 features, half the memory of float64
    elif not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    step = _row_chunks(*x.shape)
    for s in range(0, x.shape[0], step):  # blockwise: no full-size boolean temporary
        if not np.isfinite(x[s:s + step]).all():
            raise ValueError(f"{name} contains NaN or inf (first bad row block starts at row {s})")
    return x


def _row_chunks(n: int, q: int, budget_bytes: int = 64 << 20) -> int:
    return max(1, min(n, budget_bytes // max(1, 8 * q)))


def pairwise_distances(features: np.ndarray, centroids: np.ndarray, metric: Metric = "sqeuclidean",
                       *, sq_norms: np.ndarray | None = None) -> np.ndarray:
    """``[n, k]`` float64 distances between rows of ``features`` and ``centroids``.

    Uses ``||a||² − 2 a·c + ||c||²`` in float64 (clipped at 0), converting row blocks of
    ``features`` to float64 on the fly so a float32 feature matrix is never copied whole.
    ``metric="euclidean"`` takes the square root (CM Eq. 6).
    """
    if metric not in ("sqeuclidean", "euclidean"):
        raise ValueError(f"metric must be 'sqeuclidean' or 'euclidean', got {metric!r}")
    c = np.asarray(centroids, dtype=np.float64)
    n, q = features.shape
    c_sq = np.einsum("ij,ij->i", c, c)
    out = np.empty((n, c.shape[0]))
    step = _row_chunks(n, q)
    for s in range(0, n, step):
        block = np.asarray(features[s:s + step], dtype=np.float64)
        a_sq = sq_norms[s:s + step] if sq_norms is not None else np.einsum("ij,ij->i", block, block)
        d = block @ c.T
        d *= -2.0
        d += a_sq[:, None]
        d += c_sq[None, :]
        out[s:s + step] = d
    np.maximum(out, 0.0, out=out)
    if metric == "euclidean":
        np.sqrt(out, out=out)
    return out


def _sq_norms(features: np.ndarray) -> np.ndarray:
    n, q = features.shape
    out = np.empty(n)
    step = _row_chunks(n, q)
    for s in range(0, n, step):
        block = np.asarray(features[s:s + step], dtype=np.float64)
        out[s:s + step] = np.einsum("ij,ij->i", block, block)
    return out


def _centroids_of(features: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    """EW Eq. 14: mean of each cluster's rows, accumulated in float64 (a loop over k clusters)."""
    out = np.empty((clusters.shape[0], features.shape[1]))
    for j, members in enumerate(clusters):
        out[j] = np.asarray(features[members], dtype=np.float64).mean(axis=0)
    return out


def _clusters_from_labels(labels: np.ndarray, k: int) -> np.ndarray:
    """[k, m] member indices, ascending within rows, rows in label order."""
    order = np.lexsort((np.arange(labels.size), labels))
    return order.reshape(k, -1)


def _kmeanspp_init(features: np.ndarray, k: int, rng: np.random.Generator,
                   sq_norms: np.ndarray) -> np.ndarray:
    """k-means++ D² seeding over *distinct row indices* (duplicate rows may still coincide)."""
    n = features.shape[0]
    chosen = np.empty(k, dtype=np.int64)
    taken = np.zeros(n, dtype=bool)
    chosen[0] = rng.integers(n)
    taken[chosen[0]] = True
    d2 = pairwise_distances(features, features[chosen[:1]], sq_norms=sq_norms)[:, 0]
    for t in range(1, k):
        weights = np.where(taken, 0.0, d2)
        total = weights.sum()
        if total > 0 and np.isfinite(total):
            idx = int(rng.choice(n, p=weights / total))
        else:  # all remaining rows coincide with a centroid: pick uniformly among untaken rows
            idx = int(rng.choice(np.flatnonzero(~taken)))
        chosen[t] = idx
        taken[idx] = True
        d_new = pairwise_distances(features, features[idx:idx + 1], sq_norms=sq_norms)[:, 0]
        np.minimum(d2, d_new, out=d2)
    return np.asarray(features[np.sort(chosen)], dtype=np.float64)


def balanced_kmeans(features: np.ndarray, n_clusters: int, *, init: np.ndarray | None = None,
                    seed: int = 0, max_iter: int = 50, metric: Metric = "sqeuclidean",
                    eps: float | None = None) -> BalancedKMeansResult:
    """Balanced k-means (EW App. G, Eqs. 13–14; CM Eqs. 7–10): ``n_clusters`` clusters of exactly ``n / n_clusters``.

    1. **Init** — ``init`` (``[k, q]`` explicit centroids; CMoE passes the features of the
       top-activation-rate neurons) or, when ``None``, k-means++ D² seeding of ``k`` distinct
       rows drawn with ``numpy.random.default_rng(seed)`` (EW: "sample centroids from A_r"; D²
       sampling spreads the samples out; rows that duplicate an already-chosen row get weight 0).
    2. **Assign** — :func:`solve_balanced_assignment` on the ``n × k`` distance matrix
       (``||a||² − 2a·c + ||c||²`` in float64) with capacity ``n / k`` for every cluster.
    3. **Update** — every centroid becomes the mean of its members (Eq. 14).
    4. Repeat 2–3 until the assignment stops changing (CM's "centroids unchanged") or
       ``max_iter`` iterations. A new assignment is only accepted if it strictly lowers the
       cost under the current centroids, so with ``metric="sqeuclidean"`` the Eq. 13 objective
       recorded after every update is non-increasing (the mean minimises the squared distances
       for fixed clusters). ``metric="euclidean"`` (CM Eq. 6 distances) uses the same mean
       update, which does not minimise Σ‖x − μ‖, so its history need not be monotone.

    ``objective`` is Σ_i dist(x_i, centroid of its cluster) under ``metric``. Deterministic for a
    given ``seed`` (and ``init``). ``features`` may be float32 or bool (e.g. :func:`atopk_features`);
    it is converted to float64 block by block, never copied whole.

    Args:
        features: ``[n, q]`` one row per neuron (activation pattern / ATopK marker vector).
        n_clusters: ``k``; must divide ``n``.
        init: optional ``[k, q]`` initial centroids.
        seed: seeds the k-means++ initialisation (unused when ``init`` is given).
        max_iter: maximum number of assign + update iterations (≥ 1).
        metric: ``"sqeuclidean"`` (EW Eq. 13) or ``"euclidean"`` (CM Eq. 6).
        eps: tie tolerance of every assignment step (see :func:`solve_balanced_assignment`).

    Cost: per iteration one ``n × q × k`` float64 product plus one assignment, warm-started from
    the previous iteration's prices (≈ 0.1 s for 14,336 × 64 on 2 cores).
    """
    x = _as_float_features(features)
    n, q = x.shape
    if isinstance(n_clusters, bool) or int(n_clusters) != n_clusters or n_clusters < 1:
        raise ValueError(f"n_clusters must be a positive integer, got {n_clusters!r}")
    k = int(n_clusters)
    if k > n:
        raise ValueError(f"n_clusters={k} exceeds the number of neurons n={n}; use at most {n} clusters")
    if n % k:
        lo, hi = (n // k) * k, (n // k + 1) * k
        raise ValueError(
            f"balanced k-means needs n divisible by n_clusters: n={n} neurons cannot be split into "
            f"{k} equal clusters ({n / k:g} each); choose n_clusters dividing {n} or pass {lo} or {hi} neurons"
        )
    if metric not in ("sqeuclidean", "euclidean"):
        raise ValueError(f"metric must be 'sqeuclidean' or 'euclidean', got {metric!r}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be ≥ 1, got {max_iter}")
    m = n // k
    sq = _sq_norms(x)
    if init is not None:
        centroids = np.asarray(init, dtype=np.float64)
        if centroids.shape != (k, q):
            raise ValueError(f"init must be [n_clusters, n_features] = [{k}, {q}], got shape {centroids.shape}")
        if not np.all(np.isfinite(centroids)):
            raise ValueError("init contains NaN or inf")
        centroids = centroids.copy()
    else:
        centroids = _kmeanspp_init(x, k, np.random.default_rng(seed), sq)

    rows = np.arange(n)
    dist = pairwise_distances(x, centroids, metric, sq_norms=sq)
    assignment = solve_balanced_assignment(dist, m, eps=eps)
    labels = assignment.labels
    history: list[float] = []
    converged = False
    n_iter = 0
    while True:
        n_iter += 1
        centroids = _centroids_of(x, _clusters_from_labels(labels, k))
        dist = pairwise_distances(x, centroids, metric, sq_norms=sq)
        current = float(dist[rows, labels].sum())
        history.append(current)
        if n_iter >= max_iter:
            break
        # The previous prices are a good warm start: the centroids moved only a little.
        new = solve_balanced_assignment(dist, m, eps=eps, warm_start=assignment.prices)
        tol = 1e-12 * max(1.0, abs(current))
        if np.array_equal(new.labels, labels) or not new.objective < current - tol:
            converged = True
            break
        labels, assignment = new.labels, new

    # Canonical order: members ascending, clusters by smallest member.
    clusters = _clusters_from_labels(labels, k)
    order = np.argsort(clusters[:, 0], kind="stable")
    clusters = clusters[order]
    centroids = centroids[order]
    relabel = np.empty(k, dtype=np.int64)
    relabel[order] = np.arange(k)
    labels = relabel[labels]
    return BalancedKMeansResult(labels=labels, clusters=clusters, centroids=centroids,
                                objective=history[-1], objective_history=history, n_iter=n_iter,
                                converged=converged, metric=metric, seed=seed)


# --------------------------------------------------------------------------------------------
# Representative neurons (CM Eq. 17) and ATopK features (CM Eq. 4)
# --------------------------------------------------------------------------------------------


def representative_neurons(features: np.ndarray, clusters: np.ndarray | Sequence[Sequence[int]],
                           centroids: np.ndarray) -> np.ndarray:
    """CM Eq. 17: for every cluster, the member whose feature row is closest (L2) to its centroid.

    ``clusters`` is ``[k, m]`` neuron indices (or a list of index lists, sizes may differ);
    ``centroids`` is ``[k, q]``. Returns ``[k]`` int64 neuron indices; ties go to the member
    listed first. Distances are computed from exact differences in float64.
    """
    x = _as_float_features(features)
    c = np.asarray(centroids, dtype=np.float64)
    k = len(clusters)
    if c.ndim != 2 or c.shape != (k, x.shape[1]):
        raise ValueError(f"centroids must be [n_clusters, n_features] = [{k}, {x.shape[1]}], got shape {c.shape}")
    out = np.empty(k, dtype=np.int64)
    for j in range(k):
        members = np.asarray(clusters[j], dtype=np.int64).ravel()
        if members.size == 0:
            raise ValueError(f"cluster {j} is empty; every cluster needs at least one neuron")
        if members.min() < 0 or members.max() >= x.shape[0]:
            raise ValueError(f"cluster {j} has neuron indices outside [0, {x.shape[0]})")
        diff = np.asarray(x[members], dtype=np.float64) - c[j]
        out[j] = members[int(np.argmin(np.einsum("ij,ij->i", diff, diff)))]
    return out


def atopk_features(indices: np.ndarray, n_neurons: int) -> np.ndarray:
    """Dense ATopK activation features ``[n_neurons, T]`` float32 from marker rows ``[T, K]``.

    Row ``t`` of ``indices`` lists the ``K`` neurons whose marker is 1 for token ``t`` (CM Eq. 4,
    as stored by profiling); the result has ``out[i, t] = 1`` iff neuron ``i`` is among them, so
    row ``i`` is neuron ``i``'s activation status over the sampled tokens (its clustering feature,
    CM §3.1). A repeated index within a row still gives 1.
    """
    idx = np.asarray(indices)
    if idx.ndim != 2:
        raise ValueError(f"indices must be a 2-D [n_tokens, K] array of neuron indices, got shape {idx.shape}")
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be integers, got dtype {idx.dtype}")
    if isinstance(n_neurons, bool) or int(n_neurons) != n_neurons or n_neurons < 1:
        raise ValueError(f"n_neurons must be a positive integer, got {n_neurons!r}")
    n_neurons = int(n_neurons)
    t = idx.shape[0]
    out = np.zeros((n_neurons, t), dtype=np.float32)
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n_neurons:
            raise ValueError(f"indices must lie in [0, {n_neurons}) (n_neurons), got values in [{lo}, {hi}]")
        out[idx, np.arange(t)[:, None]] = 1.0
    return out
