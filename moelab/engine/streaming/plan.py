"""The plan of a streamed job: the model built on the ``meta`` device (config and tokenizer only) and its
footprint checked against ``max_memory`` before any weight is read; ``StreamPlan.stream`` says whether the
whole model exceeds the budget (stream) or fits (the ordinary in-memory path runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import DEFAULT_MODEL, ModelAdapter, adapt, resolve_device, resolve_dtype
from .checkpoint import weights_location
from .footprint import Footprint, footprint


@dataclass
class StreamPlan:
    """A model built on ``meta`` with what streaming needs to load it layer by layer."""

    adapter: ModelAdapter
    location: Path
    device: torch.device
    dtype: torch.dtype
    footprint: Footprint
    max_memory: int
    work_bytes: int = 0  # what the job holds beside the weights (a fitted conversion's fit: ``conversion.fit_bytes``)

    @property
    def stream(self) -> bool:
        """Whether the whole model and the job's work exceed the budget (else the ordinary in-memory pass runs)."""
        return self.footprint.total_bytes + self.work_bytes > self.max_memory


def meta_model(spec: str, *, data_dir: Path, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False) -> tuple[ModelAdapter, Path, torch.device, torch.dtype]:
    """``spec`` built on the meta device with its tokenizer: (adapter, weights dir, device, dtype).

    Reads the config and tokenizer only, so a model of any size can be described and planned.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    location = weights_location(spec, data_dir)
    config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    with init_empty_weights():  # parameters on meta; buffers (rotary inv_freq) real, as the forward needs them
        model = AutoModelForCausalLM.from_config(config, dtype=dt, trust_remote_code=trust_remote_code)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token  # as load_model: padding is masked out
    source = spec if spec == DEFAULT_MODEL or not Path(spec).exists() else str(Path(spec).resolve())
    adapter = adapt(model, tokenizer, source=source)
    adapter.extra["device"] = str(dev)  # describe() would say "meta"
    return adapter, location, dev, dt


def plan_streaming(spec: str, max_memory: int, *, data_dir: Path, device: str = "auto", dtype: str = "auto",
                   trust_remote_code: bool = False) -> StreamPlan:
    """Build ``spec`` on the meta device and check ``max_memory`` against it (no weights read).

    Raises MemoryBudgetError when the budget cannot hold one layer: before any work starts.
    """
    adapter, location, dev, dt = meta_model(spec, data_dir=data_dir, device=device, dtype=dtype,
                                            trust_remote_code=trust_remote_code)
    fp = footprint(adapter, dt)
    fp.check(max_memory)
    return StreamPlan(adapter, location, dev, dt, fp, max_memory)
