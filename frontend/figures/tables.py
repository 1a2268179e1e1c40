"""Long-format rows (CSV) of each figure's data, for the shared download callback."""

from __future__ import annotations

from typing import Any


def table(kind: str, data: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """Long-format rows (for CSV) of a chart payload."""
    if kind == "cv-histogram":
        edges = data["edges"]
        return [{"layer": layer, "bin_lo": edges[i], "bin_hi": edges[i + 1], "count": c}
                for layer, counts in zip(data["layers"], data["counts"], strict=True) for i, c in enumerate(counts)]
    if kind == "cv-summary":
        return [{"layer": layer, **{f"q{q:g}": v for q, v in zip(data["quantiles"], vals, strict=True)}, "mean": m,
                 "r": (data.get("specialisation_ratio") or [None] * len(data["layers"]))[i]}
                for i, (layer, vals, m) in enumerate(zip(data["layers"], data["values"], data["mean"], strict=True))]
    if kind == "activations":
        return [{"row": r, "column": j, "first_neuron": data["column_first_neuron"][j], "value": v}
                for r, vals in zip(data["rows"], data["values"], strict=True) for j, v in enumerate(vals)]
    if kind == "task-similarity":
        return [{"task_a": a, "task_b": b, "cosine": v} for a, vals in zip(data["labels"], data["matrix"], strict=True)
                for b, v in zip(data["labels"], vals, strict=True)]
    if kind == "layer-similarity":
        n = len(data["layers"])
        return [{"layer_a": i, "layer_b": j, "S_L": data["S_L"][i][j], "S_M": data["S_M"][i][j]} for i in range(n) for j in range(n)]
    if kind == "rates":
        e = data["rate_edges"]
        return [{"layer": data["layer"], "rate_lo": e[i], "rate_hi": e[i + 1], "neurons": c} for i, c in enumerate(data["rate_counts"])]
    if kind == "h-values":
        e = data["h_edges"]
        return [{"layer": data["layer"], "h_lo": e[i], "h_hi": e[i + 1], "count": c} for i, c in enumerate(data["h_counts"])]
    if kind == "allocation":
        return [dict(r) for r in data["layers"]]
    if kind == "routing":
        out = []
        for s, name in enumerate(data["sets"]):
            for li, layer in enumerate(data["layers"]):
                for e, v in enumerate(data["share"][s][li]):
                    out.append({"set": name, "layer": layer, "expert": e, "share": v, "load_cv": data["load_cv"][s][li]})
        return out
    if kind == "matching":
        return [{"layer": m["layer"], "expert_a": e["expert"], "expert_b": e["match"], "jaccard": e["jaccard"],
                 "best_b": e["best"], "best_jaccard": e["best_jaccard"], "mean_jaccard": m["mean_jaccard"],
                 "shared_jaccard": m["shared_jaccard"]} for m in data["layers"] for e in m["a"]]
    if kind == "profile-compare":
        sc = data["scatter"]
        return [{"layer": sc["layer"], "neuron": n, "mean_a": a, "mean_b": b, "d": d}
                for n, a, b, d in zip(sc["neurons"], sc["mean_a"], sc["mean_b"], sc["specificity"], strict=True)]
    if kind == "specific-shares":
        return [dict(r) for r in data["layers"]]
    if kind == "finetune-log":
        return [{k: st.get(k) for k in ("step", "loss", "ntp_loss", "kd_loss", "aux_loss", "lr", "tokens", "elapsed_s")} for st in data["steps"]]
    raise ValueError(f"no table for {kind!r}")


def csv_text(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
