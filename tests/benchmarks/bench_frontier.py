"""The quality frontier: perplexity ratio to dense against FFN cost, every method and router, one run.

    python tests/benchmarks/bench_frontier.py --profile runs/p1 [--levels 0.85 0.75 0.6 0.5] [--windows 4]

Cost is ``ffn_flops_fraction``: FFN multiply-adds per token, router and scoring included, over the
dense FFN's (``runtime.param_count``). At every level ``c`` each configuration is built with the
largest cost that does not exceed ``c`` (``core.allocation.plan_flops_fraction``, checked against
the built modules' own count), so rows of one level cost the same within one expert's share:

* ExpertWeaver with the paper's settings (centroid router, α on all neurons), with the gate-mass
  router and with the ridge router; CMoE (S = A, representative
  router) with the gate-mass and ridge routers; ``--recipe best`` (``methods.expertweaver``:
  ridge router, α on the active budget, per-layer budget plan, skipped-expert compensation) and the
  same without the compensation; ``--recipe portable`` (leading plan: one top-k, leading dense layers,
  no compensation) before recovery, and ``portable@start``: the same switched to EW Eq. 11 as recovery
  fine-tuning starts it (softmax router from the gate centroids, weighted combine, 0 steps: the layout
  that exports to GGUF / native HF, ``start_modules``); AbsTopK-GLU (EW Eq. 2) at the
  same cost (it computes every gate: ``1/3 + 2/3 · k/d_ffn``);
* Dense2MoE with its defaults, at its own cost (it removes whole blocks: attention too).

Perplexity is measured on the held-out split of several built-in domains (never calibration
text) and summarised by the geometric mean of the per-domain ratios; each domain's ratio is
kept too. Every variant is also timed whole against dense in the same process (``evaluation.speed``: decode at
batch 1 and 8, prefill of 512; its MLPs swapped into the dense model for its rounds; ``--speed-repeats 0`` skips
it), so each quality sits beside its measured speed as well as its multiply-adds. ``--llamacpp f16 q8_0`` also times
every variant that exports to GGUF (``portable@start``) in llama.cpp against the dense GGUF of the same type
(``time_llamacpp``). Downstream accuracy:
bench_tasks.py (lm-evaluation-harness). Writes
tests/benchmarks/results/bench_frontier.json, a markdown table and an SVG plot next to it, and
prints one summary line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from moelab.settings import get_settings  # noqa: E402
from moelab.engine.core.allocation import plan_flops_fraction  # noqa: E402
from moelab.engine.core.fitting import collect_inputs, profile_token_windows  # noqa: E402
from moelab.engine.core.slicing import abstopk_modules, partition_modules  # noqa: E402
from moelab.engine.data.builtin import MIXED_PARTS  # noqa: E402
from moelab.engine.evaluation.metrics import evaluate_models, evaluate_variants, heldout_windows, swapped_mlps  # noqa: E402
from moelab.engine.evaluation.speed import PHASES, SpeedProtocol, time_phases  # noqa: E402
from moelab.engine.methods import cmoe, expertweaver, get_method  # noqa: E402
from moelab.engine.methods.cmoe import CMoEParams  # noqa: E402
from moelab.engine.methods.expertweaver import ExpertWeaverParams  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402
from moelab.engine.profiling.store import StoredProfile  # noqa: E402
from moelab.engine.runs import run_conversion  # noqa: E402
from moelab.engine.runtime.export import load_exported  # noqa: E402

DOMAINS = ("builtin:code", "builtin:prose", "builtin:literature", "builtin:chat")
#: leave-domain-out folds: each scored domain with the parts of builtin:mixed left out of calibration along
#: with it (code takes HumanEval with it; prose takes the stdlib code whose docstrings it is cut from)
LEAVE_OUT = {"builtin:code": ("code", "code_problems"), "builtin:prose": ("prose", "code"),
             "builtin:literature": ("literature",), "builtin:chat": ("chat",)}
RESULTS = ROOT / "tests" / "benchmarks" / "results"


def _ew(level: float, d_model: int, profile: Any, **kw: Any) -> ExpertWeaverParams | None:
    """The EW configuration of the largest cost ≤ ``level`` (scanning the active expert count)."""
    for k in range(63, 0, -1):
        p = ExpertWeaverParams(sparsity=1 - k / 64, **kw)
        if plan_flops_fraction(expertweaver.plan_for(profile, p), p.router, d_model) <= level + 1e-9:
            return p
    return None


def _cmoe(level: float, d_model: int, profile: Any, **kw: Any) -> CMoEParams | None:
    for total in range(63, 1, -1):
        p = CMoEParams(n_experts=64, shared=total // 2, active=total - total // 2, **kw)
        if plan_flops_fraction(cmoe.plan_for(profile, p), p.router, d_model) <= level + 1e-9:
            return p
    return None


def configurations(level: float, d_model: int, profile: Any, candidates: bool = False) -> dict[str, Any]:
    best = get_method("expertweaver").recipe("best", sparsity=round(1 - level, 6))
    portable = get_method("expertweaver").recipe("portable", sparsity=round(1 - level, 6))
    out = {
        "ew-paper": _ew(level, d_model, profile),
        "ew-gate_mass": _ew(level, d_model, profile, router="gate_mass"),
        "ew-ridge": _ew(level, d_model, profile, router="ridge"),
        "cmoe-paper": _cmoe(level, d_model, profile),
        "cmoe-gate_mass": _cmoe(level, d_model, profile, router="gate_mass"),
        "cmoe-ridge": _cmoe(level, d_model, profile, router="ridge"),
        "best": best,
        "best-no-compensation": replace(best, compensation="none"),  # what the skipped-expert means add
        "portable": portable,
    }
    if candidates:  # for the recipe: coarser or finer experts (64, the recipe before 128; 256),
        # and a quarter of the fit tokens for the ridge router and the error curves (the recipe before 16,384)
        out |= {"best-e64": replace(best, n_experts=64), "best-fit4k": replace(best, fit_tokens=4096),
                "best-e256": replace(best, n_experts=256),  # finer still: 6 neurons an expert, the router 2x again
                "best-fit32k": replace(best, fit_tokens=32768),  # more (and more varied) calibration tokens still
                "best-refit": replace(best, refit="converted_inputs"),  # fitted on the converted model's own inputs
                "best-fisher": replace(best, plan_error="fisher"),  # the plan's error in units of calibration loss
                "best-output": replace(best, plan_error="output"),  # every layer's relative FFN error alike
                # wider experts run sparse at prefill and batch-8 decode where 12-neuron ones cannot (issue 38)
                **{f"best-e{e}-keep{round(q * 100)}": replace(best, n_experts=e, down_keep=q) for e in (32, 16) for q in (0.5, 1.0)},
                # TEAL inside the experts (the recipe keeps 0.5 of each active expert's down inputs); 1: the recipe before
                **{f"best-keep{round(q * 100)}": replace(best, down_keep=q) for q in (0.3, 0.5, 0.7, 1.0)},
                # a layer worth more than this share of its experts written whole (issue 38: prefill in seconds)
                **{f"best-share{round(q * 100)}": replace(best, max_routed_share=q) for q in (0.5, 0.65, 0.8)},
                # only the top-k this machine's kernel table predicts no slower than dense in any phase (issue 38)
                "best-guard": replace(best, speed_guard="machine"),
                # the guard with a margin for its prediction's error: each layer at most 1 - m of its dense FFN's time
                **{f"best-margin{round(m * 100)}": replace(best, speed_margin=m) for m in (0.0, 0.05, 0.1)}}
        # portable's router, α basis and shared share (the leading plan uses the layers' mean α)
        out |= {"portable-centroid": replace(portable, router="centroid"),
                "portable-total": replace(portable, alpha_basis="total"),
                **{f"portable-a{a:g}": replace(portable, alpha_min=a, alpha_max=a) for a in (0.0, 0.25, 0.5, 0.75)},
                # coarser experts: fewer, larger matmuls and fewer top-k sums in llama.cpp (bench_llamacpp --experts)
                **{f"portable-e{e}": replace(portable, n_experts=e) for e in (32, 16, 12, 8)}}
    return {k: v for k, v in out.items() if v is not None}


def start_modules(modules: dict[int, Any], calib: Any) -> dict[int, Any]:
    """EW Eq. 11 as recovery starts it (``expertweaver.prepare_recovery``, 0 steps): every routed layer
    gets a softmax router from its gate centroids, scaled so its logits' std across experts is
    ``EW_INIT_LOGIT_STD`` on the calibration MLP inputs ``calib`` (recovery measures it on its first
    training batch), and the weighted combine; the model that exports to GGUF / native HF."""
    from moelab.engine.methods.expertweaver import EW_INIT_LOGIT_STD
    from moelab.engine.core.router_init import to_softmax_router

    out = {}
    for i, m in modules.items():
        if m.n_routed == 0:
            out[i] = m
            continue
        with torch.no_grad():
            std = float((calib.mlp_inputs[i][:2048] @ m.router.scorer.centroid(m).float().T).std(dim=-1).mean())
        out[i] = to_softmax_router(m, EW_INIT_LOGIT_STD / std if std > 0 else 1.0)
    return out


def _geomean(xs: list[float]) -> float:
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs)))


def _ffn_cost(modules: dict[int, Any], dense_macs: int, n_layers: int, d_macs: int) -> float:
    """Cost of a set of swapped-in layers (layers not replaced stay dense)."""
    return (sum(m.active_param_count() for m in modules.values()) + (n_layers - len(modules)) * d_macs) / dense_macs


def score(results_by_domain: dict[str, dict[str, dict[str, Any]]], name: str, dense: dict[str, float]) -> dict[str, Any]:
    ratios = {dom: res[name]["perplexity"] / dense[dom] for dom, res in results_by_domain.items()}
    entry: dict[str, Any] = {"ratio_geomean": _geomean(list(ratios.values())), "ratio_by_domain": ratios,
                             "perplexity_by_domain": {dom: res[name]["perplexity"] for dom, res in results_by_domain.items()}}
    mc = next((res[name].get("multiple_choice") for res in results_by_domain.values() if res[name].get("multiple_choice")), None)
    if mc:
        entry["multiple_choice"] = mc
    return entry


def svg_plot(points: dict[str, list[tuple[float, float]]], path: Path, title: str) -> None:
    """A dependency-free line plot of ratio (log scale) against cost, one series per name."""
    W, H, L, R, T, B = 720, 420, 60, 180, 30, 45
    xs = [x for pts in points.values() for x, _ in pts]
    ys = [y for pts in points.values() for _, y in pts]
    x0, x1 = min(xs) - 0.02, max(xs) + 0.02
    y0, y1 = math.log(max(min(ys), 1e-3)), math.log(max(ys) * 1.05)
    sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
    sy = lambda y: T + (1 - (math.log(y) - y0) / (y1 - y0 or 1)) * (H - T - B)  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>', f'<text x="{L}" y="18" font-size="13">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 8}" text-anchor="middle">ffn_flops_fraction (FFN multiply-adds per token / dense)</text>',
           f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" text-anchor="middle">perplexity / dense (log)</text>']
    for t in [x / 20 for x in range(int(x0 * 20) + 1, int(x1 * 20) + 1)]:
        out.append(f'<text x="{sx(t):.1f}" y="{H - B + 14}" text-anchor="middle">{t:.2f}</text>')
    for t in (1, 1.2, 1.5, 2, 3, 5, 10, 20, 50, 100):
        if y0 <= math.log(t) <= y1:
            out.append(f'<line x1="{L}" x2="{W - R}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#ddd"/>'
                       f'<text x="{L - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}×</text>')
    for i, (name, pts) in enumerate(points.items()):
        c = colors[i % len(colors)]
        pts = sorted(pts)
        out.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
            c, " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)))
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>' for x, y in pts]
        out.append(f'<text x="{W - R + 10}" y="{T + 14 * i + 10}" fill="{c}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def _previous(out: Path, report: dict[str, Any]) -> dict[str, Any]:
    """The results in ``out`` when they were measured on the same profile, model and held-out text
    (dense perplexity is deterministic, so their ratios stay comparable); else nothing."""
    if not out.is_file():
        return {}
    old = json.loads(out.read_text())
    same = all(old.get(key) == report[key] for key in ("model", "profile", "calibration", "fit_tokens", "heldout"))
    if not same:
        print(f"--resume: {out} was measured on another profile or held-out text; starting afresh", flush=True)
    return old if same else {}


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)


def _speed_words(row: dict[str, Any]) -> str:
    """' · speed 1.24/1.41/1.31×' (decode b1 / decode b8 / prefill over dense, measured), then ' · llama.cpp f16
    1.39/1.11×' (decode b1 / prefill) per GGUF type timed, or '' when not timed."""
    sp = row.get("speed")
    words = " · speed " + "/".join(f"{sp[p]:.2f}" for p in PHASES) + "×" if sp else ""
    for t, lc in (row.get("llamacpp") or {}).items():  # decode b1 / prefill in llama.cpp over dense at the same type
        words += f" · llama.cpp {t} {lc['decode_b1']:.2f}/{lc['prefill']:.2f}×"
    return words


def tables(report: dict[str, Any], out: Path) -> None:
    """The markdown table and the SVG plot of ``report`` next to ``out``."""
    names = sorted({n for lv in report["levels"].values() for n in lv})
    lines = ["| cost ≤ | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for level, rows in sorted(report["levels"].items(), key=lambda kv: -float(kv[0])):
        cells = [("-" if n not in rows else (f"{rows[n]['ratio_in']:.2f}× / {rows[n]['ratio_out']:.2f}× ({rows[n]['ffn_flops_fraction']:.3f})"
                  if "ratio_out" in rows[n] else f"{rows[n]['ratio_geomean']:.2f}× ({rows[n]['ffn_flops_fraction']:.3f})")
                  + _speed_words(rows[n])) for n in names]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    if report.get("protocol") == "leave-domain-out":
        lines.insert(0, "Each cell: in-domain / out-of-domain perplexity ratio to dense (geomean over the folds), mean cost.\n")
    lines.insert(0, "Speed: the whole model over dense, decode batch 1 / decode batch 8 / prefill of 512, measured in one "
                    "process (evaluation.speed; geomean over the folds); llama.cpp TYPE: decode batch 1 / prefill of the "
                    "variant's GGUF over the dense GGUF of the same type (--llamacpp).\n")
    for name, r in report.get("own_cost", {}).items():
        lines.append(f"\n{name} (own cost {r['ffn_flops_fraction']:.3f}): {r['ratio_geomean']:.2f}× dense")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    points = {n: [(rows[n]["ffn_flops_fraction"], rows[n]["ratio_geomean"]) for rows in report["levels"].values() if n in rows]
              for n in names}
    held = next(iter(report["heldout"].values()))
    kind = "each left out of calibration in turn" if report.get("protocol") == "leave-domain-out" else "training-free"
    svg_plot(points, out.with_suffix(".svg"), f"{report['model']}: held-out {', '.join(DOMAINS)} "
             f"({held['windows']}×{held['seq_len']} tokens each), {kind}")


def measure_levels(adapter: Any, profile: Any, windows: dict[str, torch.Tensor], items: Any, args: Any,
                   levels: dict[str, dict[str, Any]], fit_for: Any, dense_ppl: dict[str, float], save: Any,
                   data_dir: Path) -> None:
    """Every configuration at every level of ``args.levels`` built from ``profile`` and scored on
    ``windows``; ``levels`` (level -> name -> row) is filled in place, ``save`` called after each level."""
    d = adapter.d_model
    d_macs = 3 * d * adapter.d_ffn
    dense_macs = d_macs * adapter.n_layers
    for level in args.levels:
        done = levels.setdefault(str(level), {})
        variants: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        wanted = lambda name: name not in done and (args.only is None or name in args.only)  # noqa: E731
        for name, params in configurations(level, d, profile, args.candidates).items():
            if not (wanted(name) or (name.startswith("portable") and wanted(f"{name}@start"))):
                continue
            t0 = time.perf_counter()
            method = expertweaver if params.method == "expertweaver" else cmoe
            _, _, modules, fit = partition_modules(adapter, profile, params, method.plan_for(profile, params),
                                                   method.layer_builder(profile, params), data_dir=data_dir, calib=fit_for(params.fit_tokens))
            extra = {"leading": fit["leading"]} if "leading" in fit else {}
            if wanted(name):
                variants[name] = modules
                meta[name] = {"params": params.to_dict(), "ffn_flops_fraction": _ffn_cost(modules, dense_macs, adapter.n_layers, d_macs),
                              "convert_s": time.perf_counter() - t0, **extra}
            if name.startswith("portable") and wanted(f"{name}@start"):  # the exportable layout recovery starts from
                start = start_modules(modules, fit_for(params.fit_tokens))
                variants[f"{name}@start"] = start
                meta[f"{name}@start"] = {"params": params.to_dict(), **extra,
                                         "ffn_flops_fraction": _ffn_cost(start, dense_macs, adapter.n_layers, d_macs)}
        if wanted("abstopk"):
            k = max(1, int(math.floor((level - 1 / 3) * 1.5 * adapter.d_ffn)))
            variants["abstopk"] = abstopk_modules(adapter, k / adapter.d_ffn)
            meta["abstopk"] = {"ffn_flops_fraction": _ffn_cost(variants["abstopk"], dense_macs, adapter.n_layers, d_macs)}
        for name, allocation in (("teal", "greedy"), ("teal-uniform", "uniform")):  # input thresholds, attention dense
            if wanted(name):
                from moelab.engine.core.teal import teal_modules

                variants[name] = teal_modules(adapter, fit_for(ExpertWeaverParams().fit_tokens), level, allocation)
                meta[name] = {"ffn_flops_fraction": _ffn_cost(variants[name], dense_macs, adapter.n_layers, d_macs)}
        if variants:
            by_domain = {dom: evaluate_variants(adapter, variants, w, reconstruction=False)
                         for dom, w in windows.items()}
            timed = time_variants(adapter, variants, windows, args.speed_repeats) if args.speed_repeats else {}
            if args.llamacpp:  # last: building a model to export hands the variant's modules to it
                gguf = time_llamacpp(args.model if args.protocol == "leave-domain-out" else profile.manifest["model"]["source"],
                                     {n: v for n, v in variants.items() if n.endswith("@start")}, args.llamacpp,
                                     torch.get_num_threads(), max(args.speed_repeats, 1), data_dir)
                timed = {n: {**timed.get(n, {}), **gguf.get(n, {})} for n in variants}
            done.update({name: {**meta[name], **score(by_domain, name, dense_ppl), **timed.get(name, {})} for name in variants})
        save()  # after every level: a long run that is stopped keeps what it measured
        print(f"level {level}: " + ", ".join(f"{n} {r['ratio_geomean']:.2f}x@{r['ffn_flops_fraction']:.3f}"
                                              for n, r in levels[str(level)].items()), flush=True)
        del variants


def time_variants(adapter: Any, variants: dict[str, dict[int, Any]], windows: dict[str, torch.Tensor],
                  repeats: int) -> dict[str, dict[str, Any]]:
    """Each variant's whole-model speed over dense per phase (``evaluation.speed``: decode batch 1 and 8, prefill of
    512; every variant and dense in the same rounds, its MLPs swapped into the dense model for its own rounds), on
    the held-out text: ``{name: {"speed": {phase: speed-up}, "speed_ms": {phase: ms}}}``."""
    tokens = torch.cat([w.reshape(-1) for w in windows.values()])
    models = {"dense": adapter.model, **{name: adapter.model for name in variants}}
    setups = {name: (lambda mods=mods: swapped_mlps(adapter, mods)) for name, mods in variants.items()}
    measured = time_phases(models, tokens, protocol=SpeedProtocol(repeats=repeats), setups=setups)
    return {name: {"speed": {p: round(e["speedup"][name], 3) for p, e in measured["phases"].items()},
                   "speed_ms": {p: round(1e3 * e["seconds"][name], 2) for p, e in measured["phases"].items()},
                   "dense_ms": {p: round(1e3 * e["seconds"]["dense"], 2) for p, e in measured["phases"].items()}}
            for name in variants}


def time_llamacpp(model: str, variants: dict[str, dict[int, Any]], types: list[str], threads: int, repeats: int,
                  data_dir: Path) -> dict[str, dict[str, Any]]:
    """Each variant that exports to GGUF (``gguf_layout`` accepts its layers: ``portable@start``, the layout EW Eq. 11
    recovery starts from) written at every type of ``types`` and timed in llama.cpp against the dense model written by
    the same converter at the same type (``bench_llamacpp.time_files``: decode at batch 1 after a 16-token prompt,
    prefill of 512, fresh processes, interleaved, best of ``repeats``; and ``paired``: with the dense file in one process,
    steps alternating, ``bench_llamacpp.measure_pair``). llama-cpp-python runs one sequence, so llama.cpp
    has no batch-8 decode here. Variants that do not export are left out, with the refusal:
    ``{name: {"llamacpp": {type: {phase: speed-up}}}`` or ``{name: {"llamacpp_refusal": why}}``."""
    from moelab.engine.runtime.export import build_moe_model, export_model
    from moelab.engine.runtime.gguf_export import export_gguf_file
    from moelab.engine.runtime.gguf_layout import GgufExportError
    from tests.benchmarks.bench_llamacpp import time_files, time_pairs

    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="frontier-gguf-") as tmp:
        files: dict[tuple[str, str], Path] = {}
        for name, modules in variants.items():
            fresh = load_model(model, data_dir=data_dir, dtype="float32")  # build_moe_model takes the model over
            src = export_model(build_moe_model(fresh, modules), Path(tmp) / name, tokenizer=fresh.tokenizer,
                               conversion={"variant": name})
            try:
                for t in types:
                    files[(name, t)] = Path(export_gguf_file(src, Path(tmp) / "gguf", t, data_dir)["file"])
            except GgufExportError as exc:
                out[name] = {"llamacpp_refusal": str(exc)}
        if not files:
            return out
        for t in types:
            files[("dense", t)] = Path(export_gguf_file(model, Path(tmp) / "gguf", t, data_dir)["file"])
        timed = time_files(files, threads, repeats)
        paired = time_pairs(files, threads)
    for (name, t), row in timed.items():
        if name != "dense":
            dense = timed[("dense", t)]
            out.setdefault(name, {"llamacpp": {}})["llamacpp"][t] = {
                "decode_b1": round(row["decode_tok_s"] / dense["decode_tok_s"], 3),
                "prefill": round(row["prefill_tok_s"] / dense["prefill_tok_s"], 3),
                "paired": {"decode_b1": round(paired[(name, t)]["paired_decode_vs_dense"], 3),
                           "prefill": round(paired[(name, t)]["paired_prefill_vs_dense"], 3)},
                "tok_s": {k: round(v, 1) for k, v in row.items()}, "dense_tok_s": {k: round(v, 1) for k, v in dense.items()}}
    return out


def _speed_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed per phase over folds: the geometric mean of each fold's measured speed-up (absent if a fold has none)."""
    if not all(r.get("speed") for r in rows):
        return {}
    return {"speed": {p: round(_geomean([r["speed"][p] for r in rows]), 3) for p in rows[0]["speed"]}}


def fit_inputs_for(adapter: Any, profile: Any, data_dir: Path) -> Any:
    """``fit_for(n_tokens)``: the calibration inputs of ``n_tokens`` fit tokens of ``profile``, collected once
    per count (the same a conversion collects, the dense hidden activations with them: each variant is fitted
    as ``moelab convert`` fits it, bit for bit)."""
    @functools.cache
    def fit_for(n_tokens: int) -> Any:
        return collect_inputs(adapter, profile_token_windows(adapter, profile, n_tokens, data_dir), keep_hidden=True)

    return fit_for


def fold_calibration(domain: str) -> str:
    """The calibration set of ``domain``'s fold: equal parts of ``builtin:mixed`` without it."""
    return "builtin:" + "+".join(p for p in MIXED_PARTS if p not in LEAVE_OUT[domain])


def fold_summary(folds: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per level and variant, over the folds: ``ratio_out`` the geomean of each fold's ratio on its left-out
    domain, ``ratio_in`` the geomean of each fold's geomean over the domains it calibrated on; cost the
    mean over folds (each fold sizes its configurations from its own profile)."""
    out: dict[str, dict[str, Any]] = {}
    levels = {lv for f in folds.values() for lv in f["levels"]}
    for level in levels:
        rows = {dom: f["levels"].get(level, {}) for dom, f in folds.items()}
        names = set.intersection(*(set(r) for r in rows.values()))
        for name in sorted(names):
            by = {dom: r[name]["ratio_by_domain"] for dom, r in rows.items()}
            ins = {dom: _geomean([v for o, v in by[dom].items() if LEAVE_OUT[o][0] not in LEAVE_OUT[dom]]) for dom in by}
            outs = {dom: by[dom][dom] for dom in by}
            costs = [r[name]["ffn_flops_fraction"] for r in rows.values()]
            out.setdefault(level, {})[name] = {
                "ffn_flops_fraction": sum(costs) / len(costs), "ffn_flops_fraction_range": [min(costs), max(costs)],
                "ratio_out": _geomean(list(outs.values())), "ratio_in": _geomean(list(ins.values())),
                "ratio_geomean": _geomean(list(outs.values())), "ratio_out_by_domain": outs, "ratio_in_by_fold": ins,
                **_speed_summary([r[name] for r in rows.values()])}
    return out


def fold_profile_dir(work: Path, domain: str) -> Path:
    """Where the fold leaving ``domain`` out keeps its profile (shared by the benchmarks that reuse it)."""
    return work / f"profile-without-{domain.split(':', 1)[1]}"


def profile_at(pdir: Path, model: str, calibration: str, samples: int, data_dir: Path) -> Any:
    """The profile stored at ``pdir``, made there first (``samples`` samples of ``calibration``) when missing."""
    from moelab.engine.profiling.profiler import ProfileSettings
    from moelab.engine.runs import run_profile

    if not (pdir / "manifest.json").is_file():
        run_profile(model, calibration, pdir, ProfileSettings(), samples=samples, data_dir=data_dir)
    return StoredProfile.open(pdir)


def leave_domain_out(adapter: Any, windows: dict[str, torch.Tensor], items: Any, args: Any, dense_ppl: dict[str, float],
                     report: dict[str, Any], data_dir: Path) -> None:
    """The leave-domain-out protocol: for each domain of ``DOMAINS`` a profile of ``args.samples`` samples of
    ``fold_calibration(domain)`` (kept under ``args.work``), every configuration built from it and scored on
    every domain; ``report["folds"]`` keeps each fold, ``report["levels"]`` the in/out summary."""
    for dom in args.folds or DOMAINS:
        spec = fold_calibration(dom)
        pdir = fold_profile_dir(args.work, dom)
        profile = profile_at(pdir, report["model"], spec, args.samples, data_dir)
        fold = report["folds"].setdefault(dom, {"calibration": spec, "profile": str(pdir), "levels": {}})
        fit_for = fit_inputs_for(adapter, profile, data_dir)
        print(f"fold {dom}: calibrated on {spec}", flush=True)
        measure_levels(adapter, profile, windows, items, args, fold["levels"], fit_for, dense_ppl,
                       save=lambda: write(report, args.out), data_dir=data_dir)
        report["levels"] = fold_summary(report["folds"]) if len(report["folds"]) == len(DOMAINS) else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=ROOT / "runs" / "p1")
    ap.add_argument("--levels", type=float, nargs="+", default=[0.75, 0.5, 0.6, 0.85])
    ap.add_argument("--windows", type=int, default=3, help="held-out windows per domain")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--no-dense2moe", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_frontier.json")
    ap.add_argument("--candidates", action="store_true", help="also measure variants of --recipe best")
    ap.add_argument("--resume", action="store_true",
                    help="keep the (level, variant) results already in --out when its profile and held-out text match")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="measure only these variants (with --resume, every row already in --out is kept, these "
                         "variants' too: remove their rows from --out to measure them again)")
    ap.add_argument("--protocol", choices=("in-domain", "leave-domain-out"), default="in-domain",
                    help="in-domain: calibrated on --profile, scored on every domain; leave-domain-out: each domain "
                         "scored by conversions calibrated without it (a profile per fold, under --work)")
    ap.add_argument("--model", default="default", help="leave-domain-out: the model profiled for each fold")
    ap.add_argument("--samples", type=int, default=240, help="leave-domain-out: calibration samples of each fold's profile")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "frontier_ldo", help="leave-domain-out: the folds' profiles")
    ap.add_argument("--speed-repeats", type=int, default=3,
                    help="time every variant's whole model against dense (median of this many interleaved rounds; 0: not)")
    ap.add_argument("--llamacpp", nargs="*", default=[], metavar="TYPE", choices=("f32", "f16", "q8_0"),
                    help="also time the variants that export to GGUF in llama.cpp at these types (e.g. f16 q8_0) against "
                         "the dense model at the same type (decode batch 1, prefill 512)")
    ap.add_argument("--folds", nargs="+", default=None, choices=DOMAINS, metavar="DOMAIN",
                    help="leave-domain-out: only these folds (a variant is summarised over the folds once all four have it)")
    args = ap.parse_args()
    if args.protocol == "leave-domain-out" and args.out == RESULTS / "bench_frontier.json":
        args.out = RESULTS / "bench_frontier_ldo.json"
    torch.manual_seed(0)
    t_start = time.perf_counter()
    data_dir = get_settings().data_dir
    ldo = args.protocol == "leave-domain-out"
    profile = None if ldo else StoredProfile.open(args.profile)
    model = args.model if ldo else profile.manifest["model"]["source"]
    adapter = load_model(model, data_dir=data_dir, dtype="float32")
    windows = {dom: heldout_windows(adapter.tokenizer, data_dir, seq_len=args.seq_len, n_windows=args.windows, source=dom)
               for dom in DOMAINS}
    items = None  # downstream accuracy: bench_tasks.py (lm-evaluation-harness)
    if ldo:
        report: dict[str, Any] = {"model": model, "protocol": "leave-domain-out", "samples": args.samples,
                                  "folds_left_out": {dom: list(parts) for dom, parts in LEAVE_OUT.items()},
                                  "heldout": {dom: {"windows": int(len(w)), "seq_len": args.seq_len} for dom, w in windows.items()},
                                  "cost": "ffn_flops_fraction: FFN multiply-adds per token, router and scoring included, over the dense FFN's"}
        old = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else {}
        same = all(old.get(k) == report[k] for k in ("model", "samples", "folds_left_out", "heldout"))
        report["folds"] = old.get("folds", {}) if same else {}
        report["dense"] = {dom: evaluate_variants(adapter, {"dense": None}, w)["dense"] for dom, w in windows.items()}
        leave_domain_out(adapter, windows, items, args, {d: r["perplexity"] for d, r in report["dense"].items()}, report, data_dir)
        report["seconds"] = time.perf_counter() - t_start
        write(report, args.out)
        if report["levels"]:  # summarised once every fold is in
            tables(report, args.out)
        print("bench_frontier (leave-domain-out): ppl/dense in / out of domain at ffn_flops_fraction ≤ " + "; ".join(
            f"{lv}: " + ", ".join(f"{n} {r['ratio_in']:.2f}x/{r['ratio_out']:.2f}x" for n, r in sorted(rows.items()))
            for lv, rows in report["levels"].items()) + f" ({report['seconds']:.0f}s)")
        return
    fit_for = fit_inputs_for(adapter, profile, data_dir)
    fit_inputs = fit_for(ExpertWeaverParams().fit_tokens)
    report = {
        "model": model, "profile": str(args.profile),
        "calibration": profile.manifest["calibration"], "fit_tokens": fit_inputs.n_tokens,
        "heldout": {dom: {"windows": int(len(w)), "seq_len": args.seq_len} for dom, w in windows.items()},
        "cost": "ffn_flops_fraction: FFN multiply-adds per token, router and scoring included, over the dense FFN's",
        "levels": {}, "own_cost": {},
    }
    previous = _previous(args.out, report) if args.resume else {}
    dense_by_domain = {dom: evaluate_variants(adapter, {"dense": None}, w)["dense"]
                       for dom, w in windows.items()}
    dense_ppl = {dom: r["perplexity"] for dom, r in dense_by_domain.items()}
    report["dense"] = dense_by_domain
    report["levels"] = previous.get("levels", {})
    report["own_cost"] = previous.get("own_cost", {})
    measure_levels(adapter, profile, windows, items, args, report["levels"], fit_for, dense_ppl,
                   save=lambda: write(report, args.out), data_dir=data_dir)
    if not args.no_dense2moe and "dense2moe" not in report["own_cost"]:
        with tempfile.TemporaryDirectory() as tmp:
            params = get_method("dense2moe").recipe("paper")
            record = run_conversion(args.profile, params, Path(tmp) / "d2", data_dir=data_dir)
            moe = load_exported(Path(tmp) / "d2")
            by_domain = {dom: evaluate_models({"dense2moe": moe}, adapter.tokenizer, w) for dom, w in windows.items()}
            timed = {}
            if args.speed_repeats:
                tokens = torch.cat([w.reshape(-1) for w in windows.values()])
                m = time_phases({"dense": adapter.model, "dense2moe": moe}, tokens, protocol=SpeedProtocol(repeats=args.speed_repeats))
                timed = {"speed": {p: round(e["speedup"]["dense2moe"], 3) for p, e in m["phases"].items()}}
            report["own_cost"]["dense2moe"] = {"params": params.to_dict(), "ffn_flops_fraction": record["summary"]["ffn_flops_fraction"],
                                               "removed_layers": record["summary"].get("removed_layers"), **score(by_domain, "dense2moe", dense_ppl),
                                               **timed}
    report["seconds"] = time.perf_counter() - t_start
    write(report, args.out)

    tables(report, args.out)

    def ratio(lv: str, name: str) -> float:
        return report["levels"][lv].get(name, {}).get("ratio_geomean", float("nan"))

    print("bench_frontier: ppl/dense (geomean of domains) at ffn_flops_fraction ≤ "
          + ", ".join(f"{lv}: best {ratio(lv, 'best'):.2f}x, portable {ratio(lv, 'portable'):.2f}x "
                      f"(exportable start {ratio(lv, 'portable@start'):.2f}x) vs EW paper {ratio(lv, 'ew-paper'):.2f}x"
                      for lv in report["levels"])
          + f" ({report['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
