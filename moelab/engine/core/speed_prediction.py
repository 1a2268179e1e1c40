"""A plan's speed predicted from this machine's measured kernel times (numpy only: the API predicts as the designer's
sliders move, without torch).

The table (``evaluation.speed_table`` measures it once per model, machine, dtype and thread count, and caches it as
JSON under ``<data_dir>/speed-tables/``) holds, per phase (``evaluation.speed``'s decode at batch 1 and 8, prefill):

- the whole dense model's seconds, the share of them its FFNs take (the model timed with and without them in the
  same rounds), and one dense FFN layer's seconds;
- the seconds of random-weight MoE FFN layers (moelab's runtime, its own kernels) over a grid of layouts, each
  layer's weights cycled through enough copies that they come from memory, not cache, as in a whole model.

Per phase a layer's time is modelled as non-negative multiples of what it moves and computes (``FEATURES``: a fixed
cost, the shared part's neurons, the routed neurons its tokens touch (weights read), the routed neuron-rows computed,
the (token, expert) pairs, the router's scores, the rows of every expert computed in two GEMMs, the products ranked for
``down_keep``), fitted by non-negative least squares to the grid. A plan's time is
then the dense model's with its FFNs' share scaled by the mean over layers of each planned layer's predicted time over
the dense FFN's, both timed alone (a layer inside the model runs slower than alone, and a ratio carries that over
where a difference of seconds did not); its speed is dense's time over that. Choice: a plan (the designer's preview)
has no routing yet, so routing is taken as uniform when counting the experts a batch touches (``E·(1-(1-k/E)^T)``);
real routing repeats itself across sequences and touches fewer (on the default model about half as many at 8), so
that prediction of batch-8 decode leans pessimistic. A converted model's layers carry the count measured on held-out
text (``touched``: tokens -> experts), which replaces the uniform one.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..evaluation.busy_machine import BUSY_SHARE

TABLE_DIR = "speed-tables"
TABLE_VERSION = 15  # 2: every expert masked at prefill (``runs_dense``); 3: native decode kernel; 4: native prefill;
# 5: layouts timed as ratios to the dense FFN in the same rounds; 6: a decode step's whole block in one native call;
# 7: the FFNs' share of the model measured, weights cycled past the largest cache, the shared expert's kept down rows,
# a native prefill's two GEMMs where most experts are selected; 8: the neurons ranked for down_keep, the grid's
# small experts at two thirds and four fifths selected; 9: no more copies of a layer cycled than the model has layers;
# 10: a prefill computes the last position's logits only, as generation does (``evaluation.speed``); 11: a prefill
# of experts past NATIVE_PREFILL_MAX_EXPERT_BYTES runs torch's kernels; 12: a decode step of a top-0 layer (the grid's
# all-shared layout) in the whole-block call; 13: two small-expert layouts at the speed guard's boundary; 14: the
# prefill's choice between the pairs kernel and two GEMMs measured on the machine (``native_dense_shares``); 15: the
# rest of a step timed as the runtime runs it, its projections in the native decode call (``rest_share``)
#: ``scope`` of a table that timed the FFN layers only (``speed_table.measure_ffn_table``: a streamed model)
FFN_LAYERS = "ffn_layers"
FEATURES = ("fixed", "shared_neurons", "touched_neurons", "computed_rows", "pairs", "router_scores", "dense_rows",
            "ranked_neurons")

#: ``runtime.moelab_kernels``' CPU choice where the native kernels cannot run, mirrored here without torch
#: (tests/engine/test_speed_prediction.py checks they agree): above GATHER_MAX_TOKENS tokens, routed experts of m
#: neurons run every expert masked (``dense``) once the selected share k/E reaches DENSE_SHARE + m / DENSE_NEURONS.
GATHER_MAX_TOKENS = 8
DENSE_SHARE = 0.1
DENSE_NEURONS = 100
#: ``runtime.moelab_native``'s: with the native kernels, above GATHER_MAX_TOKENS tokens every routed expert runs in two
#: GEMMs once the selected share k/E reaches this (the lower one from NATIVE_LONG_TOKENS tokens on), where the
#: machine's own shares are not known (a table measured with the native kernels holds them: ``dense_shares``)
NATIVE_DENSE_SHARE, NATIVE_DENSE_SHARE_LONG, NATIVE_LONG_TOKENS = 0.7, 0.55, 1024
#: ``runtime.moelab_native``'s: a prefill's selected pairs run natively only for experts of at most these bytes
NATIVE_PREFILL_MAX_EXPERT_BYTES = 3 << 19


def runs_native_prefill(tokens: int, expert_size: int, d_model: int) -> bool:
    """``runtime.moelab_native.runs_native_prefill``, mirrored without torch (the tests check they agree)."""
    return tokens <= GATHER_MAX_TOKENS or 3 * expert_size * d_model * 4 <= NATIVE_PREFILL_MAX_EXPERT_BYTES


def runs_dense(layer: Mapping[str, Any], tokens: int, native: bool = False,
               shares: Sequence[float] | None = None) -> bool:
    """Whether the runtime computes every routed expert of ``layer`` for ``tokens`` tokens (two GEMMs over all of
    them, the unselected ones zeroed); ``native``: the native kernels run, which compute the selected pairs only
    below the first of ``shares`` (the second past ``NATIVE_LONG_TOKENS`` tokens; None: ``NATIVE_DENSE_SHARE``,
    ``NATIVE_DENSE_SHARE_LONG``)."""
    e, m, k = int(layer.get("n_routed", 0)), int(layer.get("expert_size", 0)), int(layer.get("top_k", 0))
    if native:
        short, long = shares or (NATIVE_DENSE_SHARE, NATIVE_DENSE_SHARE_LONG)
        share = short if tokens <= NATIVE_LONG_TOKENS else long
    else:
        share = DENSE_SHARE + m / DENSE_NEURONS
    return tokens > GATHER_MAX_TOKENS and 0 < k < e and k >= e * share


def layer_features(layer: Mapping[str, Any], tokens: int, native: bool = False, d_model: int = 0,
                   shares: Sequence[float] | None = None) -> np.ndarray:
    """``FEATURES`` of one FFN layer run on ``tokens`` tokens. ``layer``: a ``moe_layers`` entry (``kind`` moe: d_shared,
    n_routed, expert_size, top_k, down_keep) or ``{"kind": "dense", "d_ffn": D}`` (all of it shared). A layer that
    ``runs_dense`` computes all its routed rows in large GEMMs (``dense_rows``) and moves no (token, expert) pairs.
    ``native``: the native kernels run, whose prefill multiplies every down row of a selected expert (the rows a
    token did not keep as zeros), so its computed rows do not shrink with ``down_keep``; at a decode step they read
    only the kept down rows of the shared expert as of the routed ones (``down_keep`` applies to both). ``d_model``:
    the model's width, whose experts past ``NATIVE_PREFILL_MAX_EXPERT_BYTES`` a prefill runs in torch's kernels
    (``runs_native_prefill``; 0: experts taken as small). ``shares``: the machine's (``runs_dense``)."""
    if layer.get("kind", "moe") == "dense":
        return np.array([1.0, tokens * float(layer["d_ffn"]), 0, 0, 0, 0, 0, 0])
    e, m, k = int(layer.get("n_routed", 0)), int(layer.get("expert_size", 0)), int(layer.get("top_k", 0))
    native = native and runs_native_prefill(tokens, m, d_model)
    d_shared = float(layer.get("d_shared", 0))
    # gate and up rows whole, the down rows kept (all of them multiplied by the native prefill)
    kept = (2 + float(layer.get("down_keep", 1.0))) / 3
    down = 1.0 if native and tokens > GATHER_MAX_TOKENS else kept
    shared = tokens * d_shared * (kept if native and tokens <= GATHER_MAX_TOKENS else 1.0)
    scores = float(tokens * e) if k else 0.0
    dense = runs_dense(layer, tokens, native, shares)
    # down_keep ranks each product it computes (the shared expert's, the selected experts' or, in two GEMMs, all)
    ranked = tokens * (d_shared + (e if dense else k) * m) if kept < 1 else 0.0
    if dense:
        return np.array([1.0, shared, 0, 0, 0, scores, float(tokens * e * m), ranked])
    touched = e * (1 - (1 - k / e) ** tokens) if e and k else 0.0
    seen = (layer.get("touched") or {}).get(str(tokens))
    if seen is not None and e and k:  # measured on real text (``evaluation.metrics.experts_touched``)
        touched = float(seen)
    return np.array([1.0, shared, touched * m * down, tokens * k * m * down, float(tokens * k), scores, 0.0, ranked])


def fit(rows: Sequence[Mapping[str, Any]], tokens: int, phase: str, native: bool = False, d_model: int = 0,
        shares: Sequence[float] | None = None) -> np.ndarray:
    """Non-negative coefficients of ``FEATURES`` fitting the grid's measured seconds of ``phase`` (relative error)."""
    from scipy.optimize import nnls

    x = np.stack([layer_features(r["layer"], tokens, native, d_model, shares) for r in rows])
    y = np.array([r["seconds"][phase] for r in rows])
    scale = 1 / y  # each layout weighs by its relative error, not its size
    coef, _ = nnls(x * scale[:, None], np.ones_like(y))
    return coef


def predict(table: Mapping[str, Any], layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each phase's predicted seconds and speed over dense of a model whose FFN layers are ``layers`` (``moe_layers``
    entries, one per decoder layer). Layers of other kinds (low-rank, hierarchical …) are not modelled, nor is a model
    whose table timed its FFN layers only: ValueError."""
    if table.get("scope") == FFN_LAYERS:
        raise ValueError("only this model's FFN layers were timed on this machine, as it was profiled streamed and "
                         "never whole in memory; the speed guard reads them, but no whole-model speed is predicted")
    unknown = sorted({str(l.get("kind")) for l in layers} - {"moe", "dense"})
    if unknown:
        raise ValueError(f"no speed model for layer kind(s) {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for phase, entry in table["phases"].items():
        coef = np.asarray(entry["coef"])
        tokens = int(entry["tokens"])
        runs = [_as_run(table, l, tokens) for l in layers]
        ratios = [1.0 if run is None else float(layer_features(run, tokens, bool(table.get("native")), _width(table),
                                                               dense_shares(table)) @ coef)
                  / entry["dense_ffn_s"] for run in runs]
        share = entry["ffn_share"]
        rest = rest_share(entry)
        seconds = entry["dense_model_s"] * (rest + share * sum(ratios) / table["n_layers"])
        out[phase] = {"seconds": seconds, "dense_seconds": entry["dense_model_s"],
                      "speedup": entry["dense_model_s"] / seconds if seconds > 0 else None}
    return out


def rest_share(entry: Mapping[str, Any]) -> float:
    """The share of a dense step (a table's phase ``entry``) that is not its FFNs, as moelab's runtime runs it: timed
    with the projections outside the FFNs in the native decode call (``rest_share``) where a step of this many tokens
    runs them there (up to GATHER_MAX_TOKENS, ``runtime.moelab_linear``). Above, nothing differs from the dense model's
    rest, so it is ``1 - ffn_share``: the second timing of the same thing only added its noise, and the dense model in
    the kernels was predicted at 0.986-0.990x dense at prefill, where it runs the dense model's own GEMMs (a Zen 3 EPYC,
    two tables). A table from before ``rest_share`` was timed has the dense model's rest in every phase."""
    share = float(entry["ffn_share"])
    if int(entry["tokens"]) > GATHER_MAX_TOKENS:
        return 1 - share
    return float(entry.get("rest_share", 1 - share))


def _as_run(table: Mapping[str, Any], layer: Mapping[str, Any], tokens: int) -> Mapping[str, Any] | None:
    """The layout ``layer`` runs as for ``tokens`` tokens, None for the dense FFN the table timed: a layer kept dense
    decodes in the MoE layers' native call (``runtime.moelab_dense``) where the table's kernels are native, as the
    grid's all-shared layout of the model's width does (at a prefill it runs the dense MLP's own GEMMs)."""
    if layer.get("kind") != "dense":
        return layer
    if table.get("native") and tokens <= GATHER_MAX_TOKENS:
        return all_shared_layout(table)
    return None


def layer_ratios(table: Mapping[str, Any], layer: Mapping[str, Any]) -> np.ndarray:
    """``[phases, n_routed + 1]``: the predicted seconds of the MoE layer ``layer`` (a ``moe_layers`` entry; its
    ``top_k`` is ignored) at every top-k from 0 to ``n_routed``, over the dense FFN's, per phase of ``table``."""
    native = bool(table.get("native"))
    out = []
    for entry in table["phases"].values():
        feats = np.stack([layer_features({**layer, "top_k": k}, int(entry["tokens"]), native, _width(table),
                                         dense_shares(table))
                          for k in range(int(layer["n_routed"]) + 1)])
        out.append(feats @ np.asarray(entry["coef"]) / entry["dense_ffn_s"])
    return np.stack(out)


def dense_shares(table: Mapping[str, Any]) -> list[float] | None:
    """The shares from which the native kernels ran a prefill's routed experts in two GEMMs when ``table`` was
    measured (``runtime.moelab_native.dense_shares``; None: the fixed ones, as a table of version 13 or before ran)."""
    return table.get("native_dense_shares")


def _width(table: Mapping[str, Any]) -> int:
    """The d_model of the model ``table`` timed (0 where it does not say)."""
    return int((table.get("model") or {}).get("d_model") or 0)


def top_k_no_slower(table: Mapping[str, Any], layer: Mapping[str, Any], margin: float = 0.0) -> np.ndarray:
    """``[n_routed + 1]`` booleans: the top-k at which ``layer`` is predicted no slower than the dense FFN in any phase
    (the budget plan's ``speed_guard``); ``margin``: at most ``1 - margin`` of the dense FFN's time in every phase, so
    that a plan the guard holds at dense is not slower than dense by the prediction's own error."""
    return (layer_ratios(table, layer) <= 1.0 - margin).all(axis=0)


def plan_layers(rows: Sequence[Mapping[str, Any]], down_keep: float = 1.0) -> list[dict[str, Any]]:
    """A plan's rows (``core.allocation.LayerPlan`` as dicts: d_shared, n_routed, d_expert, top_k) as ``moe_layers``
    entries."""
    return [{"kind": "moe", "d_shared": int(r["d_shared"]), "n_routed": int(r["n_routed"]), "expert_size": int(r["d_expert"]),
             "top_k": int(r["top_k"]), "down_keep": float(down_keep)} for r in rows]


def table_key(model: Mapping[str, Any], machine: str, dtype: str, threads: int, kernels: str = "") -> str:
    """The file stem of a table: the model's source and shape, the machine, dtype and threads, and the build of the
    native kernels it timed (``kernels``: a changed kernel is timed again, not predicted from its predecessor)."""
    raw = json.dumps([model.get("source"), model.get("d_model"), model.get("d_ffn"), model.get("n_layers"), machine, dtype,
                      int(threads), TABLE_VERSION, kernels], sort_keys=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(model.get("source") or "model"))[-40:]
    return f"{name}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


def cpu_machine_name() -> str:
    """This host's name for a table timed on its CPU (``speed_table.machine_name``), known without torch."""
    return f"cpu: {platform.node()} {platform.processor() or platform.machine()}"


def find_table(data_dir: Path, source: str | None, machine: str | None = None,
               threads: int | None = None) -> dict[str, Any] | None:
    """The table measured for the model ``source`` that best fits where the model will run: one of ``machine`` (a
    ``speed_table.machine_name``) before any other machine's, of ``threads`` before other thread counts, then the
    newest; None when no machine of this data directory timed the model."""
    found = []
    for path in (Path(data_dir) / TABLE_DIR).glob("*.json"):
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if table.get("version") == TABLE_VERSION and table.get("model", {}).get("source") == source:
            found.append(table)
    return max(found, key=lambda t: (machine is not None and t.get("machine") == machine,
                                     threads is not None and t.get("threads") == threads, t.get("measured_at", "")),
               default=None)


def predicted_summary(table: Mapping[str, Any] | None, layers: Sequence[Mapping[str, Any]],
                      machine: str | None = None) -> dict[str, Any]:
    """What the designer and ``moelab convert`` show: each phase's predicted speed over dense and where the kernel
    times come from, or why there is no prediction. ``layers`` may carry the experts a batch touches (``touched``).
    ``machine``: where the model will run; a table timed on another machine is used but the note names it."""
    if table is None:
        return {"note": "no kernel timings of this model on this machine yet: they are measured (once, about 35 s) "
                        "by the next profile of it unless MOELAB_TIME_KERNELS is off (a table measured before this "
                        "runtime's kernels changed is not used)"}
    try:
        phases = predict(table, layers)
    except ValueError as exc:
        return {"note": str(exc)}
    kernels = predict(table, kernel_dense_layers(table)) if table.get("native") else None
    return {"phases": {p: {"speedup": v["speedup"], "seconds": v["seconds"], "dense_seconds": v["dense_seconds"]}
                       for p, v in phases.items()},
            **({"kernel_dense": {p: v["speedup"] for p, v in kernels.items()}} if kernels else {}),
            "machine": table["machine"], "dtype": table["dtype"], "threads": table["threads"], "measured_at": table["measured_at"],
            "note": ("predicted from this machine's measured kernel times (" if machine in (None, table["machine"]) else
                     f"predicted from kernel times measured on another machine, {table['machine']} (this one has none; ") + (
                "the experts a batch touches measured on held-out text" if any(l.get("touched") for l in layers)
                else "routing taken as uniform") + ")" + busy_words(table)}


def busy_words(table: Mapping[str, Any]) -> str:
    """'; the kernel times were measured while other processes took 23% of the CPUs …' for a table measured on a busy
    machine (``others_cpu_share``, recorded since the table's version 12), '' otherwise. Choice: such a table is said
    to be unreliable, not measured again on its own: on a machine that stays busy every profile (and every streamed
    conversion, whose 8B-shaped table takes minutes) would measure it again."""
    share = table.get("others_cpu_share")
    if not isinstance(share, (int, float)) or share < BUSY_SHARE:
        return ""
    return (f"; the kernel times were measured while other processes took {share:.0%} of the CPUs, which slows the MoE "
            f"layers' many small parallel calls more than the dense FFN's: unreliable (delete the table under "
            f"{TABLE_DIR}/ and profile again with the machine to itself)")


def kernel_dense_layers(table: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dense model in moelab's kernels (``evaluation.kernel_dense``) as ``moe_layers`` entries: every layer kept
    dense, which a decode step runs in the whole-block call (the grid's all-shared layout, ``_as_run``) and a prefill
    in the MLP's own GEMMs. Predicted beside a plan, it says what the kernels give without sparsity."""
    return [{"kind": "dense"}] * int(table["n_layers"])


def all_shared_layout(table: Mapping[str, Any]) -> dict[str, Any]:
    """The grid's all-shared layout at the model's width: one FFN of every neuron in the shared expert, no routed one."""
    return {"kind": "moe", "d_shared": int(table["d_ffn"]), "n_routed": 0, "expert_size": 0, "top_k": 0, "down_keep": 1.0}


PHASE_WORDS = {"decode_b1": "decode batch 1", "decode_b8": "decode batch 8", "prefill": "prefill"}

#: how far a whole-model prediction typically lands from the time measured for it: within 5% in most phases of the
#: recipes timed by bench_recipe_speed.py on every CPU (docs/quality.md), up to 11% at an Ice Lake Xeon's prefill.
#: A phase predicted faster than dense by less than this is too close to call (``close_phases``), and ``--recipe
#: best``'s guard margin (``speed_margin``) is this allowance.
PREDICTION_ERROR = 0.05


def slower_phases(predicted: Mapping[str, Any]) -> list[str]:
    """The phases a prediction (``predicted_summary``) says run slower than dense."""
    return [p for p, v in (predicted.get("phases") or {}).items()
            if isinstance(v.get("speedup"), (int, float)) and v["speedup"] < 1]


def close_phases(predicted: Mapping[str, Any]) -> list[str]:
    """The phases a prediction says run faster than dense by less than ``PREDICTION_ERROR``: within the prediction's
    error of dense, so they may measure slower (a guarded ``best`` plan predicted 0.99-1.04x at prefill measured
    0.94-0.99x on an Ice Lake Xeon)."""
    return [p for p, v in (predicted.get("phases") or {}).items()
            if isinstance(v.get("speedup"), (int, float)) and 1 <= v["speedup"] < 1 + PREDICTION_ERROR]


def describe_predicted(predicted: Mapping[str, Any]) -> str:
    """One line: each phase's predicted speed over dense, which phases would be slower than dense and which are
    within the prediction's error of it (with the numbers)."""
    phases = predicted.get("phases") or {}
    if not phases:
        return f"predicted speed: none ({predicted.get('note')})"
    said = ", ".join(f"{PHASE_WORDS.get(p, p)} {v['speedup']:.2f}×" for p, v in phases.items() if v.get("speedup"))

    def listed(names: list[str]) -> str:
        return ", ".join(f"{PHASE_WORDS.get(p, p)} ({phases[p]['speedup']:.2f}×)" for p in names)

    slow, close = slower_phases(predicted), close_phases(predicted)
    verdict = ("; SLOWER than dense in " + listed(slow)) if slow else "; no phase slower than dense"
    if close:
        verdict += (f"{' and' if slow else ', but'} within the prediction's {PREDICTION_ERROR:.0%} error of dense in "
                    f"{listed(close)}: it may measure slower")
    return (f"predicted speed × dense: {said}{verdict}{kernel_dense_words(predicted)} ({predicted.get('machine')}, "
            f"{predicted.get('threads')} threads; {predicted.get('note')})")


def kernel_dense_words(predicted: Mapping[str, Any]) -> str:
    """'; the dense model in moelab's kernels 1.45× / 1.22× / 1.00×, the plan over it 1.05× / 1.10× / 1.20×' (phases
    in the prediction's order), '' where the table predicts none (a GPU's, or one without the native kernels)."""
    kernels, phases = predicted.get("kernel_dense") or {}, predicted.get("phases") or {}
    pairs = [(kernels.get(p), (phases.get(p) or {}).get("speedup")) for p in phases]
    if not kernels or not all(k and v for k, v in pairs):
        return ""
    return ("; the dense model in moelab's kernels " + " / ".join(f"{k:.2f}×" for k, _ in pairs)
            + ", the plan over it " + " / ".join(f"{v / k:.2f}×" for k, v in pairs))
