"""Layer-streamed profiling (``--max-memory``) against the in-memory pass on tiny sharded models.

Every statistic a profile stores must agree to 1e-5: the streamed pass runs the same layers on
the same inputs with the arguments the model's own forward gives them, only in a different
order (layer-outer instead of batch-outer), with hidden states and unit vectors carried in
memory or on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.profiling.store import StoredProfile, write_profile
from moelab.engine.streaming.footprint import MemoryBudgetError
from moelab.engine.streaming.plan import plan_streaming
from moelab.engine.streaming.profile import profile_streamed, remove_scratch
from moelab.engine.sizes import format_size, parse_size
from moelab.engine.runs import run_profile

from .test_profiling import make_set

SETTINGS = dict(max_tokens=40, batch_tokens=120, atopk_k=5, feature_tokens=200, hist_bins=21)


def _sharded(tiny_model, family: str, target):
    """The tiny model re-saved in many small shards, as large checkpoints are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model(family)
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(target, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(src).save_pretrained(target)
    assert (target / "model.safetensors.index.json").is_file()
    return target


@pytest.fixture(scope="module")
def llama(tiny_model, tmp_path_factory):
    return _sharded(tiny_model, "llama", tmp_path_factory.mktemp("sharded") / "llama")


def _stored_arrays(prof: StoredProfile) -> dict[str, np.ndarray]:
    """Every array a profile stores, by name."""
    from safetensors.numpy import load_file

    arrays = {f"neurons.{c}": prof.neurons[c].to_numpy() for c in prof.neurons.columns}
    for f in prof.manifest["files"]:
        if f.endswith(".safetensors"):
            arrays |= {f"{f}:{k}": v for k, v in load_file(str(prof.path / f)).items()}
    arrays["samples.n_tokens"] = prof.samples["n_tokens"].to_numpy()
    assert prof.has_top_tokens  # each neuron's top tokens (top_tokens.safetensors above) and the token table
    arrays |= {f"tokens.{c}": prof.tokens[c].to_numpy() for c in ("token", "sample", "position", "token_id", "repeated")}
    arrays["tokens.piece"] = np.array([hash(x) for x in prof.tokens["piece"]])  # strings as ints: _assert_same compares numbers
    return arrays


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Equal to 1e-5 (relative to each array's scale); returns the largest relative difference seen."""
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if x.dtype.kind in "iub":
            np.testing.assert_array_equal(x, y, err_msg=k)
            continue
        scale = max(1.0, float(np.abs(x).max(initial=0)))
        diff = float(np.abs(x.astype(np.float64) - y).max(initial=0)) / scale
        assert diff <= 1e-5, f"{k}: differs by {diff:.2e}"
        worst = max(worst, diff)
    return worst


def _in_memory(path, data_dir, out):
    cset, s = make_set(n=10), ProfileSettings(**SETTINGS)
    result = profile_model(load_model(str(path), data_dir=data_dir, device="cpu"), cset, s)
    write_profile(result, cset, out)
    return cset, StoredProfile.open(out)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_streamed_profile_equals_in_memory(llama, data_dir, tmp_path, where):
    cset, reference = _in_memory(llama, data_dir, tmp_path / "in-memory")
    probe = plan_streaming(str(llama), 10**12, data_dir=data_dir, device="cpu").footprint
    # "memory": just below the model, so it streams with room for the carried tensors;
    # "disk": exactly one step, so hidden states, unit vectors and XᵀX all go to disk.
    budget = probe.total_bytes - 1 if where == "memory" else probe.floor_bytes
    out = tmp_path / "streamed"
    cset.save(tmp_path / "cset")
    stored = run_profile(str(llama), str(tmp_path / "cset"), out, ProfileSettings(**SETTINGS), samples=None,
                         data_dir=data_dir, device="cpu", max_memory=budget)
    t = stored.manifest["timings"]
    assert t["streamed"] == 1.0 and stored.manifest["model"]["streamed"] is True
    on_disk = where == "disk"
    assert t["hidden_states_on_disk"] == on_disk and t["unit_vectors_on_disk"] == on_disk
    assert t["second_moment_on_disk"] == on_disk
    assert t["peak_rss_mib"] > 0
    worst = _assert_same(_stored_arrays(reference), _stored_arrays(stored))
    print(f"streamed ({where}) vs in-memory: largest relative difference {worst:.2e}, peak RSS {t['peak_rss_mib']:.0f} MiB")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "scratch files left behind"


def test_budget_that_holds_the_model_runs_in_memory(llama, data_dir):
    plan = plan_streaming(str(llama), 10**12, data_dir=data_dir, device="cpu")
    assert not plan.stream
    assert plan.footprint.floor_bytes == max(max(plan.footprint.layer_bytes), plan.footprint.resident_bytes)


def _streamed_at_the_floor_equals_in_memory(path, data_dir, tmp_path) -> None:
    """Stream ``path`` under the least budget it accepts; every stored array equals the in-memory profile's."""
    cset, reference = _in_memory(path, data_dir, tmp_path / "in-memory")
    plan = plan_streaming(str(path), 10**12, data_dir=data_dir, device="cpu")
    plan.max_memory = plan.footprint.floor_bytes
    result = profile_streamed(plan, cset, ProfileSettings(**SETTINGS), scratch_near=tmp_path)
    write_profile(result, cset, tmp_path / "streamed")
    remove_scratch(result)
    _assert_same(_stored_arrays(reference), _stored_arrays(StoredProfile.open(tmp_path / "streamed")))


def test_qwen2_streams_equal(tiny_model, data_dir, tmp_path):
    path = _sharded(tiny_model, "qwen2", tmp_path / "qwen2")
    _streamed_at_the_floor_equals_in_memory(path, data_dir, tmp_path)


def test_budget_below_one_layer_fails_before_any_work(llama, data_dir, tmp_path):
    floor = plan_streaming(str(llama), 10**12, data_dir=data_dir, device="cpu").footprint.floor_bytes
    out = tmp_path / "p"
    # A calibration source that does not exist: the budget error must come before it is read.
    with pytest.raises(MemoryBudgetError, match=f"at least {format_size(floor)}"):
        run_profile(str(llama), "missing.jsonl", out, ProfileSettings(**SETTINGS), samples=None, data_dir=data_dir,
                    device="cpu", max_memory=floor - 1)
    assert not out.exists()


@pytest.mark.parametrize("text, expected", [("2GiB", 2 * 1024**3), ("512MB", 512 * 10**6), ("1.5g", int(1.5 * 1024**3)),
                                            ("100", 100), (" 64 KiB ", 65536)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1GB", "0", "2 parsecs"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cli_max_memory_too_small(llama, data_dir, tmp_path):
    out = tmp_path / "p"
    env = dict(os.environ, MOELAB_DATA_DIR=str(data_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "moelab.cli", "profile", "--model", str(llama), "--out", str(out), "--quiet",
         "--max-memory", "1MB"], capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode != 0
    assert "--max-memory" in proc.stderr and "at least" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_cli_streams_under_a_budget(llama, data_dir, tmp_path):
    floor = plan_streaming(str(llama), 10**12, data_dir=data_dir, device="cpu").footprint.floor_bytes
    make_set(n=6).save(tmp_path / "cset")
    out = tmp_path / "p"
    env = dict(os.environ, MOELAB_DATA_DIR=str(data_dir), MOELAB_MAX_MEMORY=str(floor))  # the setting is the default
    proc = subprocess.run(
        [sys.executable, "-m", "moelab.cli", "profile", "--model", str(llama), "--calib", str(tmp_path / "cset"),
         "--max-tokens", "32", "--device", "cpu", "--out", str(out), "--quiet"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "streamed one layer at a time" in proc.stdout and "hidden states" in proc.stdout
    assert StoredProfile.open(out).manifest["timings"]["streamed"] == 1.0


def test_worker_describes_a_model_over_its_budget_from_the_config(llama, data_dir):
    """The inspection job never loads a model larger than MOELAB_MAX_MEMORY: it describes the meta skeleton."""
    from moelab.settings import Settings
    from moelab.engine.streaming.footprint import footprint
    from workers.tasks import _describe_on_meta

    loaded = load_model(str(llama), data_dir=data_dir, device="cpu")
    whole = {**loaded.describe(), "memory": footprint(loaded).to_dict()}
    small = Settings(data_dir=data_dir, device="cpu", max_memory=str(whole["memory"]["total_bytes"] - 1))
    described = _describe_on_meta(str(llama), small, trust=False)
    assert described["described_from"].startswith("config")
    for key in ("family", "n_layers", "d_model", "d_ffn", "n_parameters", "n_ffn_parameters", "dtype", "device", "memory"):
        assert described[key] == whole[key], key
    roomy = Settings(data_dir=data_dir, device="cpu", max_memory=str(whole["memory"]["total_bytes"]))
    assert _describe_on_meta(str(llama), roomy, trust=False) is None  # fits: loaded as before


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "olmo2"])
def test_other_families_stream_equal(tiny_model, data_dir, tmp_path, family):
    """Scaled embeddings (Gemma), sliding/full attention per layer (Gemma 2/3), fused gate_up (Phi-3),
    post-norms (OLMo 2); one unsharded model.safetensors each."""
    path = tiny_model(family)
    _streamed_at_the_floor_equals_in_memory(path, data_dir, tmp_path)
