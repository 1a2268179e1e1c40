"""A partition conversion under --max-memory (one decoder layer at a time, straight into the
export) against the same conversion in memory, on tiny sharded models: the same files, the same
tensors (names, shapes, float32 values) and the same logits; what cannot stream is refused before
any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moelab.engine.core.params import ConversionError
from moelab.engine.methods.cmoe import CMoEParams
from moelab.engine.methods.expertweaver import ExpertWeaverParams
from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.profiling.store import write_profile
from moelab.engine.streaming.footprint import MemoryBudgetError
from moelab.engine.streaming.plan import plan_streaming
from moelab.engine.methods import get_method
from moelab.engine.runs import run_conversion, run_profile
from moelab.engine.streaming.conversion import plan_conversion
from moelab.engine.runtime.export import load_exported

from .test_profiling import make_set
from .test_streaming_profile import _sharded


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def profiled(request, tiny_model, data_dir, tmp_path_factory):
    src = _sharded(tiny_model, request.param, tmp_path_factory.mktemp("sharded") / request.param)
    cset = make_set(n=12, tasks=3, seed=1)
    res = profile_model(load_model(str(src), data_dir=data_dir), cset, ProfileSettings(max_tokens=32, batch_tokens=128))
    return src, write_profile(res, cset, tmp_path_factory.mktemp("prof") / "p")


def _weights(path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out |= load_file(str(path / f))
    return out


def _budget(src, data_dir) -> int:
    """Room for the largest layer (or the embeddings) and little more: the model cannot load whole."""
    plan = plan_streaming(str(src), 1 << 40, data_dir=data_dir, dtype="float32")
    assert plan.footprint.total_bytes > plan.footprint.floor_bytes * 1.5
    return plan.footprint.floor_bytes + (plan.footprint.floor_bytes >> 3)


@pytest.mark.parametrize("params", [ExpertWeaverParams(n_experts=8, alpha_min=0.2, alpha_max=0.5, sparsity=0.5),
                                    CMoEParams(n_experts=8, shared=2, active=2)], ids=["expertweaver", "cmoe"])
def test_streamed_conversion_equals_the_in_memory_one(profiled, params, data_dir, tmp_path):
    src, prof = profiled
    whole = run_conversion(prof, params, tmp_path / "whole", data_dir=data_dir)
    streamed = run_conversion(prof, params, tmp_path / "streamed", data_dir=data_dir, max_memory=_budget(src, data_dir))
    assert streamed["timings"]["streamed"] is True and "streamed" not in whole["timings"]
    assert streamed["timings"]["peak_rss_mib"] > 0 and streamed["timings"]["max_memory_bytes"] > 0
    for key in ("summary", "layers", "params", "model", "calibration"):
        a, b = dict(whole[key]) if isinstance(whole[key], dict) else whole[key], streamed[key]
        if key == "layers":  # clustering times differ; everything else is the same
            a = [{k: v for k, v in lay.items() if k != "seconds"} for lay in a]
            b = [{k: v for k, v in lay.items() if k != "seconds"} for lay in b]
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), key  # (NaN r: CMoE has no CV plan)
    w, s = _weights(tmp_path / "whole"), _weights(tmp_path / "streamed")
    assert w.keys() == s.keys()
    for k in w:
        assert w[k].dtype == s[k].dtype == torch.float32 and torch.equal(w[k], s[k]), k
    assert load_file(str(tmp_path / "whole" / "partition.safetensors")).keys() == load_file(str(tmp_path / "streamed" / "partition.safetensors")).keys()
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 11]])
    with torch.inference_mode():
        a = load_exported(tmp_path / "whole").eval()(input_ids=ids).logits
        b = load_exported(tmp_path / "streamed").eval()(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert (tmp_path / "streamed" / "README.md").is_file()


def test_what_cannot_stream_is_refused_before_any_work(profiled, data_dir, tmp_path):
    src, prof = profiled
    budget = _budget(src, data_dir)
    with pytest.raises(ConversionError, match="plan_error 'fisher' reads the loss gradient of the whole model"):
        run_conversion(prof, ExpertWeaverParams(n_experts=8, router="ridge", plan="budget", plan_error="fisher"),
                       tmp_path / "fisher", data_dir=data_dir, max_memory=budget)
    with pytest.raises(ConversionError, match="refit 'converted_inputs' runs the whole converted model"):
        run_conversion(prof, ExpertWeaverParams(n_experts=8, router="ridge", refit="converted_inputs"),
                       tmp_path / "refit", data_dir=data_dir, max_memory=budget)
    assert not (tmp_path / "fisher").exists() and not (tmp_path / "refit").exists()
    with pytest.raises(MemoryBudgetError):
        run_conversion(prof, ExpertWeaverParams(n_experts=8), tmp_path / "small", data_dir=data_dir, max_memory=1024)
    assert not (tmp_path / "small").exists()
    big = run_conversion(prof, ExpertWeaverParams(n_experts=8), tmp_path / "fits", data_dir=data_dir, max_memory="64GiB")
    assert "streamed" not in big["timings"]  # a model that fits is converted in memory as before


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def profiled_on_builtin(request, tiny_model, data_dir, tmp_path_factory):
    """A sharded tiny model profiled on built-in text, which a fitted conversion reads again, with its kernel table."""
    src = _sharded(tiny_model, request.param, tmp_path_factory.mktemp("sharded") / request.param)
    prof = run_profile(str(src), "builtin:mixed", tmp_path_factory.mktemp("prof") / "p",
                       ProfileSettings(max_tokens=64, batch_tokens=512), samples=24, data_dir=data_dir)
    return src, prof.path, prof


FITTED = {
    "best": lambda: get_method("expertweaver").recipe("best", n_experts=8, fit_tokens=1024),
    "portable": lambda: get_method("expertweaver").recipe("portable", n_experts=8, fit_tokens=1024, width_multiple=8),
    "cmoe-fitted": lambda: CMoEParams(n_experts=8, shared=2, active=2, router="ridge", plan="budget",
                                      compensation="skipped_mean", fit_tokens=1024),
}


@pytest.mark.parametrize("recipe", list(FITTED))
def test_a_fitted_recipe_streams_in_two_passes_and_equals_the_in_memory_conversion(profiled_on_builtin, recipe,
                                                                                    data_dir, tmp_path):
    """``--recipe best`` (ridge router, budget plan under the speed guard, skipped-expert compensation, half the down
    rows), ``portable`` (leading plan) and CMoE with the same fits under a budget that holds the largest step and the
    fit but not the model: fitted layer by layer in a first pass, built in a second, and the same export as in memory
    (records, tensors bit for bit, logits). A budget that holds the largest step but not the fit beside it is
    refused, saying so."""
    src, prof, stored = profiled_on_builtin
    params = FITTED[recipe]()
    plan = plan_conversion(get_method(params.method), params, stored, 1 << 40, data_dir=data_dir)
    fp = plan.footprint
    assert plan.work_bytes > 0 and fp.total_bytes > 1.5 * fp.floor_bytes
    budget = fp.floor_bytes + plan.work_bytes + (fp.floor_bytes >> 3)
    with pytest.raises(MemoryBudgetError, match=r"the fit on 1024 calibration tokens holds up to .* fewer fit_tokens"):
        run_conversion(prof, params, tmp_path / "short", data_dir=data_dir, max_memory=budget - plan.work_bytes)
    assert not (tmp_path / "short").exists()
    whole = run_conversion(prof, params, tmp_path / "whole", data_dir=data_dir)
    streamed = run_conversion(prof, params, tmp_path / "streamed", data_dir=data_dir, max_memory=budget)
    assert streamed["timings"]["streamed"] is True and "streamed" not in whole["timings"]
    assert whole["fit"]["fit_tokens"] == 1024 and ("leading" if recipe == "portable" else "budget") in whole["fit"]
    if recipe == "best":  # the guard read the same kernel table in both
        assert whole["fit"]["speed_guard"]["applied"] and whole["fit"]["compensation"] == "skipped_mean"
        assert any(lay["top_k"] < lay["n_routed"] for lay in whole["layers"])  # some expert is skipped: compensated
    for key in ("summary", "layers", "params", "fit", "model", "calibration"):
        a, b = whole[key], streamed[key]
        if key == "layers":  # clustering times differ; everything else is the same
            a = [{k: v for k, v in lay.items() if k != "seconds"} for lay in a]
            b = [{k: v for k, v in lay.items() if k != "seconds"} for lay in b]
        if key == "summary":  # the streamed model is not in memory to measure the experts a batch touches
            a, b = dict(a), dict(b)
            pa, pb = a.pop("predicted_speed"), b.pop("predicted_speed")
            assert pa["measured_at"] == pb["measured_at"] and "routing taken as uniform" in pb["note"]
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True), key
    w, s = _weights(tmp_path / "whole"), _weights(tmp_path / "streamed")
    assert w.keys() == s.keys() and any(".skip_mean" in k for k in w) == (recipe != "portable")
    for k in w:
        assert w[k].dtype == s[k].dtype == torch.float32 and torch.equal(w[k], s[k]), k
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 11]])
    with torch.inference_mode():
        a = load_exported(tmp_path / "whole").eval()(input_ids=ids).logits
        b = load_exported(tmp_path / "streamed").eval()(input_ids=ids).logits
    assert torch.equal(a, b)


def test_moelab_convert_streams_the_best_recipe_and_says_so(profiled_on_builtin, data_dir, tmp_path):
    """The CLI path a user takes: ``moelab convert --recipe best --max-memory`` streams, prints that it did (two passes,
    the peak), and a budget that holds the largest step but not the fit exits 1 with what to give, writing nothing."""
    import os
    import subprocess
    import sys

    src, prof, stored = profiled_on_builtin
    method = get_method("expertweaver")
    plan = plan_conversion(method, method.recipe("best", n_experts=8, fit_tokens=1024), stored, 1 << 40,
                           data_dir=data_dir)
    budget = plan.footprint.floor_bytes + plan.work_bytes + (plan.footprint.floor_bytes >> 3)
    env = dict(os.environ, MOELAB_DATA_DIR=str(data_dir))

    def convert(max_memory: int, out) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "moelab.cli", "convert", "--profile", str(prof), "--recipe",
                               "best", "--n-experts", "8", "--fit-tokens", "1024", "--max-memory", str(max_memory),
                               "--out", str(out), "--quiet"], capture_output=True, text=True, env=env, timeout=600)

    short = convert(budget - plan.work_bytes, tmp_path / "short")
    assert short.returncode == 1 and "fewer fit_tokens (--fit-tokens)" in short.stderr
    assert "Traceback" not in short.stderr and not (tmp_path / "short").exists()
    proc = convert(budget, tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    assert "streamed one layer at a time" in proc.stdout and "fitted in a first pass, built in a second" in proc.stdout
    record = json.loads((tmp_path / "c" / "conversion.json").read_text())
    assert record["timings"]["streamed"] is True and record["fit"]["compensation"] == "skipped_mean"


def test_a_model_that_only_streams_has_its_ffn_layers_timed_and_its_streamed_best_guarded(tiny_model, data_dir,
                                                                                          tmp_path):
    """A model profiled under a budget it cannot load whole in cannot be timed whole; its profile times its FFN layers
    (random weights at its shape, within the budget) instead, and a streamed ``--recipe best`` reads them: the speed
    guard applies (it offered every top-k before). They predict no whole-model speed, and the record says why. A
    conversion that loads the model whole times it whole, replacing them; a budget below what the timing holds
    times nothing."""
    from moelab.engine.core.speed_prediction import FEATURES, TABLE_DIR
    from moelab.engine.evaluation.speed_table import ensure_ffn_table, ffn_table_bytes, model_info

    from .test_speed_prediction import data_without_tables

    data = data_without_tables(data_dir, tmp_path)
    src = _sharded(tiny_model, "llama", tmp_path / "llama")
    fp = plan_streaming(str(src), 1 << 40, data_dir=data, dtype="float32").footprint
    prof = run_profile(str(src), "builtin:mixed", tmp_path / "p", ProfileSettings(max_tokens=64, batch_tokens=512),
                       samples=24, data_dir=data, max_memory=fp.floor_bytes + (fp.floor_bytes >> 3))
    (path,) = (data / TABLE_DIR).glob("*.json")
    table = json.loads(path.read_text())
    plan = plan_conversion(get_method("expertweaver"), FITTED["best"](), prof, 1 << 40, data_dir=data)
    positions = plan.adapter.model.config.max_position_embeddings
    assert table["scope"] == "ffn_layers" and table["phases"]["prefill"]["tokens"] == min(512, positions)
    assert all("dense_model_s" not in p and p["dense_ffn_s"] > 0 and len(p["coef"]) == len(FEATURES)
               for p in table["phases"].values()) and len(table["grid"]) >= 8

    budget = fp.floor_bytes + plan.work_bytes + (fp.floor_bytes >> 3)
    streamed = run_conversion(prof.path, FITTED["best"](), tmp_path / "s", data_dir=data, max_memory=budget)
    guard = streamed["fit"]["speed_guard"]
    assert streamed["timings"]["streamed"] is True and guard["applied"] and guard["measured_at"] == table["measured_at"]
    assert "only this model's FFN layers were timed" in streamed["summary"]["predicted_speed"]["note"]

    whole = run_conversion(prof.path, FITTED["best"](), tmp_path / "w", data_dir=data)
    timed = json.loads(path.read_text())
    assert "scope" not in timed and all(p["dense_model_s"] > 0 for p in timed["phases"].values())
    assert whole["fit"]["speed_guard"]["measured_at"] == timed["measured_at"]
    assert "phases" in whole["summary"]["predicted_speed"]

    info, where = model_info(plan.adapter, "elsewhere"), (plan.device, plan.dtype)
    need = ffn_table_bytes(info, where, table["phases"]["prefill"]["tokens"])
    assert ensure_ffn_table(plan.adapter.model, info, where, tmp_path / "short", need - 1) is None
    assert not (tmp_path / "short").exists()
