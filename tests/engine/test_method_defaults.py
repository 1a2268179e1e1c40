"""Every method's defaults are a real conversion: ``moelab methods --json`` lists them, and built as
they are they keep between 25% and 95% of the dense FFN's multiply-adds per token
(``ffn_flops_fraction``, router included). CMoE's defaults once kept 3% (S·A·E = 1·1·64).

The model is a random-weight Llama with the default model's proportions where cost depends on
them (30 layers, d_ffn / d_model = 1536 / 64 so a router is as cheap relative to its FFN as on
SmolLM2) but a narrow residual stream, so the whole file takes seconds per method.
"""

from __future__ import annotations

import json

import pytest
import transformers
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from moelab.cli import main
from tests.conftest import build_tiny_moe
from moelab.engine.data.calibration import load_calibration
from moelab.engine.methods import get_method
from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.profiling.store import write_profile
from moelab.engine.runs import run_conversion

pytestmark = pytest.mark.usefixtures("one_thread")


def _defaults() -> dict[str, dict]:
    out = CliRunner().invoke(main, ["methods", "--json"])
    assert out.exit_code == 0, out.output
    return {m["name"]: {p["name"]: p["default"] for p in m["params"]} for m in json.loads(out.stdout)}


@pytest.fixture(scope="module")
def proportioned(tmp_path_factory, default_model_dir, data_dir):
    """(model dir, profile of builtin:mixed, profile of builtin:code) of the proportioned model."""
    import torch

    root = tmp_path_factory.mktemp("defaults")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    adapter = load_model(str(root / "model"), data_dir=data_dir)
    profiles = []
    for name in ("mixed", "code"):
        cset = load_calibration(f"builtin:{name}", samples=12, data_dir=data_dir)
        res = profile_model(adapter, cset, ProfileSettings(max_tokens=32, batch_tokens=384, feature_tokens=256))
        profiles.append(write_profile(res, cset, root / name))
    return root / "model", profiles


METHODS_ON_DENSE = ("expertweaver", "cmoe", "dense2moe", "midas")


def test_every_method_is_listed_with_its_defaults():
    assert set(_defaults()) == {*METHODS_ON_DENSE, "hierarchical"}
    cmoe = _defaults()["cmoe"]
    assert (cmoe["shared"], cmoe["active"], cmoe["n_experts"]) == (3, 3, 8)  # CM S3A3E8 (75% activation)


@pytest.mark.parametrize("method", METHODS_ON_DENSE)
def test_defaults_build_a_conversion_of_sensible_cost(method, proportioned, data_dir, tmp_path):
    _, profiles = proportioned
    params = get_method(method).params.from_dict(_defaults()[method])
    record = run_conversion(profiles[0], params, tmp_path / "c", data_dir=data_dir,
                            extra_profiles=profiles[1:] if method == "midas" else ())
    cost = record["summary"]["ffn_flops_fraction"]
    assert 0.25 <= cost <= 0.95, (method, cost)


def test_hierarchical_defaults_build_a_conversion_of_sensible_cost(default_model_dir, data_dir, tmp_path):
    build_tiny_moe("mixtral", tmp_path / "moe", default_model_dir)
    defaults = {**_defaults()["hierarchical"], "samples": 8, "max_tokens": 48}  # fewer tokens: the cost is the plan's
    params = get_method("hierarchical").params.from_dict(defaults)
    record = run_conversion(None, params, tmp_path / "c", data_dir=data_dir, model=str(tmp_path / "moe"),
                            calib="builtin:mixed")
    cost = record["summary"]["ffn_flops_fraction"]
    assert 0.25 <= cost <= 0.95, cost
