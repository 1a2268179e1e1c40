"""The model card (README.md) written next to every export, moelab or native format.

A converted model leaves the app as a directory; its README.md is what a person who downloads it
reads first. It says, from the conversion record (``conversion.json``) and the evaluation the
conversion directory holds (``evaluation.json``, written by ``moelab evaluate``):

* the method (with its paper) and every parameter of the conversion (and of the fine-tuning);
* the per-layer layout, a compact table (one row per run of identically laid-out layers: kind,
  shared neurons, routed experts × neurons, top-k, router, combine), read from the model's own
  layer specs, so it is what the weights are;
* the cost: ``ffn_flops_fraction`` (FFN multiply-adds per token over the dense model's) and the
  total and per-token active parameter counts;
* the evaluation numbers (perplexity and its ratio to dense, multiple-choice accuracy,
  fine-tuning perplexities) when there are any, and "not evaluated" otherwise;
* how to run it: transformers (``trust_remote_code=True`` for the moelab format, plain for native,
  and vLLM for native), llama.cpp and an Ollama Modelfile for GGUF; and whether the layout exports
  to GGUF at all, with the reason when it does not.

The numbers are copied from the record, never recomputed, so the card agrees with conversion.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..atomic import write_bytes_atomic
from ..evaluation.busy_machine import busy_note
from ..evaluation.harness import headline_metric
from ..evaluation.kernel_gain import LABEL as KERNEL_LABEL, NAME as KERNEL_DENSE
from ..evaluation.speed import phase_label
from .gguf_layout import gguf_refusal

CARD_FILE = "README.md"
EVALUATION_FILE = "evaluation.json"


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def _layer_rows(specs: list[dict]) -> list[str]:
    """One table row per run of consecutive layers with the same layout (``0–29`` for a uniform plan)."""
    rows: list[str] = []
    for i, s in enumerate(specs):
        s = s or {"kind": "dense"}
        kind = s.get("kind", "moe")
        if kind == "moe":
            rows.append(f"| {i} | moe | {s.get('d_shared', 0)} | {s.get('n_routed', s.get('n_experts', 0))} × "
                        f"{s.get('expert_size', 0)} | {s.get('top_k', 0)} | {s.get('router', 'centroid')} | "
                        f"{s.get('combine', 'sum')} |")
        elif kind == "lowrank_moe":
            rows.append(f"| {i} | low-rank MoE (rank {s.get('rank')}) | 0 | {s.get('n_experts')} × {s.get('d_ffn')} | "
                        f"{s.get('top_k')} | softmax | normalized |")
        elif kind == "hierarchical":
            subs = s.get("experts") or [{}]
            rows.append(f"| {i} | hierarchical | {subs[0].get('d_shared', 0)} per expert | {s.get('num_experts')} experts × "
                        f"{subs[0].get('n_routed', 0)} sub-experts | {s.get('experts_per_token')} × {subs[0].get('top_k', 0)} | "
                        f"{subs[0].get('router', '')} | {subs[0].get('combine', '')} |")
        elif kind == "abstopk":
            rows.append(f"| {i} | AbsTopK-GLU | - | - | {s.get('k')} of {s.get('d_ffn')} neurons | - | - |")
        elif kind == "teal":
            rows.append(f"| {i} | TEAL-GLU (input sparsity {s.get('s_in', 0):.3f} / down {s.get('s_mid', 0):.3f}) | - | - "
                        "| - | - | - |")
        else:
            rows.append(f"| {i} | dense | - | - | - | - | - |")
    out = ["| layers | kind | shared | routed × size | top-k | router | combine |", "|---|---|---|---|---|---|---|"]
    start = 0
    for i in range(1, len(rows) + 1):
        rest = rows[start].split(" | ", 1)[1] if rows else ""
        if i < len(rows) and rows[i].split(" | ", 1)[1] == rest:
            continue
        out.append(f"| {start}{'' if i - 1 == start else f'–{i - 1}'} | {rest}")
        start = i
    return out


def _evaluation_lines(evaluation: dict | None, record: dict) -> list[str]:
    lines: list[str] = []
    if evaluation:
        h = evaluation.get("heldout") or {}
        lines.append(f"Held-out text `{h.get('source', '?')}` ({h.get('windows', '?')} windows × {h.get('seq_len', '?')} tokens):")
        lines.append("")
        tasks = evaluation.get("tasks") or {}  # lm-evaluation-harness: each task's first metric (acc, pass@1 …)
        lines += ["| variant | perplexity | × dense |" + "".join(f" {t} |" for t in tasks), "|---|---|---|" + "---|" * len(tasks)]
        for name, r in (evaluation.get("results") or {}).items():
            cells = []
            for by in tasks.values():
                m = by.get(name) or {}
                metric = headline_metric(m)
                cells.append("-" if metric is None else _fmt(m[metric]))
            lines.append(f"| {name} | {_fmt(r.get('perplexity'))} | {_fmt(r.get('perplexity_ratio', 1.0))} |"
                         + "".join(f" {c} |" for c in cells))
        lines.append("")
        speed = evaluation.get("speed")
        if speed:  # seconds beside multiply-adds: the whole model against dense, timed in one process
            others = [n for n in next(iter(speed["phases"].values()))["seconds"] if n != "dense"]  # converted, TEAL
            lines += [f"Speed against the dense model ({speed['runtime']}; {speed['device']}, {speed['dtype']}, "
                      f"{speed['threads']} threads; median of {speed['protocol']['repeats']} interleaved rounds"
                      + ("; TEAL at the conversion's cost, timed the same way" if "teal" in others else "")
                      + (f"; {KERNEL_LABEL}: the dense model's own weights, its MLPs and the projections outside "
                         "them in moelab's decode calls, what the kernels give without sparsity" if KERNEL_DENSE in others else "") + "):", "",
                      "| phase | dense (ms) |" + "".join(f" {label} (ms) | {label} × dense speed |"
                                                  for label in (KERNEL_LABEL if n == KERNEL_DENSE else n for n in others)),
                      "|---|---|" + "---|---|" * len(others)]
            for phase, entry in speed["phases"].items():
                lines.append(f"| {phase_label(phase, entry)} | {1e3 * entry['seconds']['dense']:.1f} |"
                             + "".join(f" {1e3 * entry['seconds'][n]:.1f} | {entry['speedup'][n]:.2f} |" for n in others))
            lines.append("")
            if (busy := busy_note(speed)) is not None:
                lines += [f"Note: {busy}.", ""]
    ft = record.get("finetune")
    if ft:
        lines.append(f"Fine-tuned ({(ft.get('params') or {}).get('mode', '?')}, {ft.get('steps')} steps, {ft.get('tokens')} tokens): "
                     + ", ".join(f"{k} {_fmt(ft.get(k))}" for k in ("perplexity_before", "perplexity_start", "perplexity_after",
                                                                     "dense_perplexity") if ft.get(k) is not None))
        lines.append("")
    if not lines:
        lines = ["Not evaluated yet (`moelab evaluate CONVERSION_DIR` writes evaluation.json; export again to include it).", ""]
    return lines


def render_model_card(record: dict, specs: list[dict], fmt: str = "moelab", evaluation: dict | None = None,
                      gguf: dict | None = None, gguf_why: str | None = None) -> str:
    """Markdown text of the card. ``record``: conversion.json; ``specs``: one layer spec per decoder
    layer (``MoelabConfig.moe_layers``); ``fmt``: ``moelab``, ``native`` or ``gguf``; ``gguf``: what
    ``gguf_export`` wrote (file, type, layout); ``gguf_why``: why this layout does not export to GGUF
    (None when it does)."""
    params = record.get("params") or {}
    summary = record.get("summary") or {}
    model = record.get("model") or {}
    method = params.get("method") or summary.get("method") or "?"
    native = record.get("native") or {}
    out = [f"# {model.get('name') or model.get('source') or 'model'} → MoE ({method})", ""]
    out.append(f"Converted by moelab with **{method}** from `{model.get('source', '?')}`"
               + (f" ({model.get('family')})" if model.get("family") else "") + ".")
    cal = record.get("calibration") or {}
    if cal:
        out.append(f"Calibration set: {cal.get('name', '?')} ({cal.get('n_samples', '?')} samples).")
    out += ["", "## Parameters", "", "| parameter | value |", "|---|---|"]
    out += [f"| {k} | {_fmt(v)} |" for k, v in params.items()]
    ftp = (record.get("finetune") or {}).get("params")
    if ftp:
        out += ["", "Fine-tuning:", "", "| parameter | value |", "|---|---|"]
        out += [f"| {k} | {_fmt(v)} |" for k, v in ftp.items()]
    out += ["", "## Cost", "", "| quantity | value |", "|---|---|"]
    for key in ("ffn_flops_fraction", "total_params", "active_params", "dense_total_params", "active_fraction", "sparsity"):
        if summary.get(key) is not None:
            out.append(f"| {key} | {_fmt(summary[key])} |")
    out += ["", "`ffn_flops_fraction`: FFN multiply-adds per token (router included) over the dense model's; "
            "`active_params`: parameters one token uses.", "", "## Layout", ""]
    out += _layer_rows(specs)
    out += ["", "## Evaluation", ""]
    out += _evaluation_lines(evaluation, record)
    out += _run_lines(fmt, native, gguf, gguf_why)
    return "\n".join(out)


def read_evaluation(src_dir: Path | None) -> dict | None:
    """``evaluation.json`` of a conversion directory, if any."""
    if src_dir is None:
        return None
    path = Path(src_dir) / EVALUATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_model_card(out_dir: Path, record: dict, moe: Any, fmt: str = "moelab", evaluation: dict | None = None,
                     gguf: dict | None = None) -> Path:
    """Write README.md into ``out_dir`` (atomic file write); ``moe``: the MoelabForCausalLM exported."""
    specs = list(getattr(moe.config, "moe_layers", None) or [])
    config = moe.config.to_dict()
    path = Path(out_dir) / CARD_FILE
    write_bytes_atomic(path, render_model_card(record, specs, fmt, evaluation, gguf, gguf_refusal(config)).encode())
    return path


def _padding_words(padding: Any) -> str:
    """'no zero padding' / 'zero neurons pad it: 24 per layer' / '… 0–24 per layer' from the layout's padding."""
    values = sorted(set((padding or {}).values() if isinstance(padding, dict) else (padding or [])))
    if not values or values == [0]:
        return "no zero padding"
    return f"zero neurons pad it: {values[0] if len(values) == 1 else f'{values[0]}–{values[-1]}'} per layer"


def _run_lines(fmt: str, native: dict, gguf: dict | None, gguf_why: str | None) -> list[str]:
    """"How to run": the commands for the format written, then the other ways out of moelab."""
    out = ["## How to run", ""]
    if fmt == "gguf":
        name = Path((gguf or {}).get("file", "MODEL.gguf")).name
        lay = (gguf or {}).get("layout") or {}
        out += [f"`{name}` ({(gguf or {}).get('type', '?')}) is llama.cpp's `deepseek` architecture: "
                f"{lay.get('num_experts')} routed experts of {lay.get('expert_size')} neurons, top-{lay.get('top_k')} "
                f"weighted by their softmax probabilities, a shared expert of {lay.get('n_shared_experts')} × "
                f"{lay.get('expert_size')} neurons ({_padding_words(lay.get('shared_padding'))}), the first "
                f"{lay.get('leading_dense')} layers dense. The tokenizer and chat template are inside the file.", "",
                "llama.cpp:", "", "```sh", f'llama-cli -m {name} -p "Hello" -n 64', f"llama-server -m {name} --port 8080",
                "```", "",
                "Exactly moelab's model: an f32 file with an f32 KV cache (`llama-cli -m "
                f"{name} -ctk f32 -ctv f32`; llama-cpp-python `Llama(..., type_k=0, type_v=0)`) computes moelab's logits within "
                "1e-3 (tested from `moelab finetune` to llama.cpp). llama.cpp's default f16 KV cache moves them by about 1e-2, "
                "and a token whose top-k experts nearly tie may then take another expert, which moves its logits further.", "", "Ollama (`Modelfile` is in this directory):", "", "```sh", "ollama create moelab-moe -f Modelfile",
                "ollama run moelab-moe", "```", "", "Python (llama-cpp-python):", "", "```python",
                "from llama_cpp import Llama", "", f'llm = Llama(model_path="{name}")',
                'print(llm("Hello", max_tokens=64)["choices"][0]["text"])', "```", ""]
        return out
    out += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if fmt == "native":
        out += ['model = AutoModelForCausalLM.from_pretrained("PATH")  # stock ' + native.get("model_type", "transformers")
                + " architecture, no remote code"]
    else:
        out += ['model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)  # runs the bundled modeling_moelab.py']
    out += ['tokenizer = AutoTokenizer.from_pretrained("PATH"' + (")" if fmt == "native" else ", trust_remote_code=True)"),
            "```", ""]
    if fmt == "native":
        shared = (f"shared expert of {native.get('d_shared')} neurons (its gate is zero, sigmoid 0.5, and its down "
                  "projection is doubled)") if native.get("d_shared") else "no shared expert"
        out += [f"Written as `{native.get('model_type')}`: {native.get('num_experts')} routed experts of "
                f"{native.get('expert_size')} neurons, top-{native.get('top_k')}, norm_topk_prob="
                f"{native.get('norm_topk_prob', False)}, {shared}, dense layers {native.get('dense_layers')}. "
                "Logits equal moelab's own model (fp32, 1e-4).", "",
                "vLLM serves the architecture with its fused MoE kernels:", "", "```sh", "vllm serve PATH", "```", ""]
    if gguf_why is None:
        out += ["GGUF (llama.cpp, Ollama): this layout exports exactly: `moelab export PATH --format gguf --type f16 --out DIR`.", ""]
    else:
        out += [f"GGUF (llama.cpp, Ollama): not exportable as it is. {gguf_why}", ""]
    return out
