"""Exports written before the engine was reorganised still load and give the logits they gave then.

``tests/fixtures/export_v1`` was written by the previous runtime (its ``modeling_moelab.py`` travels
with it, as in every export): a tiny Llama with a centroid-routed and a representative-routed MoE layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from moelab.engine.runtime.export import load_exported

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "export_v1"


def test_export_from_before_the_registry_loads_with_its_logits():
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    model = load_exported(FIXTURE).eval()
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    assert torch.allclose(logits, expected["logits"], atol=1e-5)
    kinds = [m.spec["kind"] for m in model.moe_modules().values()]
    assert kinds == ["moe", "moe"]


def test_old_export_loads_with_the_current_model_class(tmp_path):
    """Fine-tuning loads a conversion with the engine's own class, not the bundled file: the old
    layer specs (``n_experts`` counting routed experts) must still be understood."""
    from moelab.engine.runtime.modeling_moelab import MoelabForCausalLM

    expected = load_file(str(FIXTURE / "expected.safetensors"))
    model = MoelabForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits
    assert torch.allclose(logits, expected["logits"], atol=1e-5)
