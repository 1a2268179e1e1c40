"""Recipes in seconds: each conversion of the default model timed whole against dense in one process (decode at batch
1 and 8, prefill; ``evaluation.speed``), next to what the designer predicted for it (``core.speed_prediction``, from
this machine's kernel table) and to its multiply-adds.

    python tests/benchmarks/bench_recipe_speed.py [--samples 64] [--max-tokens 256] [--repeats 3]
        [--variant NAME=RECIPE:SPARSITY[:OPTION=VALUE] ...] [--teal COST ...] [--work DIR] [--unfused]

The profile is the README's shape (``builtin:mixed``, 64 × 256 tokens); each variant is built with ``moelab convert
--recipe R --sparsity S`` as a user does (timed: building costs seconds too), then loaded with ``from_pretrained``. The
kernel table is measured here (the designer's is measured by the profile job the same way). speed-up = dense time /
converted time, interleaved round by round. The dense model in moelab's kernels (``evaluation.kernel_dense``: its own
weights, its MLPs and the projections outside them in moelab's decode calls) is timed in the same rounds, and each conversion's speed over it
(``over_dense_kernels``) is what its sparsity gives beyond the kernels. TEAL (``--teal``, default costs 0.5 and 0.75; ``--teal`` alone: none) is calibrated as an evaluation
calibrates it and timed in the same rounds, with its row-skipping CPU decode kernel. Writes tests/benchmarks/results/bench_recipe_speed.json and prints one
summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_recipe_speed.json"

from moelab.engine.core.fitting import collect_inputs, stored_token_windows  # noqa: E402
from moelab.engine.core.speed_prediction import kernel_dense_layers, predict  # noqa: E402
from moelab.engine.core.teal import teal_flops_fraction, teal_modules  # noqa: E402
from moelab.engine.evaluation.metrics import swapped_mlps  # noqa: E402
from moelab.engine.evaluation.metrics import heldout_windows  # noqa: E402
from moelab.engine.evaluation.speed import SpeedProtocol, time_phases  # noqa: E402
from moelab.engine.evaluation.speed_table import measure_table  # noqa: E402
from moelab.engine.evaluation.kernel_dense import kernel_dense_mlps  # noqa: E402
from moelab.engine.evaluation.kernel_gain import NAME as KERNEL_DENSE, sparsity_gain  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402
from moelab.engine.profiling.store import StoredProfile  # noqa: E402
from moelab.engine.runs import TEAL_FIT_TOKENS  # noqa: E402
from moelab.engine.runtime.export import copy_runtime, load_exported  # noqa: E402

VARIANTS = ("paper-0.5=paper:0.5", "best-0.25=best:0.25", "best-0.5=best:0.5", "portable-0.5=portable:0.5")


def _cli(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "moelab.cli", *args], check=True, env=env, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", action="append", default=None, help="NAME=RECIPE:SPARSITY[:OPTION=VALUE ...] (e.g. whole-0.5=best:0.5:down-keep=1; default: %s)" % ", ".join(VARIANTS))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=OUT, help="the JSON result (a probe need not replace the recorded one)")
    ap.add_argument("--unfused", action="store_true",
                    help="also time each conversion with the whole-block decode call off (moe_ffn_decode: the routed "
                         "kernel and the torch calls around it instead), the same model in the same rounds")
    ap.add_argument("--teal", type=float, nargs="*", default=[0.5, 0.75],
                    help="TEAL at these FFN costs, calibrated on the profile's text as an evaluation does, timed alike "
                         "(the default 0.5 and 0.75; `--teal` with no cost times none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-recipe-speed-"))
    data_dir = Path(os.environ.get("MOELAB_DATA_DIR", ROOT / ".moelab" / "bench-data"))
    env = {**os.environ, "MOELAB_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": str(args.threads)}
    profile = work / "profile"
    if not (profile / "manifest.json").exists():
        _cli("profile", "--model", "default", "--calib", "builtin:mixed", "--samples", str(args.samples), "--max-tokens",
             str(args.max_tokens), "--quiet", "--out", str(profile), env=env)
    built = {}
    for spec in args.variant or VARIANTS:
        name, rest = spec.split("=", 1)
        recipe, sparsity, *options = rest.split(":")  # options: 'down-keep=1' -> --down-keep 1
        flags = [x for o in options for x in (f"--{o.split('=')[0]}", o.split("=", 1)[1])]
        out = work / name
        t0 = time.perf_counter()
        if not (out / "config.json").exists():
            _cli("convert", "--profile", str(profile), "--recipe", recipe, "--sparsity", sparsity, *flags, "--quiet",
                 "--out", str(out), env=env)
        built[name] = {"recipe": recipe, "sparsity": float(sparsity), "options": options, "dir": out,
                       "convert_s": time.perf_counter() - t0}

    adapter = load_model("default", data_dir=data_dir)
    dense = adapter.model.eval()
    windows = heldout_windows(adapter.tokenizer, data_dir, seq_len=128, n_windows=4)
    info = {"source": "default", "d_model": adapter.d_model, "d_ffn": adapter.layers[0].d_ffn, "n_layers": len(adapter.layers)}
    t0 = time.perf_counter()
    table = measure_table(dense, windows, info)
    table_s = time.perf_counter() - t0
    for v in built.values():  # an export bundles the runtime it was built with: time this checkout's kernels
        copy_runtime(v["dir"])
    models = {"dense": dense, **{name: load_exported(v["dir"]).eval() for name, v in built.items()}}
    teal = _teal_variants(adapter, profile, args.teal)
    models.update({name: dense for name in teal})
    setups = {name: (lambda mods=v["modules"]: swapped_mlps(adapter, mods)) for name, v in teal.items()}
    kernel_mlps = kernel_dense_mlps(adapter)  # the dense model in moelab's kernels: what they give without sparsity
    models[KERNEL_DENSE] = dense
    setups[KERNEL_DENSE] = lambda: swapped_mlps(adapter, kernel_mlps)
    unfused = {f"{name}-unfused": name for name in built} if args.unfused else {}
    for name, of in unfused.items():
        models[name] = models[of]
        setups[name] = lambda model=models[of]: _without_fused_decode(model)
    measured = time_phases(models, windows, protocol=SpeedProtocol(repeats=args.repeats), setups=setups)
    rows = [{"variant": name, "recipe": recipe, "sparsity": None, "ffn_flops_fraction": cost, "convert_s": build_s,
             "measured": {p: round(e["speedup"][name], 3) for p, e in measured["phases"].items()},
             "measured_ms": {p: round(1e3 * e["seconds"][name], 2) for p, e in measured["phases"].items()},
             "predicted": {p: round(x["speedup"], 3) for p, x in predict(table, kernel_dense_layers(table)).items()}
             if name == KERNEL_DENSE else {}}
            for name, recipe, cost, build_s in [(KERNEL_DENSE, "dense in moelab's kernels", 1.0, None),
                                                *((n, "teal", v["cost"], v["build_s"]) for n, v in teal.items())]]
    for name, v in [*built.items(), *((u, built[of]) for u, of in unfused.items())]:
        layers = json.loads((v["dir"] / "config.json").read_text())["moe_layers"]
        record = json.loads((v["dir"] / "conversion.json").read_text())
        try:
            # none for an unfused row: the table times the runtime as it runs, with the whole-block call
            predicted = {} if name in unfused else {p: x["speedup"] and round(x["speedup"], 3)
                                                    for p, x in predict(table, layers).items()}
        except ValueError as exc:
            predicted = {"note": str(exc)}
        rows.append({"variant": name, "recipe": v["recipe"], "sparsity": v["sparsity"], "options": v["options"],
                     "ffn_flops_fraction": record["summary"].get("ffn_flops_fraction"),
                     "convert_s": round(v["convert_s"], 1),
                     "measured": {p: round(e["speedup"][name], 3) for p, e in measured["phases"].items()},
                     "measured_ms": {p: round(1e3 * e["seconds"][name], 2) for p, e in measured["phases"].items()},
                     "over_dense_kernels": {p: round(g, 3) for p, g in sparsity_gain(measured, name).items()},
                     "predicted": predicted})
    out = {"machine": table["machine"], "threads": args.threads, "dtype": table["dtype"], "repeats": args.repeats,
           "table_s": round(table_s, 1), "dense_ms": {p: round(1e3 * e["seconds"]["dense"], 2) for p, e in measured["phases"].items()},
           "protocol": measured["protocol"], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    line = "; ".join(f"{r['variant']} (cost {r['ffn_flops_fraction']:.3f}): "
                     + ", ".join(f"{p} {r['measured'][p]:.2f}×" + (f" (pred {r['predicted'][p]:.2f}×)" if p in r["predicted"] else "")
                                 for p in r["measured"])
                     + ("; over dense in moelab's kernels " + ", ".join(f"{g:.2f}×" for g in r["over_dense_kernels"].values())
                        if r.get("over_dense_kernels") else "")
                     for r in rows)
    print(f"bench_recipe_speed: speed over dense, measured (predicted): {line}; table {table_s:.0f} s")


@contextlib.contextmanager
def _without_fused_decode(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s MoE blocks without their whole-block decode call (``MoeFFN._fused_decode`` answers None) for the
    time of the context: what a decode step ran before that call."""
    blocks = [m for m in model.modules() if hasattr(m, "_fused_decode")]
    for block in blocks:
        block._fused_decode = lambda x: None
    try:
        yield
    finally:
        for block in blocks:
            del block._fused_decode


def _teal_variants(adapter, profile: Path, costs: list[float]) -> dict[str, dict]:
    """TEAL (greedy split) at each FFN cost, calibrated as an evaluation calibrates it (the profile's text, 4,096
    tokens): ``{name: {"modules", "cost", "build_s"}}``."""
    if not costs:
        return {}
    stored = StoredProfile.open(profile)
    inputs = collect_inputs(adapter, stored_token_windows(adapter, stored, TEAL_FIT_TOKENS))
    out = {}
    for cost in costs:
        t0 = time.perf_counter()
        modules = teal_modules(adapter, inputs, cost, "greedy")
        dense_macs = sum(3 * adapter.d_model * lay.d_ffn for lay in adapter.layers)
        out[f"teal-{cost:g}"] = {"modules": modules, "cost": round(teal_flops_fraction(modules, dense_macs), 4),
                                 "build_s": round(time.perf_counter() - t0, 1)}
    return out


if __name__ == "__main__":
    main()
