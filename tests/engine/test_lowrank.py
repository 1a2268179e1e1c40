"""MIDAS whitened low-rank factorisation (MI Eqs. 1–2) against plain SVD, on data."""

import numpy as np
import pytest

from moelab.engine.core.lowrank import data_error, rank_for_ratio, whitened_lowrank, whitening


def anisotropic_inputs(n=2000, d=48, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(d, d)) * np.logspace(0, -2, d)  # a few strong input directions
    return rng.normal(size=(n, d)) @ mix.T


def test_error_falls_with_rank_and_beats_plain_svd():
    rng = np.random.default_rng(1)
    x = anisotropic_inputs()
    w = rng.normal(size=(64, 48))
    xtx = x.T @ x
    white = whitening(xtx)
    assert white.jitter == 0.0
    np.testing.assert_allclose((white.S @ white.S.T).numpy(), xtx, rtol=1e-10, atol=1e-8)  # Eq. 1
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    errors = []
    for r in (2, 4, 8, 16, 32):
        lr = whitened_lowrank(w, white, r)
        ours = data_error(w, lr.A @ lr.B, xtx)
        plain = data_error(w, (u[:, :r] * s[:r]) @ vt[:r], xtx)
        # Direct check on the activations themselves, not only through XᵀX.
        direct = np.linalg.norm(x @ (w - (lr.A @ lr.B).numpy()).T) / np.linalg.norm(x @ w.T)
        assert direct == pytest.approx(ours, rel=1e-6)
        assert ours < plain, f"rank {r}: whitened {ours:.4f} should beat plain SVD {plain:.4f}"
        errors.append(ours)
    assert all(b < a for a, b in zip(errors, errors[1:]))
    full = whitened_lowrank(w, white, 48)
    np.testing.assert_allclose((full.A @ full.B).numpy(), w, atol=1e-8)


def test_smallest_jitter_for_rank_deficient_moments():
    x = anisotropic_inputs(n=10, d=32)  # fewer tokens than features: M is singular
    xtx = x.T @ x
    white = whitening(xtx)

    def factorises(jitter):
        try:
            np.linalg.cholesky(xtx + jitter * np.eye(32))
            return True
        except np.linalg.LinAlgError:
            return False

    ladder = [0.0] + [np.mean(np.diag(xtx)) * 10.0**k for k in range(-12, 1)]
    assert white.jitter > 0 and white.jitter == next(j for j in ladder if factorises(j))
    np.testing.assert_allclose((white.S @ white.S.T).numpy(), xtx + white.jitter * np.eye(32), rtol=1e-9, atol=1e-9)


def test_rank_for_ratio_and_bad_input():
    assert rank_for_ratio(1536, 576, 0.5) == int(0.5 * 1536 * 576 / (1536 + 576))
    assert rank_for_ratio(10, 10, 0.01) == 1
    with pytest.raises(ValueError, match="ratio"):
        rank_for_ratio(10, 10, 0.0)
    with pytest.raises(ValueError, match="square"):
        whitening(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="rank"):
        whitened_lowrank(np.ones((4, 3)), whitening(np.eye(3)), 5)


def test_factors_are_a_balanced_projection_independent_of_the_token_count():
    """W' = U_r Σ_r V_rᵀ S⁻¹ = U_r U_rᵀ W (MI Eq. 2): the stored factors reproduce that map, split
    each rank-one component evenly, and stay the same when XᵀX counts more tokens of the same data."""
    rng = np.random.default_rng(2)
    x = anisotropic_inputs()
    w = rng.normal(size=(64, 48))
    lr = whitened_lowrank(w, whitening(x.T @ x), 8)
    u = np.linalg.svd(w @ np.linalg.cholesky(x.T @ x), full_matrices=False)[0][:, :8]
    np.testing.assert_allclose((lr.A @ lr.B).numpy(), u @ u.T @ w, atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(lr.A.numpy(), axis=0), np.linalg.norm(lr.B.numpy(), axis=1), rtol=1e-10)
    more = whitened_lowrank(w, whitening(1000.0 * x.T @ x), 8)
    np.testing.assert_allclose(np.abs(more.A.numpy()), np.abs(lr.A.numpy()), rtol=1e-6, atol=1e-9)  # up to each component's sign
    np.testing.assert_allclose(np.abs(more.B.numpy()), np.abs(lr.B.numpy()), rtol=1e-6, atol=1e-9)
    # off the calibration data: never more output than the dense map
    z = rng.normal(size=(300, 48)) * 100
    assert np.all(np.linalg.norm(z @ (lr.A @ lr.B).numpy().T, axis=1) <= np.linalg.norm(z @ w.T, axis=1) * (1 + 1e-9))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device"))])
def test_factorisation_runs_in_float64_on_the_inputs_device(device):
    """The factorisations run in torch on the job's device (a GPU at 7B), in float64 there,
    and agree with numpy's LAPACK on the same inputs."""
    import torch

    rng = np.random.default_rng(3)
    x = anisotropic_inputs(n=500, d=24)
    w = rng.normal(size=(40, 24))
    white = whitening(torch.from_numpy(x.T @ x).to(device))
    lr = whitened_lowrank(torch.from_numpy(w).to(device), white, 6)
    assert white.S.device.type == lr.A.device.type == device and lr.A.dtype == lr.B.dtype == torch.float64
    np.testing.assert_allclose(white.S.cpu().numpy(), np.linalg.cholesky(x.T @ x), rtol=1e-9, atol=1e-9)
    u = np.linalg.svd(w @ np.linalg.cholesky(x.T @ x), full_matrices=False)[0][:, :6]
    np.testing.assert_allclose((lr.A @ lr.B).cpu().numpy(), u @ u.T @ w, atol=1e-9)


def matrix_with_spectrum(rows, cols, singular_values, seed=4):
    """``U diag(σ) Vᵀ`` with random orthonormal U, V: a matrix whose singular values are known."""
    rng = np.random.default_rng(seed)
    k = len(singular_values)
    u = np.linalg.qr(rng.normal(size=(rows, k)))[0]
    v = np.linalg.qr(rng.normal(size=(cols, k)))[0]
    return (u * singular_values) @ v.T


@pytest.mark.parametrize("shape", [(120, 48), (48, 120)], ids=["tall", "wide"])
def test_the_gram_route_gives_the_svds_subspace_and_singular_values(shape):
    """``top_left_singular`` (module doc): U_r from the smaller Gram matrix's eigenvectors equals the
    SVD's, as a projector and column by column up to sign, at condition number 10⁴; its columns are
    orthonormal to rounding, and the singular values are the SVD's."""
    import torch

    from moelab.engine.core.lowrank import top_left_singular

    sigma = np.logspace(0, -4, min(shape))
    a = torch.from_numpy(matrix_with_spectrum(*shape, sigma))
    for rank in (1, 7, 30, min(shape)):
        u, s = top_left_singular(a, rank)
        ref_u, ref_s, _ = torch.linalg.svd(a, full_matrices=False)
        ref_u = ref_u[:, :rank]
        assert u.shape == (shape[0], rank)
        np.testing.assert_allclose((u @ u.T).numpy(), (ref_u @ ref_u.T).numpy(), atol=1e-11)
        np.testing.assert_allclose(np.abs(np.sum(u.numpy() * ref_u.numpy(), axis=0)), 1.0, atol=1e-10)
        np.testing.assert_allclose((u.T @ u).numpy(), np.eye(rank), atol=1e-13)
        np.testing.assert_allclose(s.numpy(), ref_s.numpy(), rtol=1e-8, atol=1e-15)
        np.testing.assert_allclose(s.numpy(), sigma, rtol=1e-8)


def test_the_svd_takes_over_where_the_gram_matrix_loses_the_subspace(monkeypatch):
    """Ranks that reach σ_r < GRAM_MIN_RATIO · σ_1 use the SVD. Without that fallback the Gram
    route's subspace is wrong there (the eigenvalues of AᵀA below ε·σ_1² are rounding noise)."""
    import torch

    from moelab.engine.core import lowrank

    sigma = np.logspace(0, -12, 48)
    a = torch.from_numpy(matrix_with_spectrum(120, 48, sigma, seed=5))
    rank = 40  # σ_40 ≈ 3·10⁻¹⁰
    ref_u = torch.linalg.svd(a, full_matrices=False)[0][:, :rank]
    u, s = lowrank.top_left_singular(a, rank)
    np.testing.assert_allclose((u @ u.T).numpy(), (ref_u @ ref_u.T).numpy(), atol=1e-9)
    np.testing.assert_allclose(s.numpy(), sigma, rtol=1e-6, atol=1e-15)
    monkeypatch.setattr(lowrank, "GRAM_MIN_RATIO", 0.0)
    gram_u, _ = lowrank.top_left_singular(a, rank)
    assert np.abs((gram_u @ gram_u.T - ref_u @ ref_u.T).numpy()).max() > 1e-3


@pytest.mark.parametrize("shape", [(64, 48), (40, 90)], ids=["tall", "wide"])
def test_projection_errors_are_the_data_errors_of_each_expert_on_each_set(shape):
    """``projection_errors[j][k]`` (from U_j and W S_k) is ``data_error`` of expert j's A B on set k's
    moment, the one its whitening factorised (M_k plus jitter: set 1 has fewer tokens than inputs)."""
    from moelab.engine.core.lowrank import projection_errors

    rng = np.random.default_rng(6)
    w = rng.normal(size=shape)
    moments = [x.T @ x for x in (anisotropic_inputs(n=500, d=shape[1], seed=7),
                                 anisotropic_inputs(n=shape[1] // 2, d=shape[1], seed=8))]
    whites = [whitening(m) for m in moments]
    assert whites[0].jitter == 0.0 < whites[1].jitter
    experts = [whitened_lowrank(w, white, 9) for white in whites]
    got = projection_errors(experts)
    for j, e in enumerate(experts):
        for k, white in enumerate(whites):
            fitted_moment = (white.S @ white.S.T).numpy()
            assert got[j][k] == pytest.approx(data_error(w, e.A @ e.B, fitted_moment), rel=1e-9)
    assert got[0][0] < got[1][0] and got[1][1] < got[0][1]  # each expert is best on its own set
    full = [whitened_lowrank(w, white, min(shape)) for white in whites]
    assert max(map(max, projection_errors(full))) < 1e-6
