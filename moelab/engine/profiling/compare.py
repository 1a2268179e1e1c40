"""Two profiles of one model compared neuron by neuron: which neurons are specific to one set.

A researcher profiles a model on, say, a code set (A) and a literature set (B) and asks which FFN
neurons fire on code but not on literature. Every profile stores, per layer, each sample's
signed token-mean gate activation ``a_{s,j} = mean_tokens act(x W_gate)_j`` (EW §3.1's
``A_ℓ``, ``activations.safetensors``), so each neuron has a distribution over the samples of
each set. The set-specificity of neuron j is the standardised difference of its means
(Cohen's d with the two variances averaged)::

    d_j = (μ_A,j − μ_B,j) / sqrt((σ_A,j² + σ_B,j²) / 2 + ε²)

with ``μ``, ``σ`` the mean and standard deviation (ddof = 1) of ``a_{s,j}`` over the samples of
each profile. Positive: the neuron is more active on A's text; negative: on B's.

Why this score:

* it is an *effect size*: the gap in units of the spread of the neuron's own activation across
  samples, so it compares neurons of very different scales (a raw difference of means would rank
  the loudest neurons first, specific or not) and does not grow with the number of samples (a
  t statistic or a p-value would call every neuron "specific" on a large enough set);
* a ratio of means is undefined or flips sign near zero, and signed SiLU/GELU means often are;
* the activation rate (ATopK, CM Eq. 4) is reported too but not used: it counts how often a
  neuron is among a token's K_a largest |h|, a rank among neurons that moves when *other*
  neurons change;
* the profile's stored ``std`` is not used: it is the spread across the CV's groups (EW Eq. 3:
  tasks, domains or samples, whichever the profile was made with), a handful of values whose
  meaning differs between profiles; the per-sample means exist in every profile and give the
  same kind of σ on both sides.

Significance. An effect size alone is not evidence: with a few dozen samples, a neuron whose activation barely
varies gets a large |d| from noise (d of 17 on 32 samples), and a layer has hundreds of neurons to be lucky with.
So each neuron's difference of means is also tested, Welch's t-test (unequal variances, two-sided) over the same
per-sample means, and the p-values of *every* neuron of *every* layer (one family: the whole comparison) are
controlled for false discoveries by Benjamini–Hochberg: a neuron's ``q`` is the smallest false-discovery rate
at which it would be called. A neuron is **set-specific** when ``|d| ≥ threshold`` (a large gap) *and*
``q ≤ fdr`` (unlikely to be chance, with at most ``fdr`` of the neurons so called expected to be false); the shares
report both counts, so a user sees how many large gaps the test keeps. Choices (not in the papers, which do not
compare sets neuron by neuron): Welch's test because the two sets' spreads differ; BH (not Bonferroni) because
the question is "which of many", where a controlled share of false calls is the useful guarantee; the samples
treated as independent draws of each set's text.

``ε`` (default 1e-6) keeps a neuron that is constant on both sets finite (d = 0 when its two
means are equal too). The means reported next to d are the same sample means (every sample
weighs the same), which can differ slightly from the card's ``mean`` (averaged over the CV's
groups) when the groups have different sizes.

numpy only (the API computes this in its own process, without torch), vectorised over neurons:
one pass over the layers reads each profile's ``[samples, d_ffn]`` array once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, Sequence

import numpy as np

#: what ``ProfileComparison.score`` says the numbers are
SCORE = "d = (μ_A − μ_B) / sqrt((σ_A² + σ_B²) / 2 + ε²) over per-sample mean gate activations (Cohen's d); > 0: specific to A"

#: |d| at and above which a neuron counts as set-specific by default (Cohen's "large" is 0.8)
DEFAULT_THRESHOLD = 1.0
#: the false-discovery rate (Benjamini–Hochberg q) at or below which a large |d| counts
DEFAULT_FDR = 0.05
DEFAULT_EPS = 1e-6

Side = Literal["a", "b"]


class CompareError(ValueError):
    """The two profiles cannot be compared as asked; the message says what to change."""


class DifferentModels(CompareError):
    """The profiles are of different models: neuron j of one is not neuron j of the other."""


class ComparableProfile(Protocol):
    """What a comparison reads of a profile (``store.StoredProfile`` has it)."""

    manifest: dict[str, Any]

    def sample_means(self, layer: int) -> np.ndarray: ...

    def column_by_layer(self, column: str) -> list[np.ndarray]: ...


def _describe(manifest: dict[str, Any]) -> str:
    model = manifest.get("model") or {}
    d_ffn = [int(x) for x in manifest.get("d_ffn", [])]
    width = str(d_ffn[0]) if len(set(d_ffn)) == 1 else "/".join(map(str, d_ffn))
    return f"a profile of {model.get('source') or 'an unrecorded model'} ({manifest.get('n_layers')} layers, d_ffn {width})"


def check_same_model(a: dict[str, Any], b: dict[str, Any]) -> None:
    """DifferentModels unless the two manifests describe profiles of one model: the same source,
    layer count and FFN widths (neuron j of one model is not neuron j of another)."""
    shape_a, shape_b = (a.get("n_layers"), list(a.get("d_ffn", []))), (b.get("n_layers"), list(b.get("d_ffn", [])))
    source_a, source_b = (a.get("model") or {}).get("source"), (b.get("model") or {}).get("source")
    if shape_a == shape_b and source_a == source_b:
        return
    what = "different models" if shape_a == shape_b else "models of different shapes"
    raise DifferentModels(f"A is {_describe(a)}; B is {_describe(b)}: these are {what}, so their neurons cannot be "
                          "compared; choose two profiles of the same model")


@dataclass(frozen=True)
class Moments:
    """Mean and standard deviation (ddof = 1) of each neuron's per-sample activation, over ``n`` samples."""

    mean: np.ndarray
    std: np.ndarray
    n: int


def sample_moments(sample_means: np.ndarray) -> Moments:
    """``sample_means``: [samples, d_ffn] (EW A_ℓ). float64 sums: a 240-sample float32 mean is exact enough,
    but the variance of nearly constant neurons is not."""
    values = np.asarray(sample_means, dtype=np.float64)
    n = int(values.shape[0])
    if n < 2:
        raise CompareError(f"a profile over {n} sample has no spread to compare against; profile at least 2 samples")
    return Moments(values.mean(axis=0), values.std(axis=0, ddof=1), n)


def welch_p(a: Moments, b: Moments) -> np.ndarray:
    """Two-sided p-value of Welch's t-test for μ_A = μ_B, per neuron (module docstring); 1 where both sets are
    constant (no evidence either way)."""
    from scipy.stats import ttest_ind_from_stats

    with np.errstate(divide="ignore", invalid="ignore"):
        p = ttest_ind_from_stats(a.mean, a.std, a.n, b.mean, b.std, b.n, equal_var=False).pvalue
    return np.nan_to_num(np.asarray(p, dtype=np.float64), nan=1.0)


def bh_q(p: np.ndarray) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (q) of one family of tests."""
    from scipy.stats import false_discovery_control

    return false_discovery_control(np.clip(p, 0.0, 1.0), method="bh") if p.size else p


def specificity(a: Moments, b: Moments, eps: float = DEFAULT_EPS) -> np.ndarray:
    """Signed d of every neuron (module docstring); > 0: more active on A."""
    pooled = np.sqrt((a.std**2 + b.std**2) / 2.0 + eps**2)
    return np.nan_to_num((a.mean - b.mean) / pooled, nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class LayerComparison:
    """One layer's neurons in A and B (arrays of length d_ffn)."""

    layer: int
    d: np.ndarray
    p: np.ndarray  # Welch's two-sided p-value
    q: np.ndarray  # Benjamini–Hochberg q over every neuron of the comparison (filled by compare_profiles)
    mean_a: np.ndarray
    mean_b: np.ndarray
    std_a: np.ndarray
    std_b: np.ndarray
    rate_a: np.ndarray
    rate_b: np.ndarray
    cv_a: np.ndarray
    cv_b: np.ndarray

    def row(self, neuron: int) -> dict[str, Any]:
        """One neuron's numbers as plain floats."""
        out: dict[str, Any] = {"layer": self.layer, "neuron": int(neuron)}
        for name in ("d", "p", "q", "mean_a", "mean_b", "std_a", "std_b", "rate_a", "rate_b", "cv_a", "cv_b"):
            out[name] = float(getattr(self, name)[neuron])
        return out


@dataclass
class ProfileComparison:
    """Every layer of two profiles of one model compared; ``n_samples`` = (A's, B's)."""

    layers: list[LayerComparison]
    n_samples: tuple[int, int]
    eps: float = DEFAULT_EPS
    score: str = field(default=SCORE)

    @property
    def d_ffn(self) -> list[int]:
        return [len(lay.d) for lay in self.layers]

    def shares(self, threshold: float = DEFAULT_THRESHOLD, fdr: float = DEFAULT_FDR) -> list[dict[str, Any]]:
        """Per layer: how many neurons are specific to A (d ≥ threshold and q ≤ fdr) and to B (d ≤ −threshold and
        q ≤ fdr), their shares, and how many had the large gap alone (``n_large_*``: before the test)."""
        if not threshold > 0:
            raise CompareError(f"threshold must be > 0 (got {threshold})")
        if not 0 < fdr <= 1:
            raise CompareError(f"fdr must be in (0, 1] (got {fdr})")
        out = []
        for lay in self.layers:
            found = lay.q <= fdr
            large_a, large_b = lay.d >= threshold, lay.d <= -threshold
            n_a, n_b = int((large_a & found).sum()), int((large_b & found).sum())
            n = len(lay.d)
            out.append({"layer": lay.layer, "d_ffn": n, "n_specific_a": n_a, "n_specific_b": n_b,
                        "share": (n_a + n_b) / n, "share_a": n_a / n, "share_b": n_b / n,
                        "n_large_a": int(large_a.sum()), "n_large_b": int(large_b.sum())})
        return out

    def top(self, n: int, side: Side = "a") -> list[dict[str, Any]]:
        """The ``n`` most A-specific (largest d) or B-specific (smallest d) neurons over all layers, most specific
        first (ties: lower layer, then lower neuron), each with its numbers in both sets."""
        if n <= 0:
            return []
        flat = np.concatenate([lay.d for lay in self.layers])
        score = flat if side == "a" else -flat
        k = min(n, flat.size)
        pick = np.argpartition(-score, k - 1)[:k] if k < flat.size else np.arange(flat.size)
        pick = pick[np.lexsort((pick, -score[pick]))]  # by score descending, then by flat index (layer, neuron)
        starts = np.cumsum([0] + self.d_ffn[:-1])
        layer_of = np.searchsorted(starts, pick, side="right") - 1
        return [self.layers[int(li)].row(int(p - starts[li])) for p, li in zip(pick, layer_of, strict=True)]

    def busiest_layer(self, threshold: float = DEFAULT_THRESHOLD, fdr: float = DEFAULT_FDR) -> int:
        """The layer with the largest share of specific neurons (the first of equals): where to look first."""
        shares = [s["share"] for s in self.shares(threshold, fdr)]
        return int(np.argmax(shares)) if shares else 0


def _layer(a: ComparableProfile, b: ComparableProfile, i: int, columns: dict[str, Sequence[list[np.ndarray]]],
           eps: float) -> tuple[LayerComparison, int, int]:
    ma, mb = sample_moments(a.sample_means(i)), sample_moments(b.sample_means(i))
    f32 = lambda v: np.asarray(v, dtype=np.float32)  # noqa: E731  (payload-sized copies)
    lay = LayerComparison(
        layer=i, d=f32(specificity(ma, mb, eps)), p=welch_p(ma, mb), q=np.ones(len(ma.mean)), mean_a=f32(ma.mean), mean_b=f32(mb.mean), std_a=f32(ma.std), std_b=f32(mb.std),
        rate_a=f32(columns["rate"][0][i]), rate_b=f32(columns["rate"][1][i]), cv_a=f32(columns["cv"][0][i]), cv_b=f32(columns["cv"][1][i]),
    )
    return lay, ma.n, mb.n


def compare_profiles(a: ComparableProfile, b: ComparableProfile, eps: float = DEFAULT_EPS) -> ProfileComparison:
    """Compare every layer of ``a`` and ``b`` (profiles of one model; DifferentModels otherwise)."""
    check_same_model(a.manifest, b.manifest)
    if not eps > 0:
        raise CompareError(f"eps must be > 0 (got {eps})")
    columns = {c: (a.column_by_layer(c), b.column_by_layer(c)) for c in ("rate", "cv")}
    layers, n = [], (0, 0)
    for i in range(int(a.manifest["n_layers"])):
        lay, n_a, n_b = _layer(a, b, i, columns, eps)
        layers.append(lay)
        n = (n_a, n_b)
    q = np.split(bh_q(np.concatenate([lay.p for lay in layers])), np.cumsum([len(lay.p) for lay in layers])[:-1])
    layers = [replace(lay, q=qi) for lay, qi in zip(layers, q, strict=True)]
    return ProfileComparison(layers=layers, n_samples=n, eps=eps)
