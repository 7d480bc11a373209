"""RoPE (RoFormer, arXiv 2104.09864) and its length-extension scalings against NumPy references.

The references build RoFormer's block-diagonal rotation W_m (eq. 15 / 34) explicitly; the
rotate-half layout is the same rotation on permuted features. Scalings: linear position
interpolation (Chen et al. 2023, arXiv 2306.15595), NTK-aware theta scaling, YaRN (Peng et al.
2023, arXiv 2309.00071).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from copejax.positions import registry
from copejax.positions.base import AttentionContext, Dims
from copejax.positions.rope import apply_rope, scaled_inv_freq
from tests.conftest import tiny_config


def roformer_thetas(d: int, base: float) -> np.ndarray:
    """theta_i = base^(-2(i-1)/d), i = 1..d/2."""
    return np.array([base ** (-2.0 * (i - 1) / d) for i in range(1, d // 2 + 1)])


def rotation_matrix(m: float, thetas: np.ndarray) -> np.ndarray:
    """RoFormer's W_m: 2x2 blocks [[cos m t, -sin m t], [sin m t, cos m t]] on the diagonal."""
    d = 2 * len(thetas)
    w = np.zeros((d, d))
    for i, theta in enumerate(thetas):
        c, s = math.cos(m * theta), math.sin(m * theta)
        w[2 * i, 2 * i], w[2 * i, 2 * i + 1] = c, -s
        w[2 * i + 1, 2 * i], w[2 * i + 1, 2 * i + 1] = s, c
    return w


def half_to_pairs(d: int) -> list[int]:
    """Feature order that puts rotate-half's pairs (i, i + d/2) next to each other."""
    order = []
    for i in range(d // 2):
        order += [i, i + d // 2]
    return order


def reference_rope(x: np.ndarray, m: float, thetas: np.ndarray, layout: str) -> np.ndarray:
    """Rotates the first 2 len(thetas) features of the vector x by W_m; the rest pass through."""
    d = 2 * len(thetas)
    x = x.astype(np.float64)
    rot, rest = x[:d], x[d:]
    if layout == "interleaved":
        out = rotation_matrix(m, thetas) @ rot
    else:
        order = half_to_pairs(d)
        out = np.empty(d)
        out[order] = rotation_matrix(m, thetas) @ rot[order]
    return np.concatenate([out, rest])


def reference_rope_BTNH(x: np.ndarray, pos: np.ndarray, thetas: np.ndarray, layout: str):
    out = np.zeros(x.shape)
    for b, t, n in np.ndindex(x.shape[:3]):
        out[b, t, n] = reference_rope(x[b, t, n], pos[b, t], thetas, layout)
    return out


def run_site(
    scheme_options: dict, dims: Dims, q: np.ndarray, k: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rope site's qk on (q, k) with the same positions for queries and keys."""
    site = registry.make_scheme("rope", scheme_options).attention_module(dims)
    batch, length = q.shape[:2]
    ctx = AttentionContext(
        x_BTD=jnp.zeros((batch, length, dims.d_model)),
        q_positions_BT=jnp.asarray(pos),
        k_positions_BS=jnp.asarray(pos),
        explicit_mask_BTS=jnp.ones((batch, length, k.shape[1]), bool),
    )
    q_out, k_out, _ = site.apply(
        {}, jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), ctx, method=lambda m, *a: m.qk(*a)
    )
    return np.asarray(q_out), np.asarray(k_out)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_apply_rope_equals_the_roformer_rotation(
    rng: np.random.Generator, layout: str, fraction: float
) -> None:
    head_dim, base = 12, 10000.0
    rot_dim = int(head_dim * fraction) // 2 * 2
    thetas = roformer_thetas(rot_dim, base)
    x = rng.normal(size=(2, 5, 3, head_dim)).astype(np.float32)
    pos = rng.integers(0, 60, (2, 5))
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(thetas, jnp.float32), layout)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    want = reference_rope_BTNH(x, pos, thetas, layout)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[..., rot_dim:], x[..., rot_dim:])


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_roformer_identity_scores_depend_on_n_minus_m(
    rng: np.random.Generator, layout: str
) -> None:
    """(W_m q) . (W_n k) = q . W_{n-m} k (in the layout's own feature order)."""
    d = 8
    thetas = roformer_thetas(d, 10000.0)
    q, k = rng.normal(size=(2, d)).astype(np.float32)
    for m, n in [(3, 11), (40, 7), (0, 0), (123, 456)]:
        q_rot = apply_rope(
            jnp.asarray(q)[None, None, None],
            jnp.asarray([[m]]),
            jnp.asarray(thetas, jnp.float32),
            layout,
        )
        k_rot = apply_rope(
            jnp.asarray(k)[None, None, None],
            jnp.asarray([[n]]),
            jnp.asarray(thetas, jnp.float32),
            layout,
        )
        score = float(jnp.sum(q_rot * k_rot))
        relative = float(q.astype(np.float64) @ reference_rope(k, n - m, thetas, layout))
        np.testing.assert_allclose(score, relative, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_scores_are_invariant_to_shifting_all_positions(
    rng: np.random.Generator, layout: str
) -> None:
    dims = Dims(d_model=16, num_heads=2, head_dim=8, num_layers=1, max_len=16)
    q = rng.normal(size=(2, 6, 2, 8)).astype(np.float32)
    k = rng.normal(size=(2, 6, 2, 8)).astype(np.float32)
    pos = np.sort(rng.integers(0, 30, (2, 6)), axis=1)
    scores = []
    for shift in (0, 17, 250):
        q_out, k_out = run_site({"layout": layout}, dims, q, k, pos + shift)
        scores.append(np.einsum("btnh,bsnh->bnts", q_out, k_out))
    np.testing.assert_allclose(scores[1], scores[0], atol=2e-4)
    np.testing.assert_allclose(scores[2], scores[0], atol=2e-4)


def reference_thetas(scaling: str, d: int, base: float, s: float, length: int) -> np.ndarray:
    """Scaled frequencies written from each paper's formula, one frequency at a time."""
    alpha, beta = 1.0, 32.0
    out = []
    for i in range(d // 2):
        theta = base ** (-2.0 * i / d)
        if scaling == "linear":  # PI: angle (m / s) theta
            out.append(theta / s)
        elif scaling == "ntk":
            out.append((base * s ** (d / (d - 2))) ** (-2.0 * i / d))
        else:  # YaRN, NTK-by-parts
            wavelength = 2 * math.pi / theta
            r = length / wavelength
            if r < alpha:
                gamma = 0.0
            elif r > beta:
                gamma = 1.0
            else:
                gamma = (r - alpha) / (beta - alpha)
            out.append((1 - gamma) * theta / s + gamma * theta)
    return np.array(out)


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_scaled_frequencies_match_their_formulas(scaling: str) -> None:
    d, base, s, length = 16, 10000.0, 4.0, 512
    got = scaled_inv_freq(d, base, scaling=scaling, factor=s, original_max_len=length)
    want = reference_thetas(scaling, d, base, s, length)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_yarn_ramp_covers_extrapolated_interpolated_and_blended_pairs() -> None:
    d, base, s, length = 16, 10000.0, 4.0, 512
    plain = roformer_thetas(d, base)
    yarn = np.asarray(scaled_inv_freq(d, base, scaling="yarn", factor=s, original_max_len=length))
    ratio = yarn / plain
    assert np.isclose(ratio[0], 1.0)  # r > beta: high frequency kept (extrapolation)
    assert np.isclose(ratio[-1], 1 / s)  # r < alpha: low frequency interpolated
    assert np.any((ratio > 1 / s + 1e-3) & (ratio < 1 - 1e-3))  # blended in between


@pytest.mark.parametrize("scaling", ["none", "linear", "ntk", "yarn"])
def test_site_applies_the_scaled_rotation_and_yarn_temperature(
    rng: np.random.Generator, scaling: str
) -> None:
    dims = Dims(d_model=32, num_heads=2, head_dim=16, num_layers=1, max_len=512)
    s = 1.0 if scaling == "none" else 8.0
    q = rng.normal(size=(1, 5, 2, 16)).astype(np.float32)
    k = rng.normal(size=(1, 5, 2, 16)).astype(np.float32)
    pos = rng.integers(0, 2000, (1, 5))
    q_out, k_out = run_site({"scaling": scaling, "factor": s}, dims, q, k, pos)
    thetas = (
        reference_thetas("linear", 16, 10000.0, 1.0, 512)
        if scaling == "none"
        else (reference_thetas(scaling, 16, 10000.0, s, 512))
    )
    temperature = 0.1 * math.log(s) + 1.0 if scaling == "yarn" else 1.0  # sqrt(1/t)
    for x, x_out in ((q, q_out), (k, k_out)):
        want = temperature * reference_rope_BTNH(x, pos, thetas, "half")
        np.testing.assert_allclose(x_out, want, atol=2e-4, rtol=2e-4)


def test_linear_scaling_equals_rope_at_interpolated_positions(rng: np.random.Generator) -> None:
    dims = Dims(d_model=16, num_heads=2, head_dim=8, num_layers=1, max_len=16)
    q = rng.normal(size=(2, 4, 2, 8)).astype(np.float32)
    pos = rng.integers(0, 64, (2, 4))
    scaled, _ = run_site({"scaling": "linear", "factor": 4.0}, dims, q, q, pos)
    plain, _ = run_site({}, dims, q, q, pos / 4.0)
    np.testing.assert_allclose(scaled, plain, atol=1e-5)


def test_yarn_original_max_len_defaults_to_max_len() -> None:
    dims = Dims(d_model=32, num_heads=2, head_dim=16, num_layers=1, max_len=300)
    scheme = registry.make_scheme("rope", {"scaling": "yarn", "factor": 2.0})
    np.testing.assert_allclose(
        np.asarray(scheme.inv_freq(dims)),
        reference_thetas("yarn", 16, 10000.0, 2.0, 300),
        rtol=1e-5,
    )


def test_odd_head_dim_is_rejected() -> None:
    with pytest.raises(ValueError, match="head_dim must be even"):
        tiny_config("rope", head_dim=7)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"scaling": "su"}, "scaling must be one of"),
        ({"scaling": "linear", "factor": 0.5}, "factor must be >= 1"),
        ({"factor": 2.0}, "factor=2.0 needs a scaling"),
        ({"scaling": "yarn", "factor": 2.0, "yarn_alpha": 40.0}, "yarn_alpha < yarn_beta"),
        ({"scaling": "yarn", "factor": 2.0, "original_max_len": 0}, "original_max_len"),
        ({"layout": "zigzag"}, "layout must be one of"),
        ({"base": 0.0}, "base must be > 0"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("rope", position_options=options)
