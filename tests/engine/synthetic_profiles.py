"""Small synthetic stored profiles with planted set-specific neurons (no model: numpy arrays through
the real ``write_profile``), for the profile-comparison and neuron-search tests of the engine, the
API and the UI.

Two profiles made with the same ``base_seed`` are "of one model": every neuron has the same baseline
mean and spread in both, and only the sample noise differs, so a neuron shifted in one of them by
``shift`` of its spreads is the one set-specific neuron there (d ≈ shift).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CODE_WORDS = ["return", "import", "class", "self", "for", "in", "if", "print", "lambda", "yield"]
PROSE_WORDS = ["the", "night", "river", "she", "said", "slowly", "heart", "window", "rain", "old"]

N_LAYERS, D_FFN, TOP_K = 3, 48, 4
#: planted in the code profile: A-specific (d ≈ +6), its top tokens are the word ``def``
CODE_NEURON = (1, 17)
#: planted in the prose profile: specific to prose (d ≈ −4 with code as A)
PROSE_NEURON = (2, 5)
SOURCE = "synthetic/tiny-glu"


def _tokens(words: list[str], n_samples: int, rng: np.random.Generator, special: str | None) -> list[list[str]]:
    """Each sample's token pieces (" word"); ``special`` appears in every other sample."""
    out = []
    for s in range(n_samples):
        pieces = [f" {w}" for w in rng.choice(words, size=8)]
        if special is not None and s % 2 == 0:
            pieces[3] = f" {special}"
        out.append(pieces)
    return out


def _top_tokens(pieces: list[str], planted: list[tuple[int, int]], special: str | None, rng: np.random.Generator
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer [d_ffn, K] values (|h| descending) and token indices: ``special`` tokens only for the planted neurons."""
    special_idx = np.array([i for i, p in enumerate(pieces) if special is not None and p == f" {special}"])
    plain_idx = np.array([i for i, p in enumerate(pieces) if special is None or p != f" {special}"])
    values, tokens = [], []
    for layer in range(N_LAYERS):
        tok = np.stack([rng.choice(plain_idx, size=TOP_K, replace=False) for _ in range(D_FFN)]).astype(np.int64)
        for pl, neuron in planted:
            if pl == layer and special_idx.size >= TOP_K:
                tok[neuron] = special_idx[:TOP_K]
        val = -np.sort(-rng.uniform(0.5, 2.0, size=(D_FFN, TOP_K)), axis=1)
        values.append(val.astype(np.float32))
        tokens.append(tok)
    return values, tokens


def _layer(sample_means: np.ndarray, groups: np.ndarray, rate: np.ndarray, top: tuple[np.ndarray, np.ndarray]):
    from moelab.engine.profiling.profiler import LayerStats

    gmeans = np.stack([sample_means[groups == g].mean(0) for g in np.unique(groups)]).astype(np.float64)
    mu, sigma = gmeans.mean(0), gmeans.std(0)
    return LayerStats(
        sample_means=sample_means.astype(np.float32), group_means=gmeans.astype(np.float32), mean=mu.astype(np.float32),
        std=sigma.astype(np.float32), cv=(sigma / (np.abs(mu) + 1e-6)).astype(np.float32), rate=rate.astype(np.float32),
        atopk_indices=np.zeros((4, 2), dtype=np.int16), h_hist=np.ones(5, dtype=np.int64),
        h_hist_edges=np.linspace(-1, 1, 6, dtype=np.float32), h_outside=np.zeros(2, dtype=np.int64), xtx=None,
        top_value=top[0], top_token=top[1],
    )


def synthetic_profile(out: Path, words: list[str], seed: int, planted: dict[tuple[int, int], float] | None = None,
                      special: str | None = None, n_samples: int = 10, base_seed: int = 1234, source: str = SOURCE,
                      d_ffn: int = D_FFN) -> Path:
    """Write a complete profile at ``out``: ``n_samples`` samples of ``words`` in two tasks; neuron
    ``(layer, j)`` of ``planted`` shifted by that many of its spreads; the planted neurons' top tokens
    are ``special``. Returns ``out``."""
    from moelab.engine.data.calibration import CalibrationSet, Sample
    from moelab.engine.profiling.profiler import ProfileResult, ProfileSettings
    from moelab.engine.profiling.store import write_profile

    planted = planted or {}
    base_rng, rng = np.random.default_rng(base_seed), np.random.default_rng(seed)
    base = base_rng.normal(0.0, 0.5, size=(N_LAYERS, d_ffn))
    spread = base_rng.uniform(0.05, 0.2, size=(N_LAYERS, d_ffn))
    base_rate = base_rng.uniform(0.0, 0.3, size=(N_LAYERS, d_ffn))
    samples = _tokens(words, n_samples, rng, special)
    pieces = [p for s in samples for p in s]
    groups = np.arange(n_samples) % 2
    top = _top_tokens(pieces, list(planted), special, rng)
    layers = []
    for i in range(N_LAYERS):
        means = base[i] + spread[i] * rng.normal(size=(n_samples, d_ffn))
        rate = np.clip(base_rate[i] + rng.normal(0, 0.01, size=d_ffn), 0, 1)
        for (pl, j), shift in planted.items():
            if pl == i:
                means[:, j] += shift * spread[i, j]
                rate[j] = min(1.0, rate[j] + 0.5)
        layers.append(_layer(means, groups, rate, (top[0][i], top[1][i])))
    cset = CalibrationSet(name=out.name, source="test",
                          samples=[Sample(text="".join(s).strip(), task=f"t{g}") for s, g in zip(samples, groups, strict=True)])
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    result = ProfileResult(
        settings=ProfileSettings(max_tokens=16, batch_tokens=64, atopk_k=2, feature_tokens=4, second_moment=False, top_tokens=TOP_K),
        model={"source": source, "family": "llama", "n_layers": N_LAYERS, "d_ffn": [d_ffn] * N_LAYERS},
        calibration={"id": cset.id, "name": cset.name, "source": cset.source, "n_samples": n_samples},
        group_basis="task", groups=["t0", "t1"], sample_group=groups, sample_tokens=lengths,
        feature_token_index=np.zeros((4, 2), dtype=np.int64), n_tokens=int(lengths.sum()), layers=layers,
        similarity_outputs=np.eye(N_LAYERS, dtype=np.float32), similarity_mlp_inputs=np.eye(N_LAYERS, dtype=np.float32),
        token_ids=np.arange(len(pieces), dtype=np.int32), token_pieces=np.array(pieces, dtype=object),
        token_repeated=np.zeros(len(pieces), dtype=bool),
    )
    return write_profile(result, cset, Path(out))


def code_and_prose(root: Path) -> tuple[Path, Path]:
    """The pair the tests compare: A on code words with ``CODE_NEURON`` planted (+6 spreads, top tokens
    " def"), B on prose words with ``PROSE_NEURON`` planted (+4 spreads)."""
    a = synthetic_profile(root / "code", CODE_WORDS, seed=1, planted={CODE_NEURON: 6.0}, special="def")
    b = synthetic_profile(root / "prose", PROSE_WORDS, seed=2, planted={PROSE_NEURON: 4.0})
    return a, b
