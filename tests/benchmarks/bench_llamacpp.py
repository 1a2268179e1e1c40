"""llama.cpp speed and quality of the portable conversions against the dense model, as GGUF.

    python tests/benchmarks/bench_llamacpp.py [--work runs/bench_llamacpp] [--costs 0.75 0.5]
        [--types f16 q8_0] [--steps 90] [--profile DIR] [--threads 2] [--windows 8] [--eval-windows 16]
        [--experts 0 64 8] [--out FILE]

What people run on laptops and CPU servers is llama.cpp (and Ollama on top of it), where decoding
is memory-bound: an MoE pays there if a decode step reads fewer bytes. For each cost, the default
model is converted with ``--recipe portable`` (profiled once on ``builtin:mixed``, or ``--profile``),
recovered with ``moelab finetune --mode expertweaver`` for ``--steps`` steps (EW Eq. 11: the
layout that exports), and written as GGUF by ``moelab export --format gguf`` at every ``--type``;
the dense model is written by the same converter at the same type. Each file is then measured in
llama.cpp (llama-cpp-python, ``--threads`` threads, f16 KV cache), each measurement in a fresh
process, the files interleaved and the best of ``--repeat`` rounds kept so that the ratios compare
like with like on a shared machine:

* prefill tokens/s: one 512-token batch;
* decode tokens/s: 128 tokens one at a time after a 16-token prompt;
* paired (``paired_*_vs_dense``): the same two phases with the dense file and the converted one loaded in one
  process, their steps alternating, three rounds: the ratio a noisy shared machine spoils least (``measure_pair``);
* perplexity on ``--windows`` × 256 held-out tokens of ``builtin:mixed`` (never seen in calibration
  or recovery), under llama.cpp.

``--experts`` converts each cost at several expert counts (0: the recipe's own, 12), for the question of
expert granularity: llama.cpp runs one small matmul per selected expert and per projection, and sums the
selected experts' outputs one add at a time, so many small experts pay per expert what few large ones do not.

Writes tests/benchmarks/results/bench_llamacpp.json (``--out``) and prints one summary line (decode and
prefill ratios converted / dense at each cost and type, and the perplexity ratios).
Bound for this model: the FFN is about 59% of the bytes a decode step reads, so at cost 0.5 decode
can be at most about 1 / (1 - 0.59 · 0.5) ≈ 1.42× dense. A step is more than its bytes, so the benchmark also
measures the bound in llama.cpp itself (``ffn_bound``, ``--no-bound`` skips it): the dense model with every FFN
cut to 64 neurons (``ffn_stub``), timed paired against dense at every type, gives the FFN's share of a step
and the speed-up over dense a conversion of each cost could reach at most.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "tests" / "benchmarks" / "results" / "bench_llamacpp.json"
PREFILL, DECODE, PROMPT, SEQ = 512, 128, 16, 256


def _timing_llama(path: str, threads: int) -> Any:
    """``path`` loaded as every timing here loads it: room for a prefill and a decode after a prompt."""
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=PREFILL + DECODE + PROMPT, n_batch=PREFILL, n_threads=threads,
                 n_threads_batch=threads, verbose=False)


def _timing_tokens(n: int = PREFILL) -> list[int]:
    """``n`` seeded token ids (every file reads the same), the prefill's first."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(0).integers(100, 20000, n)]


def measure(path: str, what: str, threads: int, windows_file: str | None = None) -> dict[str, float]:
    """One measurement of ``path`` in this process (called in a fresh subprocess)."""
    import numpy as np
    from llama_cpp import Llama

    if what == "perplexity":
        windows = json.loads(Path(windows_file).read_text())
        llm = Llama(model_path=path, n_ctx=SEQ, n_batch=SEQ, n_threads=threads, logits_all=True, verbose=False)
        nll, n = 0.0, 0
        for w in windows:
            llm.reset()
            llm.eval(w)
            logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
            logits -= logits.max(axis=1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            nll -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
            n += len(w) - 1
        llm.close()
        return {"perplexity": math.exp(nll / n), "tokens": n}
    llm = _timing_llama(path, threads)
    tokens = _timing_tokens()
    llm.eval(tokens[:8])  # warm the weights into memory and the graph allocator
    llm.reset()
    if what == "prefill":
        t0 = time.perf_counter()
        llm.eval(tokens)
        out = {"prefill_tok_s": PREFILL / (time.perf_counter() - t0)}
    else:
        llm.eval(tokens[:PROMPT])
        t0 = time.perf_counter()
        for i in range(DECODE):
            llm.eval([tokens[PROMPT + i]])
        out = {"decode_tok_s": DECODE / (time.perf_counter() - t0)}
    llm.close()
    return out


def measure_pair(dense: str, path: str, threads: int, rounds: int = 3) -> dict[str, float]:
    """Dense and converted in one process, their steps alternating (the order swapped every step): each phase's speed
    over dense is dense's seconds over the converted model's, summed over the same steps, so the drift of a shared
    machine (its other tenants, its clocks) hits both alike within milliseconds, not within a process's lifetime."""
    llms = [_timing_llama(p, threads) for p in (dense, path)]
    tokens = _timing_tokens(PREFILL + DECODE)
    for llm in llms:
        llm.eval(tokens[:8])  # warm the weights into memory and the graph allocator
    prefill, decode = [0.0, 0.0], [0.0, 0.0]
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for j in order:
            llms[j].reset()
            t0 = time.perf_counter()
            llms[j].eval(tokens[:PREFILL])
            prefill[j] += time.perf_counter() - t0
        for j in order:
            llms[j].reset()
            llms[j].eval(tokens[:PROMPT])
        for i in range(DECODE):
            for j in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                llms[j].eval([tokens[PREFILL + i]])
                decode[j] += time.perf_counter() - t0
    for llm in llms:
        llm.close()
    return {"paired_decode_vs_dense": decode[0] / decode[1], "paired_prefill_vs_dense": prefill[0] / prefill[1],
            "paired_rounds": rounds}


def _in_subprocess(path: Path, what: str, threads: int, windows_file: Path | None = None) -> dict[str, float]:
    code = ("import json,sys; sys.path.insert(0, %r); from tests.benchmarks.bench_llamacpp import measure, measure_pair; "
            "a = sys.argv; print(json.dumps(measure_pair(a[4], a[1], int(a[3])) if a[2] == 'paired' else "
            "measure(*a[1:3], int(a[3]), *a[4:])))" % str(ROOT))
    args = [sys.executable, "-c", code, str(path), what, str(threads)] + ([str(windows_file)] if windows_file else [])
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_files(files: dict[Any, Path], threads: int, repeat: int) -> dict[Any, dict[str, float]]:
    """``{key: {"prefill_tok_s", "decode_tok_s"}}`` of every GGUF file, each measurement in a fresh process, the
    files interleaved round by round and the best of ``repeat`` rounds kept: the machine's drift hits every file alike."""
    rows: dict[Any, dict[str, float]] = {key: {} for key in files}
    for _ in range(repeat):
        for key, f in files.items():
            for what in ("prefill", "decode"):
                for k, v in _in_subprocess(f, what, threads).items():
                    rows[key][k] = max(v, rows[key].get(k, 0.0))
    return rows


def time_pairs(files: dict[tuple[str, str], Path], threads: int) -> dict[tuple[str, str], dict[str, float]]:
    """``measure_pair`` of every converted file (keys ``(name, type)``) with the dense file of its type, each pair in a
    fresh process."""
    return {(n, t): _in_subprocess(f, "paired", threads, files[("dense", t)]) for (n, t), f in files.items() if n != "dense"}


#: the FFN width of ``ffn_stub``: one f16 dot-product step and two q8_0 blocks per down row
STUB_FFN = 64


def ffn_stub(work: Path, data_dir: Path) -> Path:
    """The default model with every FFN cut to its first ``STUB_FFN`` neurons, as a Hugging Face directory
    (cached in ``work``): everything of a llama.cpp step but the FFN's weights, with the same graph nodes (each
    layer's FFN still runs its gate, up, activation and down). Timed paired against the dense file, it measures
    the FFN's share of a step in llama.cpp itself, which bounds what any conversion of cost ``c`` can gain there:
    ``1 / (1 - share · (1 - c))``, for an MoE whose FFN weights cost time in proportion to its multiply-adds and
    whose graph costs no more than the dense FFN's (``ffn_bound``)."""
    out = work / f"ffn-stub-{STUB_FFN}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moelab.engine.atomic import atomic_directory
    from moelab.engine.models import cache_default_model

    src = cache_default_model(data_dir)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            for name in ("gate_proj", "up_proj"):
                getattr(mlp, name).weight = torch.nn.Parameter(getattr(mlp, name).weight[:STUB_FFN].clone())
            mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight[:, :STUB_FFN].clone())
    model.config.intermediate_size = STUB_FFN
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    return out


def ffn_bound(paired_stub: dict[str, float], d_ffn: int, costs: list[float]) -> dict[str, Any]:
    """From ``measure_pair(dense, stub)``: per phase, the FFN's share of a dense llama.cpp step (the stub's saving
    scaled to the whole width: the stub keeps ``STUB_FFN`` of ``d_ffn`` neurons) and the speed-up over dense a
    conversion of each cost could reach at most (``ffn_stub``)."""
    out: dict[str, Any] = {"stub_ffn": STUB_FFN, "d_ffn": d_ffn}
    for phase in ("decode", "prefill"):
        ratio = paired_stub[f"paired_{phase}_vs_dense"]  # dense seconds / stub seconds
        share = (1 - 1 / ratio) / (1 - STUB_FFN / d_ffn)
        out[f"{phase}_ffn_share"] = share
        out[f"{phase}_bound"] = {str(c): 1 / (1 - share * (1 - c)) for c in costs}
    return out


def _profile(work: Path, given: Path | None, data_dir: Path) -> Path:
    from moelab.engine.profiling.profiler import ProfileSettings
    from moelab.engine.runs import run_profile

    if given is not None:
        return given
    out = work / "profile"
    if not (out / "manifest.json").is_file():
        run_profile("default", "builtin:mixed", out, ProfileSettings(), samples=240, data_dir=data_dir)
    return out


def _portable(work: Path, profile: Path, cost: float, steps: int, data_dir: Path,
              eval_windows: int = 16, experts: int | None = None) -> tuple[Path, dict[str, Any]]:
    """``--recipe portable`` at ``cost`` (sparsity 1 - cost), recovered for ``steps`` (cached in ``work``);
    ``experts`` overrides the recipe's expert count (EW Eq. 6's ``N_e``: coarser experts for fewer,
    larger matmuls in llama.cpp)."""
    from moelab.engine.methods import get_method
    from moelab.engine.runs import run_conversion
    from moelab.engine.training.finetune import FinetuneParams, run_finetune

    given: dict[str, Any] = {"sparsity": round(1 - cost, 6)} | ({"n_experts": experts} if experts else {})
    conv = work / (f"portable-{cost}" + (f"-e{experts}" if experts else ""))
    if not (conv / "conversion.json").is_file():
        run_conversion(profile, get_method("expertweaver").recipe("portable", **given), conv, data_dir=data_dir)
    record = json.loads((conv / "conversion.json").read_text())
    ft = conv.with_name(f"{conv.name}-ft{steps}")
    if not (ft / "model" / "conversion.json").is_file():
        run_finetune(conv, FinetuneParams(mode="expertweaver", steps=steps, eval_windows=eval_windows), ft, data_dir=data_dir)
    summary = json.loads((ft / "model" / "conversion.json").read_text()).get("finetune", {})
    return ft / "model", {"ffn_flops_fraction": record["summary"]["ffn_flops_fraction"], "steps": steps,
                          "n_experts": json.loads((conv / "conversion.json").read_text())["params"].get("n_experts"),
                          "perplexity_before": summary.get("perplexity_before"),
                          "perplexity_after": summary.get("perplexity_after"),
                          "dense_perplexity": summary.get("dense_perplexity")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_llamacpp")
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--costs", type=float, nargs="+", default=[0.75, 0.5])
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0"])
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--experts", type=int, nargs="+", default=[0],
                    help="expert counts N_e to compare (0: the recipe's own); each cost is converted at each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--eval-windows", type=int, default=16, help="held-out windows of the recovery's own perplexities")
    ap.add_argument("--out", type=Path, default=RESULT, help="the JSON result (a probe need not replace the recorded one)")
    ap.add_argument("--no-bound", action="store_true",
                    help="skip the FFN-stub model that measures the FFN's share of a llama.cpp step (ffn_stub)")
    args = ap.parse_args()

    from moelab.settings import get_settings
    from transformers import AutoTokenizer

    from moelab.engine.evaluation.metrics import heldout_windows
    from moelab.engine.models import cache_default_model
    from moelab.engine.runtime.gguf_export import export_gguf

    data_dir = get_settings().data_dir
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    profile = _profile(work, args.profile, data_dir)
    models: dict[str, Path] = {"dense": Path("default")}
    info: dict[str, Any] = {}
    for cost in args.costs:
        for e in args.experts:
            name = f"portable-{cost}" + (f"-e{e}" if e else "")
            models[name], info[name] = _portable(work, profile, cost, args.steps, data_dir, args.eval_windows, e or None)
    files: dict[tuple[str, str], Path] = {}
    for name, src in models.items():
        for t in args.types:
            out = work / "gguf" / f"{name}-{t}"
            found = sorted(out.glob("*.gguf"))
            if not found:
                found = [Path(export_gguf(str(src), out, t, data_dir)["file"])]
            files[(name, t)] = found[0]
    tok = AutoTokenizer.from_pretrained(cache_default_model(data_dir))
    windows_file = work / "heldout_windows.json"
    windows_file.write_text(json.dumps(heldout_windows(tok, data_dir, seq_len=SEQ, n_windows=args.windows).tolist()))

    bounds: dict[str, Any] = {}
    if not args.no_bound:  # the FFN's share of a llama.cpp step, from the same converter at every type
        stub = ffn_stub(work, data_dir)
        d_ffn = json.loads((cache_default_model(data_dir) / "config.json").read_text())["intermediate_size"]
        for t in args.types:
            out = work / "gguf" / f"ffn-stub-{t}"
            found = sorted(out.glob("*.gguf")) or [Path(export_gguf(str(stub), out, t, data_dir)["file"])]
            bounds[t] = ffn_bound(_in_subprocess(found[0], "paired", args.threads, files[("dense", t)]), d_ffn, args.costs)
    timed = time_files(files, args.threads, args.repeat)
    rows: dict[str, dict[str, Any]] = {f"{n}/{t}": {"bytes": f.stat().st_size, **timed[(n, t)]} for (n, t), f in files.items()}
    for (n, t), paired in time_pairs(files, args.threads).items():
        rows[f"{n}/{t}"].update(paired)
    for (n, t), f in files.items():
        rows[f"{n}/{t}"].update(_in_subprocess(f, "perplexity", args.threads, windows_file))
    for (n, t) in files:
        r, d = rows[f"{n}/{t}"], rows[f"dense/{t}"]
        r["decode_vs_dense"] = r["decode_tok_s"] / d["decode_tok_s"]
        r["prefill_vs_dense"] = r["prefill_tok_s"] / d["prefill_tok_s"]
        r["perplexity_vs_dense"] = r["perplexity"] / d["perplexity"]
        r["bytes_vs_dense"] = r["bytes"] / d["bytes"]
    result = {"threads": args.threads, "prefill_tokens": PREFILL, "decode_tokens": DECODE,
              "heldout": {"source": "builtin:mixed", "windows": args.windows, "seq_len": SEQ},
              "conversions": info, "rows": rows, "ffn_bound": bounds, "seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    parts = [f"{n}/{t}: decode {r['decode_vs_dense']:.2f}x (paired {r['paired_decode_vs_dense']:.2f}x) prefill "
             f"{r['prefill_vs_dense']:.2f}x (paired {r['paired_prefill_vs_dense']:.2f}x) ppl {r['perplexity_vs_dense']:.2f}x"
             for n in models if n != "dense" for t in args.types for r in [rows[f"{n}/{t}"]]]
    parts += [f"bound {t}: FFN {b['decode_ffn_share']:.0%} of a decode step, at most "
              + "/".join(f"{v:.2f}x" for v in b["decode_bound"].values()) + " at cost " + "/".join(b["decode_bound"])
              for t, b in bounds.items()]
    print("bench_llamacpp: " + "; ".join(parts))


if __name__ == "__main__":
    main()
