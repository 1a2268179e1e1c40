"""Each neuron's top-activating tokens (|h|, CM Eq. 1) against a brute force over every token.

The brute force runs each sample alone (no batching, no padding), keeps every h, and takes the
K largest |h| per neuron over all tokens with ``torch.topk``; a token whose whole prefix repeats
another sample's is counted once, in the sample whose ids sort first (found here with a plain
dictionary of prefixes, not the profiler's sorted-neighbour scan).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moelab.engine.data.calibration import CalibrationSet, Sample
from moelab.engine.models import load_model
from moelab.engine.profiling.profiler import ProfileSettings, profile_model, repeated_prefix
from moelab.engine.profiling.store import ProfileNotFound, StoredProfile, write_profile

from .test_profiling import make_set, reference

K = 6


def with_repeats() -> CalibrationSet:
    """The synthetic set plus samples sharing openings (a template) and one exact duplicate."""
    base = make_set(n=10)
    extra = [Sample(text="alpha beta gamma delta river stone cloud omega", task="task0", domain="d0"),
             Sample(text="alpha beta gamma delta sigma kappa", task="task1", domain="d1"),
             Sample(text="alpha beta gamma delta river stone cloud omega", task="task2", domain="d0")]
    return CalibrationSet(name="repeats", samples=base.samples + extra, source="test")


@pytest.fixture(scope="module")
def tiny(tiny_model, data_dir, one_thread):
    return load_model(str(tiny_model("llama")), data_dir=data_dir, device="cpu")


@pytest.fixture(scope="module")
def profiled(tiny):
    cset = with_repeats()
    s = ProfileSettings(max_tokens=40, batch_tokens=120, atopk_k=5, feature_tokens=100, hist_bins=21, top_tokens=K)
    return cset, s, profile_model(tiny, cset, s), reference(tiny, cset, s)


def brute_repeated(ids: list[list[int]]) -> np.ndarray:
    """Every (sample, position) whose prefix is also some earlier-sorting sample's prefix."""
    first: dict[tuple[int, ...], tuple[list[int], int]] = {}
    for s, seq in enumerate(ids):
        for p in range(len(seq)):
            key = tuple(seq[: p + 1])
            if key not in first or (seq, s) < first[key]:
                first[key] = (seq, s)
    return np.array([first[tuple(seq[: p + 1])][1] != s for s, seq in enumerate(ids) for p in range(len(seq))])


def test_repeated_prefixes_counted_once(tiny, profiled):
    cset, s, res, _ = profiled
    ids = [tiny.tokenizer(x.text, truncation=True, max_length=s.max_tokens)["input_ids"] for x in cset.samples]
    expected = brute_repeated(ids)
    assert expected.sum() >= 4 + 8  # the template's 4 words twice, the duplicate whole (and shared first words)
    np.testing.assert_array_equal(res.token_repeated, expected)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])[:-1]])
    np.testing.assert_array_equal(repeated_prefix([np.array(x) for x in ids], offsets, int(sum(map(len, ids)))), expected)
    assert res.token_ids.tolist() == [t for seq in ids for t in seq]


def test_top_tokens_equal_brute_force_topk(profiled):
    cset, s, res, raw = profiled
    for i, lay in enumerate(res.layers):
        h = torch.cat(raw["h"][i]).float()  # [n_tokens, d_ffn], samples back to back (CM Eq. 1 h)
        score = h.abs().masked_fill(torch.from_numpy(res.token_repeated)[:, None], float("-inf"))
        top = score.topk(K, dim=0)
        assert lay.top_token.shape == lay.top_value.shape == (h.shape[1], K)
        np.testing.assert_array_equal(lay.top_token, top.indices.T.numpy())
        np.testing.assert_allclose(lay.top_value, h.gather(0, top.indices).T.numpy(), rtol=1e-5, atol=1e-5)
        assert (np.diff(np.abs(lay.top_value), axis=1) <= 1e-6).all()  # |h| descending per neuron
        assert not res.token_repeated[lay.top_token].any()


def test_stored_top_tokens_and_token_table(tiny, profiled, tmp_path):
    cset, s, res, _ = profiled
    prof = StoredProfile.open(write_profile(res, cset, tmp_path / "p"))
    assert prof.has_top_tokens and prof.manifest["top_tokens"] == K
    for i, lay in enumerate(res.layers):
        value, token = prof.top_tokens(i)
        np.testing.assert_array_equal(value, lay.top_value)
        np.testing.assert_array_equal(token, lay.top_token)
    t = prof.tokens
    assert list(t.columns) == ["token", "sample", "position", "token_id", "piece", "repeated"]
    assert t["token"].tolist() == list(range(res.n_tokens)) and t["token_id"].tolist() == res.token_ids.tolist()
    n = prof.samples["n_tokens"].to_numpy()
    assert (t.groupby("sample")["position"].max().to_numpy() == n - 1).all()
    # the piece is the tokenizer's own decode of the id; the pieces of a sample rebuild its text
    for row in t.sample(20, random_state=0).itertuples():
        assert row.piece == tiny.tokenizer.decode([row.token_id])
    first = t[t["sample"] == 0]
    assert "".join(first["piece"]) == tiny.tokenizer.decode(first["token_id"].tolist())


def test_without_top_tokens_and_old_profiles_still_open(tiny, profiled, tmp_path):
    cset = make_set(n=4)
    res = profile_model(tiny, cset, ProfileSettings(max_tokens=16, batch_tokens=64, feature_tokens=20, hist_bins=11, top_tokens=0))
    prof = StoredProfile.open(write_profile(res, cset, tmp_path / "none"))
    assert not prof.has_top_tokens and prof.manifest["top_tokens"] == 0
    assert not (prof.path / "top_tokens.safetensors").exists() and not (prof.path / "tokens.parquet").exists()
    with pytest.raises(ProfileNotFound, match="re-profile"):
        prof.top_tokens(0)
    with pytest.raises(ProfileNotFound, match="re-profile"):
        _ = prof.tokens

    # a profile written before top tokens: no files, no manifest key, no setting
    cset, _, full, _ = profiled
    old = write_profile(full, cset, tmp_path / "old")
    (old / "top_tokens.safetensors").unlink()
    (old / "tokens.parquet").unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f not in ("top_tokens.safetensors", "tokens.parquet")]
    del manifest["top_tokens"], manifest["settings"]["top_tokens"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    prof = StoredProfile.open(old)
    assert not prof.has_top_tokens and prof.settings.top_tokens == 8  # the default fills the missing setting
    assert len(prof.cv_by_layer()) == 3


def test_fewer_tokens_than_k_pads_with_minus_one(tiny):
    cset = CalibrationSet(name="short", samples=[Sample(text="alpha beta", task="a"), Sample(text="gamma", task="b")], source="test")
    res = profile_model(tiny, cset, ProfileSettings(max_tokens=8, batch_tokens=8, feature_tokens=4, hist_bins=11, top_tokens=5))
    assert res.n_tokens == 3
    lay = res.layers[0]
    assert (lay.top_token[:, :3] >= 0).all() and (lay.top_token[:, 3:] == -1).all() and (lay.top_value[:, 3:] == 0).all()
    assert set(lay.top_token[0, :3].tolist()) == {0, 1, 2}
