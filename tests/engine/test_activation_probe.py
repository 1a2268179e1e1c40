"""Neuron activations on any text (``evaluation.activations``, ``runs.run_activation_probe``) on a tiny
random Llama: the value reported for a token is h = act(x W_gate) ⊙ (x W_up) recomputed by hand from
the layer's weights and its MLP input, and at a neuron's top calibration token it is the value the
profile stored (the same text, so the same context); bad requests are refused with what to fix."""

from __future__ import annotations

import time

import pytest
import torch

from moelab.engine.data.calibration import CalibrationSet, Sample
from moelab.engine.evaluation.activations import MAX_ACTIVATION_NEURONS, neuron_activations
from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.profiling.store import StoredProfile, write_profile
from moelab.engine.runs import run_activation_probe

TEXT = "The quick brown fox jumps over the lazy dog, then def f(x): return x * 2"
SAMPLES = ["alpha beta gamma delta river stone cloud omega", "the cat sat on the mat and looked at the moon",
           "def f(x): return x * 2 if x else None"]


@pytest.fixture(scope="module")
def tiny(tiny_model, data_dir, one_thread):
    return load_model(str(tiny_model("llama")), data_dir=data_dir, device="cpu")


@pytest.fixture(scope="module")
def profile_dir(tiny, tmp_path_factory):
    cset = CalibrationSet(name="acts", samples=[Sample(text=t, task=f"t{i}", domain="d") for i, t in enumerate(SAMPLES)],
                          source="test")
    s = ProfileSettings(max_tokens=40, batch_tokens=120, atopk_k=5, feature_tokens=20, hist_bins=11, top_tokens=4)
    out = tmp_path_factory.mktemp("acts") / "profile"
    write_profile(profile_model(tiny, cset, s), cset, out)
    return out


def _by_hand(tiny, ids: list[int], layer: int) -> torch.Tensor:
    """h [seq, d_ffn] from the MLP input and the layer's own weights: act(x W_gateᵀ) ⊙ (x W_upᵀ)."""
    seen: dict[str, torch.Tensor] = {}
    lay = tiny.layers[layer]
    handle = lay.mlp.register_forward_pre_hook(lambda _m, a: seen.__setitem__("x", a[0][0].clone()))
    try:
        with torch.no_grad():
            tiny.model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    x = seen["x"].double()
    gate, up = x @ lay.gate_weight().double().T, x @ lay.up_weight().double().T
    return (torch.nn.functional.silu(gate) * up).float()  # the tiny Llama's act is SiLU


def test_activation_equals_the_hand_computed_h(tiny):
    layer, neurons = 1, [0, 5, 17]
    assert tiny.activation in ("silu", "swish")
    out = neuron_activations(tiny, TEXT, layer, neurons)
    assert out["token_ids"] == tiny.tokenizer(TEXT)["input_ids"] and len(out["tokens"]) == len(out["token_ids"])
    want = _by_hand(tiny, out["token_ids"], layer)
    got = torch.tensor(out["activations"])  # [neurons, tokens]
    assert got.shape == (len(neurons), len(out["token_ids"]))
    torch.testing.assert_close(got, want[:, neurons].T, atol=1e-5, rtol=0)


def test_a_top_token_shows_the_profiles_stored_value(tiny, profile_dir, data_dir):
    profile = StoredProfile.open(profile_dir)
    layer, neuron = 0, 3
    values, tokens = profile.top_tokens(layer)
    row = profile.tokens.iloc[int(tokens[neuron][0])]  # the neuron's largest-|h| calibration token
    text = SAMPLES[int(row["sample"])]
    out = run_activation_probe(profile_dir, text=text, layer=layer, neurons=[neuron, 7], data_dir=data_dir,
                               loader=lambda *a, **k: tiny)
    assert out["activations"][0][int(row["position"])] == pytest.approx(float(values[neuron][0]), abs=1e-5)
    ref = out["reference"][0]
    assert ref["neuron"] == neuron and ref["top_value"] == pytest.approx(float(values[neuron][0]))
    nt = profile.neurons
    assert ref["gate_mean"] == pytest.approx(float(nt[(nt.layer == layer) & (nt.neuron == neuron)]["mean"].iloc[0]))
    assert out["kind"] == "activation" and out["text"] == text and out["timings"]["total_s"] > 0


def test_bad_requests_are_refused_with_what_to_fix(tiny, profile_dir, data_dir):
    def probe(**kw):
        args = {"text": TEXT, "layer": 0, "neurons": [0]} | kw
        return run_activation_probe(profile_dir, data_dir=data_dir, loader=lambda *a, **k: tiny, **args)

    d_ffn = tiny.layers[0].d_ffn
    with pytest.raises(ValueError, match=r"layer: the model has layers 0 … \d+ \(got 99\)"):
        probe(layer=99)
    with pytest.raises(ValueError, match=f"neurons: layer 0 has {d_ffn} neurons"):
        probe(neurons=[d_ffn])
    with pytest.raises(ValueError, match=f"at most {MAX_ACTIVATION_NEURONS}"):
        probe(neurons=list(range(MAX_ACTIVATION_NEURONS + 1)))
    with pytest.raises(ValueError, match="at most 512: shorten it"):
        probe(text="word " * 600)


def test_latency_on_the_tiny_model(tiny, profile_dir, data_dir):
    t0 = time.perf_counter()
    out = run_activation_probe(profile_dir, text=TEXT * 6, layer=1, neurons=list(range(64)), data_dir=data_dir,
                               loader=lambda *a, **k: tiny)
    seconds = time.perf_counter() - t0
    print(f"activation probe: {len(out['token_ids'])} tokens × 64 neurons in {seconds * 1000:.1f} ms")
    assert seconds < 5


def test_cli_prints_every_tokens_activation(tiny, profile_dir):
    from click.testing import CliRunner

    from moelab.cli import main

    r = CliRunner().invoke(main, ["probe", "activation", "--profile", str(profile_dir), "--layer", "1", "--neuron", "0",
                                  "--neuron", "5", "--text", TEXT, "--quiet"])
    assert r.exit_code == 0, r.output
    ids = tiny.tokenizer(TEXT)["input_ids"]
    want = neuron_activations(tiny, TEXT, 1, [0, 5])["activations"]
    rows = [line.split() for line in r.output.splitlines()[1:1 + len(ids)]]
    assert [float(row[-2]) for row in rows] == pytest.approx(want[0], abs=1e-4)
    assert [float(row[-1]) for row in rows] == pytest.approx(want[1], abs=1e-4)
    bad = CliRunner().invoke(main, ["probe", "activation", "--profile", str(profile_dir), "--layer", "9", "--neuron", "0", "--text", "x"])
    assert bad.exit_code != 0 and "layer: the model has layers" in bad.output
