"""Every profile statistic against a naive reference on a tiny model.

The reference runs each sample alone (no padding, no batching), keeps every raw tensor and
computes the statistics with the plainest formulas; the profiler batches with padding and
accumulates in streaming form. They must agree exactly or to 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moelab.engine.data.calibration import CalibrationSet, Sample
from moelab.engine.models import load_model
from moelab.engine.profiling.store import ProfileNotFound, StoredProfile, write_profile
from moelab.engine.profiling.profiler import ProfileError, ProfileSettings, profile_model
from moelab.engine.progress import Cancelled, Progress

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()


def make_set(n: int = 12, tasks: int = 3, seed: int = 0) -> CalibrationSet:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        length = int(rng.integers(8, 60))  # varied lengths: batches carry padding
        text = " ".join(rng.choice(WORDS, size=length))
        samples.append(Sample(text=f"{text} {i}", task=f"task{i % tasks}", domain=f"d{i % 2}"))
    return CalibrationSet(name="synthetic", samples=samples, source="test")


def reference(adapter, cset: CalibrationSet, s: ProfileSettings) -> dict:
    """Per-sample forward passes with every raw tensor kept."""
    L = adapter.n_layers
    raw = {k: [[] for _ in range(L)] for k in ("x", "g", "h", "out")}
    hooks = []
    for i, lay in enumerate(adapter.layers):
        hooks += [
            lay.mlp.register_forward_pre_hook(lambda m, a, i=i: raw["x"][i].append(a[0][0].clone())),
            lay.act_fn.register_forward_hook(lambda m, a, o, i=i: raw["g"][i].append(o[0].clone())),
            lay.down_proj.register_forward_pre_hook(lambda m, a, i=i: raw["h"][i].append(a[0][0].clone())),
            lay.block.register_forward_hook(
                lambda m, a, o, i=i: raw["out"][i].append((o[0] if isinstance(o, tuple) else o)[0].clone())
            ),
        ]
    with torch.no_grad():
        for sample in cset.samples:
            ids = adapter.tokenizer(sample.text, truncation=True, max_length=s.max_tokens, return_tensors="pt")
            adapter.decoder()(input_ids=ids["input_ids"], use_cache=False)
    for h in hooks:
        h.remove()
    return raw


@pytest.fixture(scope="module")
def tiny(tiny_model, data_dir):
    return load_model(str(tiny_model("llama")), data_dir=data_dir)


@pytest.fixture(scope="module")
def profiled(tiny):
    cset = make_set()
    s = ProfileSettings(max_tokens=48, batch_tokens=160, atopk_k=5, feature_tokens=10**6, hist_bins=21)
    return cset, s, profile_model(tiny, cset, s), reference(tiny, cset, s)


def test_activation_profiles_group_means_and_cv(profiled):
    cset, s, res, raw = profiled
    assert res.group_basis == "task" and res.groups == ["task0", "task1", "task2"]
    for i, lay in enumerate(res.layers):
        a = np.stack([g.mean(0).numpy() for g in raw["g"][i]])  # EW §3.1, signed
        np.testing.assert_allclose(lay.sample_means, a, rtol=1e-5, atol=1e-6)
        groups = np.array([int(x.task[-1]) for x in cset.samples])
        gm = np.stack([a[groups == t].mean(0) for t in range(3)])
        np.testing.assert_allclose(lay.group_means, gm, rtol=1e-5, atol=1e-6)
        mu, sd = gm.mean(0), gm.std(0)
        np.testing.assert_allclose(lay.mean, mu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lay.std, sd, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lay.cv, sd / (np.abs(mu) + s.cv_eps), rtol=1e-4, atol=1e-5)
        assert (lay.mean < 0).any(), "signed means: some SiLU gate means must be negative"


def test_atopk_rates_markers_and_histogram(profiled):
    cset, s, res, raw = profiled
    index = res.feature_token_index  # all tokens kept here: feature_tokens is large
    assert len(index) == res.n_tokens
    for i, lay in enumerate(res.layers):
        counts = np.zeros(lay.rate.shape[0])
        rows = {}
        for j, h in enumerate(raw["h"][i]):
            for t in range(h.shape[0]):  # naive: token by token
                top = sorted(torch.argsort(h[t].abs(), descending=True)[: s.atopk_k].tolist())
                counts[top] += 1
                rows[(j, t)] = top
        np.testing.assert_allclose(lay.rate, counts / res.n_tokens, rtol=0, atol=1e-7)
        for r, (j, t) in enumerate(index):
            assert lay.atopk_indices[r].tolist() == rows[(int(j), int(t))]
        # Histogram: every value counted once, inside or outside the range.
        allh = torch.cat(raw["h"][i]).flatten().numpy()
        assert lay.h_hist.sum() + lay.h_outside.sum() == allh.size
        ref, _ = np.histogram(allh, bins=lay.h_hist_edges)
        outside = (allh < lay.h_hist_edges[0]).sum() + (allh > lay.h_hist_edges[-1]).sum()
        assert np.abs(ref - lay.h_hist).sum() <= 2 and lay.h_outside.sum() == outside


def test_layer_similarities_and_second_moment(profiled):
    _, _, res, raw = profiled
    L = len(res.layers)
    for kind, mat in (("out", res.similarity_outputs), ("x", res.similarity_mlp_inputs)):
        per_layer = [torch.cat(raw[kind][i]) for i in range(L)]
        ref = np.ones((L, L))
        for a in range(L):
            for b in range(L):
                ref[a, b] = F.cosine_similarity(per_layer[a], per_layer[b], dim=-1).mean().item()
        np.testing.assert_allclose(mat, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(mat, mat.T)
        np.testing.assert_array_equal(np.diag(mat), np.ones(L))
    for i, lay in enumerate(res.layers):
        # Inputs differ from the unbatched run only by float32 rounding, hence 1e-5 not 1e-12.
        x = torch.cat(raw["x"][i]).double()
        ref = (x.T @ x).numpy()
        np.testing.assert_allclose(lay.xtx, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert lay.xtx.dtype == np.float64


def test_identical_across_runs_and_feature_sample_is_seeded(tiny):
    cset = make_set(seed=3)
    s = ProfileSettings(max_tokens=32, batch_tokens=64, feature_tokens=50, seed=7)
    r1, r2 = profile_model(tiny, cset, s), profile_model(tiny, cset, s)
    for a, b in zip(r1.layers, r2.layers):
        for field in ("sample_means", "cv", "rate", "atopk_indices", "h_hist", "xtx"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(r1.feature_token_index, r2.feature_token_index)
    assert len(r1.feature_token_index) == 50 and len(r1.layers[0].atopk_indices) == 50
    r3 = profile_model(tiny, cset, ProfileSettings(max_tokens=32, batch_tokens=64, feature_tokens=50, seed=8))
    assert not np.array_equal(r1.feature_token_index, r3.feature_token_index)


def test_group_basis_falls_back_to_samples_and_validates(tiny):
    cset = make_set(n=5, tasks=1)
    res = profile_model(tiny, cset, ProfileSettings(max_tokens=16, batch_tokens=32))
    assert res.group_basis == "sample" and len(res.groups) == 5
    with pytest.raises(ProfileError, match="at least 2"):
        profile_model(tiny, cset, ProfileSettings(max_tokens=16, batch_tokens=32, group_by="task"))
    with pytest.raises(ValueError, match="batch_tokens"):
        profile_model(tiny, cset, ProfileSettings(max_tokens=64, batch_tokens=32))


def test_normalized_atopk_variant_differs_and_is_counted(tiny):
    cset = make_set(n=4)
    raw = profile_model(tiny, cset, ProfileSettings(max_tokens=24, batch_tokens=48))
    norm = profile_model(tiny, cset, ProfileSettings(max_tokens=24, batch_tokens=48, atopk_normalized=True))
    for a, b in zip(raw.layers, norm.layers):
        assert a.rate.sum() == pytest.approx(b.rate.sum())  # K_a per token either way
    assert any(not np.array_equal(a.rate, b.rate) for a, b in zip(raw.layers, norm.layers))


def test_progress_and_cancellation(tiny):
    cset = make_set(n=8)
    seen = []
    profile_model(tiny, cset, ProfileSettings(max_tokens=16, batch_tokens=32), Progress(lambda *a: seen.append(a)))
    assert seen[0] == ("profile", 0, seen[-1][2]) and seen[-1][1] == seen[-1][2] > 1
    calls = iter(range(100))
    with pytest.raises(Cancelled):
        profile_model(
            tiny, cset, ProfileSettings(max_tokens=16, batch_tokens=32), Progress(should_cancel=lambda: next(calls) >= 2)
        )
    assert all(not lay.mlp._forward_pre_hooks for lay in tiny.layers), "hooks must be removed"


def test_store_round_trip_and_interrupted_write(tiny, tmp_path, profiled):
    cset, s, res, _ = profiled
    out = write_profile(res, cset, tmp_path / "p1")
    prof = StoredProfile.open(out)
    assert prof.manifest["cv_basis"] == "task" and prof.manifest["settings"]["atopk_k"] == 5
    nt = prof.neurons
    assert list(nt.columns)[:7] == ["layer", "neuron", "mean", "abs_mean", "std", "cv", "rate"]
    assert len(nt) == sum(len(lay.cv) for lay in res.layers)
    np.testing.assert_array_equal(nt[nt.layer == 1].cv.to_numpy(), res.layers[1].cv)
    np.testing.assert_array_equal(prof.xtx(2), res.layers[2].xtx)
    np.testing.assert_array_equal(prof.similarity("outputs"), res.similarity_outputs)
    np.testing.assert_array_equal(prof.sample_means(0), res.layers[0].sample_means)
    np.testing.assert_array_equal(prof.atopk(0), res.layers[0].atopk_indices)
    assert prof.samples.task.tolist() == [x.task for x in cset.samples]
    # A crash mid-write leaves the previous profile intact and nothing that looks complete.
    before = (out / "manifest.json").read_text()
    from moelab.engine.profiling import store as profile_store

    original = profile_store.save_file

    def crash(*a, **k):
        raise OSError("disk full")

    profile_store.save_file = crash
    try:
        with pytest.raises(OSError):
            write_profile(res, cset, out)
        with pytest.raises(OSError):
            write_profile(res, cset, tmp_path / "p2")
    finally:
        profile_store.save_file = original
    assert (out / "manifest.json").read_text() == before
    StoredProfile.open(out)
    with pytest.raises(ProfileNotFound):
        StoredProfile.open(tmp_path / "p2")
    assert [p.name for p in tmp_path.iterdir()] == ["p1"]
    # A directory without a manifest is refused with the reason.
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "neurons.parquet").write_bytes(b"")
    with pytest.raises(ProfileNotFound, match="interrupted"):
        StoredProfile.open(tmp_path / "half")
    json.loads(before)
