"""Limits on what a job may be asked to do, from JSON facts only (a conversion's ``config.json``, a
model's stored description, the request's numbers): each ``*_problem`` returns the message saying
what to change, or None. Work that would grow without bound is refused before it starts: by the API
with 422 before anything is queued (it never imports torch), and by the engine's own entry points
(``runs.check_evaluation_limits``, ``FinetuneParams.validate_for``, ``profiler.check_atopk``), so
the CLI says the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EVAL_TOKENS_SETTING = "MOELAB_MAX_EVAL_TOKENS"


def conversion_config(root: Path) -> dict[str, Any] | None:
    """The ``config.json`` of a conversion directory (or None when it cannot be read here)."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The dense model's own config inside a conversion's (``base_config``; its ``text_config`` for
    multimodal wrappers), or the config itself for a plain model directory."""
    base = config.get("base_config") if isinstance(config.get("base_config"), dict) else config
    text = base.get("text_config")
    return {**base, **text} if isinstance(text, dict) else base


def _first_int(config: dict[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def max_positions(config: dict[str, Any] | None) -> int | None:
    """The model's ``max_position_embeddings`` (None when the config does not say)."""
    if not config:
        return None
    return _first_int(_model_config(config), ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"))


def hidden_size(config: dict[str, Any] | None) -> int | None:
    """d_model of the model (``hidden_size``; None when the config does not say)."""
    if not config:
        return None
    found = _first_int(_model_config(config), ("hidden_size", "d_model", "n_embd"))
    if found is None:  # a conversion's layer specs carry it too
        found = next((e["d_model"] for e in config.get("moe_layers") or [] if isinstance(e, dict)
                      and isinstance(e.get("d_model"), int)), None)
    return found


def eval_tokens_problem(n_windows: int, seq_len: int, limit: int, *, windows_name: str = "n_windows",
                        seq_name: str = "seq_len") -> str | None:
    """Why ``n_windows × seq_len`` held-out tokens are too many for this server (None: they fit)."""
    tokens = n_windows * seq_len
    if tokens <= limit:
        return None
    fit = max(1, limit // seq_len)
    return (f"{windows_name} × {seq_name} = {n_windows} × {seq_len} = {tokens} tokens exceeds the server's limit of {limit} "
            f"tokens per evaluation ({EVAL_TOKENS_SETTING}); use at most {fit} windows of {seq_len} tokens, or raise "
            f"{EVAL_TOKENS_SETTING} on a machine that can evaluate that much")


def seq_len_problem(seq_len: int, config: dict[str, Any] | None, *, name: str = "seq_len", what: str = "the model") -> str | None:
    """Why ``seq_len`` is longer than the model's positions (None: it fits or the config does not say)."""
    limit = max_positions(config)
    if limit is None or seq_len <= limit:
        return None
    return f"{name} {seq_len} exceeds {what}'s max_position_embeddings ({limit}); use {name} ≤ {limit}"


def lora_rank_problem(rank: int, config: dict[str, Any] | None, *, what: str = "the model") -> str | None:
    """Why a LoRA rank above the model's d_model is refused (None: it fits or the config does not say)."""
    d_model = hidden_size(config)
    if d_model is None or rank <= d_model:
        return None
    return (f"lora_rank {rank} exceeds d_model ({d_model}) of {what}: a rank above d_model adds parameters and memory "
            f"but no expressiveness; use lora_rank ≤ {d_model}")


def atopk_problem(atopk_k: int, d_ffn: list[int] | None, *, what: str = "the model") -> str | None:
    """Why ATopK's K above the smallest FFN width is refused (None: it fits or the widths are unknown)."""
    widths = [int(d) for d in d_ffn or [] if isinstance(d, int) and d > 0]
    if not widths or atopk_k <= min(widths):
        return None
    return (f"atopk_k {atopk_k} exceeds d_ffn ({min(widths)}, the narrowest FFN layer of {what}): a token cannot mark more "
            f"neurons than a layer has; use atopk_k ≤ {min(widths)}")


def profile_duplicates_problem(profile_id: str | None, extra_profile_ids: list[str]) -> str | None:
    """Why MIDAS's profiles are not distinct (None: they are)."""
    ids = [p for p in [profile_id, *extra_profile_ids] if p]
    seen: set[str] = set()
    repeated = [p for p in ids if p in seen or seen.add(p)]  # type: ignore[func-returns-value]
    if not repeated:
        return None
    where = "profile_id" if profile_id in extra_profile_ids else "extra_profile_ids"
    return (f"extra_profile_ids: {', '.join(dict.fromkeys(repeated))} given more than once ({where} repeats it); MIDAS builds one "
            "expert per calibration set, so every profile must be a different one")


# --------------------------------------------------------------------------- exports

#: bytes per weight of a GGUF file of each type (q8_0: blocks of 32 int8 weights and one f16 scale)
GGUF_BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}
#: the largest safetensors header read to count weights (a real one is kilobytes to a few megabytes)
_MAX_HEADER = 100_000_000


def stored_weights(model_dir: Path) -> int | None:
    """How many weights the model files (``model*.safetensors``) of a model directory hold, from
    their headers alone (nothing is loaded); None when there are none or a header is unreadable."""
    total, found = 0, False
    for path in sorted(Path(model_dir).glob("model*.safetensors")):
        try:
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 0 < size <= _MAX_HEADER:
                    return None
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                count = 1
                for dim in entry.get("shape") or []:
                    count *= int(dim)
                total += count
        found = True
    return total if found else None


def gguf_export_footprint(model_dir: Path, gguf_type: str) -> dict[str, int] | None:
    """About what a GGUF export of a converted model costs (``gguf_export.export_gguf``), from its
    stored weights: ``file_bytes`` (the .gguf), ``disk_bytes`` (the fp32 checkpoint it is staged as, plus
    the file, both in the artifacts dir at once) and ``memory_bytes`` (the model loaded in fp32, its
    staged fp32 copy, and the converter's output); None when the weights cannot be counted."""
    weights = stored_weights(model_dir)
    if weights is None:
        return None
    fp32 = 4 * weights
    file_bytes = int(weights * GGUF_BYTES_PER_WEIGHT[gguf_type])
    return {"weights": weights, "file_bytes": file_bytes, "disk_bytes": fp32 + file_bytes, "memory_bytes": 2 * fp32 + file_bytes}


def memory_problem(need: int, budget: str | None, what: str) -> str | None:
    """Why a job needing about ``need`` bytes of memory does not fit the server's ``MOELAB_MAX_MEMORY``
    (None: it fits, or no budget is set)."""
    if not budget:
        return None
    from .sizes import format_size, parse_size

    limit = parse_size(budget)
    if need <= limit:
        return None
    return (f"{what} needs about {format_size(need)} of memory, more than this server's MOELAB_MAX_MEMORY ({budget}); "
            "raise MOELAB_MAX_MEMORY for the workers, or export on a larger machine with `moelab export`")
