"""RoPE variants against NumPy references written from their papers and reference code.

- p-RoPE (Barbero et al. 2024, arXiv 2410.06205, section 6; gemma's ``rope_proportion``);
- Llama 3.1 frequency scaling (Meta's ``apply_scaling``; transformers' ``llama3``);
- dynamic NTK (transformers' ``dynamic``: base (s N / L - (s - 1))^(d / (d - 2)));
- LongRoPE (Ding et al. 2024, arXiv 2402.13753; transformers' ``longrope``, Phi-3);
- YaRN with the reference code's ramp in pair index (jquesnelle/yarn; transformers' ``yarn``).

The references work one frequency at a time in float64 and do not call copejax's frequency
code; YaRN's correction indices are found by bisection on r_i = L / lambda_i, not from the
closed form the implementation uses.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode
from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.positions.base import Dims
from copejax.positions.rope_frequencies import scaled_inv_freq
from tests.conftest import perturbed, tiny_config
from tests.positions.test_rope import reference_rope_BTNH, run_site

DIMS = Dims(d_model=32, num_heads=2, head_dim=16, num_layers=1, max_len=64)


def theta(i: int, d: int, base: float) -> float:
    """RoFormer eq. 15: theta_i = base^(-2i / d) (i from 0)."""
    return base ** (-2.0 * i / d)


def site_outputs(options: dict, pos: np.ndarray, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, pos.shape[1], 2, 16)).astype(np.float32)
    k = rng.normal(size=(1, pos.shape[1], 2, 16)).astype(np.float32)
    q_out, k_out = run_site(options, DIMS, q, k, pos)
    return q, k, q_out, k_out


def check_rotation(options: dict, pos: np.ndarray, thetas: np.ndarray, mscale: float) -> None:
    q, k, q_out, k_out = site_outputs(options, pos)
    for x, x_out in ((q, q_out), (k, k_out)):
        want = mscale * reference_rope_BTNH(x, pos, thetas, "half")
        np.testing.assert_allclose(x_out, want, atol=3e-4, rtol=3e-4)


# ---------------------------------------------------------------- p-RoPE


def p_rope_thetas(d: int, base: float, p: float) -> np.ndarray:
    """Section 6: keep the fraction p of the frequencies, the highest (smallest i), and set
    the lowest to 0; the kept count is floor(p d / 2) as gemma's rope_proportion."""
    kept = math.floor(p * d / 2)
    return np.array([theta(i, d, base) if i < kept else 0.0 for i in range(d // 2)])


@pytest.mark.parametrize("p", [0.75, 0.25, 0.0, 1.0])
def test_p_rope_rotates_the_highest_frequencies_and_leaves_the_rest(p: float) -> None:
    pos = np.array([[0, 3, 17, 250, 1000]])
    check_rotation({"p": p}, pos, p_rope_thetas(16, 10000.0, p), 1.0)
    q, _, q_out, _ = site_outputs({"p": p}, pos)
    kept = math.floor(p * 8)
    for i in range(kept, 8):  # rotate-half pairs (i, i + 8) of the dropped frequencies
        np.testing.assert_array_equal(q_out[..., [i, i + 8]], q[..., [i, i + 8]])


def test_p_rope_keeps_the_spectrum_unlike_fraction() -> None:
    """p = 0.5 keeps theta_0..3 of base^(-2i/16); fraction = 0.5 re-spreads base^(-2i/8)."""
    p_rope = registry.make_scheme("rope", {"p": 0.5}).inv_freq(DIMS)
    partial = registry.make_scheme("rope", {"fraction": 0.5}).inv_freq(DIMS)
    np.testing.assert_allclose(np.asarray(p_rope)[:4], [theta(i, 16, 1e4) for i in range(4)])
    np.testing.assert_allclose(np.asarray(partial), [theta(i, 8, 1e4) for i in range(4)])


def test_p_rope_composes_with_a_scaling() -> None:
    scheme = registry.make_scheme("rope", {"p": 0.75, "scaling": "linear", "factor": 2.0})
    want = p_rope_thetas(16, 10000.0, 0.75) / 2.0
    np.testing.assert_allclose(np.asarray(scheme.inv_freq(DIMS)), want, rtol=1e-6)


# ---------------------------------------------------------------- Llama 3.1


def llama3_thetas(
    d: int, base: float, s: float, length: int, *, low: float = 1.0, high: float = 4.0
) -> np.ndarray:
    """Meta's apply_scaling, one frequency at a time."""
    out = []
    for i in range(d // 2):
        freq = theta(i, d, base)
        wavelength = 2 * math.pi / freq
        if wavelength < length / high:  # high frequency: kept
            out.append(freq)
        elif wavelength > length / low:  # low frequency: interpolated
            out.append(freq / s)
        else:
            smooth = (length / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / s + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize(
    ("d", "base", "s", "length", "low", "high"),
    [
        (16, 10000.0, 8.0, 64, 1.0, 4.0),
        (128, 500000.0, 8.0, 8192, 1.0, 4.0),
        (32, 1e4, 4.0, 300, 1.5, 6.0),
    ],
)
def test_llama3_frequencies_match_apply_scaling(  # noqa: PLR0917 (pytest parameters)
    d: int, base: float, s: float, length: int, low: float, high: float
) -> None:
    got = scaled_inv_freq(
        d, base, scaling="llama3", factor=s, original_max_len=length,
        low_freq_factor=low, high_freq_factor=high,
    )  # fmt: skip
    want = llama3_thetas(d, base, s, length, low=low, high=high)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6)
    ratio = want / np.array([theta(i, d, base) for i in range(d // 2)])
    assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 1 / s)  # kept, interpolated
    assert np.any((ratio > 1 / s + 1e-6) & (ratio < 1 - 1e-6))  # and a blended band


def test_llama3_site_rotates_without_an_attention_factor() -> None:
    options = {"scaling": "llama3", "factor": 8.0, "original_max_len": 64}
    pos = np.array([[0, 5, 90, 400, 511]])
    check_rotation(options, pos, llama3_thetas(16, 10000.0, 8.0, 64), 1.0)


# ---------------------------------------------------------------- dynamic NTK


def dynamic_thetas(d: int, base: float, s: float, original: int, n: int) -> np.ndarray:
    """transformers' _compute_dynamic_ntk_parameters at seq_len n."""
    n = max(n, original)
    new_base = base * (s * n / original - (s - 1)) ** (d / (d - 2))
    return np.array([theta(i, d, new_base) for i in range(d // 2)])


@pytest.mark.parametrize("n", [1, 64, 65, 256, 1000])
def test_dynamic_frequencies_follow_the_current_length(n: int) -> None:
    got = scaled_inv_freq(16, 1e4, scaling="dynamic", factor=4.0, original_max_len=64, length=n)
    np.testing.assert_allclose(np.asarray(got), dynamic_thetas(16, 1e4, 4.0, 64, n), rtol=2e-5)


def test_dynamic_is_rope_within_l_and_static_ntk_where_its_factor_reaches_s() -> None:
    """s N / L - (s - 1) = s at N = L (2 - 1/s) = 112 for s = 4, L = 64."""
    plain = scaled_inv_freq(16, 1e4)
    ntk = scaled_inv_freq(16, 1e4, scaling="ntk", factor=4.0)
    at_l = scaled_inv_freq(16, 1e4, scaling="dynamic", factor=4.0, original_max_len=64, length=40)
    at_n = scaled_inv_freq(16, 1e4, scaling="dynamic", factor=4.0, original_max_len=64, length=112)
    np.testing.assert_allclose(np.asarray(at_l), np.asarray(plain), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(at_n), np.asarray(ntk), rtol=2e-5)


def test_dynamic_site_reads_the_call_length_or_current_len() -> None:
    pos = np.array([[0, 7, 100, 299, 30]])  # N = max position + 1 = 300
    options = {"scaling": "dynamic", "factor": 4.0}
    check_rotation(options, pos, dynamic_thetas(16, 1e4, 4.0, 64, 300), 1.0)
    fixed = {**options, "current_len": 1000}
    check_rotation(fixed, pos, dynamic_thetas(16, 1e4, 4.0, 64, 1000), 1.0)


def _logits(cfg: object, chunks: list[int], params: object = None) -> tuple[np.ndarray, np.ndarray]:
    """(full forward, prefill + steps through the cache) logits of one 8-token sequence."""
    model = Transformer(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (1, 8)), jnp.int32)
    pos_BT = jnp.arange(8, dtype=jnp.int32)[None]
    if params is None:
        params = perturbed(model.init(jax.random.key(0), tokens_BT, pos_BT)["params"], scale=1.0)
    full = np.asarray(model.apply({"params": params}, tokens_BT, pos_BT))
    cache, outputs, start = decode.init_cache(cfg, 1, 8), [], 0
    for size in chunks:
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            tokens_BT[:, start : start + size],
            pos_BT[:, start : start + size],
            decode=True,
            mutable=["cache"],
        )
        cache, start = variables["cache"], start + size
        outputs.append(np.asarray(logits))
    return full, np.concatenate(outputs, axis=1)


@pytest.mark.parametrize("scaling", ["dynamic", "longrope"])
def test_per_call_length_decodes_within_l_and_refuses_past_it(scaling: str) -> None:
    """With current_len=None the frequencies follow each call's length (HF): within L every
    call has plain frequencies and prefill + decode equals the full forward; a cache longer
    than L is refused, naming current_len."""
    options = {"scaling": scaling, "factor": 2.0, "original_max_len": 8}
    if scaling == "longrope":
        options |= {"short_factor": [1.0, 1.5] * 4, "long_factor": [2.0, 3.0] * 4}
    cfg = tiny_config("rope", position_options=options, num_layers=1)
    full, decoded = _logits(cfg, [4, 1, 1, 1, 1])
    # Logits reach about 10 (parameters perturbed at scale 1): float32 sums in another order
    # (the masked 8-slot cache against the full pass) differ by up to about 6e-5 there.
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="current_len"):
        decode.init_cache(cfg, 1, 9)
    decode.init_cache(tiny_config("rope", position_options=options | {"current_len": 9}), 1, 9)


def test_per_call_length_past_l_differs_from_the_full_forward_as_documented() -> None:
    """The reason for the refusal: a prefill of 4 (N = 4) and steps (N = 5..8) rotate keys
    with other frequencies than one full forward (N = 8) once N passes L = 2."""
    options = {"scaling": "dynamic", "factor": 4.0, "original_max_len": 2}
    cfg = tiny_config("rope", position_options=options, num_layers=1)
    model = Transformer(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (1, 8)), jnp.int32)
    pos_BT = jnp.arange(8, dtype=jnp.int32)[None]
    params = perturbed(model.init(jax.random.key(0), tokens_BT, pos_BT)["params"], scale=1.0)
    full = np.asarray(model.apply({"params": params}, tokens_BT, pos_BT))
    prefix = np.asarray(model.apply({"params": params}, tokens_BT[:, :4], pos_BT[:, :4]))
    assert not np.allclose(prefix, full[:, :4], atol=1e-4)  # N = 4 vs N = 8: frequencies moved
    fixed = tiny_config("rope", position_options=options | {"current_len": 8}, num_layers=1)
    full_fixed, decoded = _logits(fixed, [4, 1, 1, 1, 1], params)
    np.testing.assert_allclose(full_fixed, full, rtol=1e-5, atol=1e-5)  # current_len = T
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- LongRoPE

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5]
LONG = [1.0, 1.5, 2.2, 3.1, 4.5, 6.0, 7.5, 8.0]


def longrope_thetas(d: int, base: float, lambdas: list[float]) -> np.ndarray:
    """LongRoPE eq. 6 (n-hat = 0): theta_i / lambda_i."""
    return np.array([theta(i, d, base) / lambdas[i] for i in range(d // 2)])


@pytest.mark.parametrize(("last_position", "lambdas"), [(63, SHORT), (64, LONG), (500, LONG)])
def test_longrope_picks_short_or_long_factors_by_length(last_position: int, lambdas) -> None:
    options = {"scaling": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 16.0}
    pos = np.array([[0, 3, 40, last_position]])  # N = last + 1 vs L = 64
    mscale = math.sqrt(1 + math.log(16.0) / math.log(64))  # Phi-3's / HF's attention factor
    check_rotation(options, pos, longrope_thetas(16, 1e4, lambdas), mscale)


def test_longrope_current_len_and_attention_factor_override() -> None:
    options = {"scaling": "longrope", "short_factor": SHORT, "long_factor": LONG}
    pos = np.array([[0, 1, 2]])
    check_rotation(options, pos, longrope_thetas(16, 1e4, SHORT), 1.0)  # factor 1: no scale
    fixed = options | {"current_len": 65, "attention_factor": 1.25}
    check_rotation(fixed, pos, longrope_thetas(16, 1e4, LONG), 1.25)


# ---------------------------------------------------------------- YaRN, index ramp


def pair_index_where_rotations_equal(r: float, d: int, base: float, length: int) -> float:
    """The continuous pair index x with L / lambda(x) = r, lambda(x) = 2 pi base^(2x/d),
    found by bisection (r falls with x)."""
    lo, hi = -4.0 * d, 4.0 * d
    for _ in range(200):
        mid = (lo + hi) / 2
        if length / (2 * math.pi * base ** (2 * mid / d)) > r:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def yarn_index_thetas(
    d: int, base: float, s: float, length: int, *, truncate: bool = True
) -> np.ndarray:
    """jquesnelle/yarn (and transformers): a ramp linear in the pair index between the
    indices where r = beta_fast and r = beta_slow, rounded outwards, clipped to [0, d - 1]."""
    beta_fast, beta_slow = 32.0, 1.0
    low = pair_index_where_rotations_equal(beta_fast, d, base, length)
    high = pair_index_where_rotations_equal(beta_slow, d, base, length)
    if truncate:
        low, high = math.floor(low + 1e-9), math.ceil(high - 1e-9)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(d // 2):
        t = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
        out.append((1 - t) * theta(i, d, base) + t * theta(i, d, base) / s)
    return np.array(out)


@pytest.mark.parametrize(
    ("d", "base", "s", "length", "truncate"),
    [(16, 1e4, 8.0, 64, True), (128, 1e4, 16.0, 4096, True), (128, 1e4, 4.0, 4096, False),
     (64, 5e5, 4.0, 8192, True), (8, 1e4, 2.0, 16, True)],
)  # fmt: skip
def test_yarn_index_ramp_matches_the_reference_code(d, base, s, length, truncate) -> None:
    got = scaled_inv_freq(
        d, base, scaling="yarn", factor=s, original_max_len=length,
        yarn_ramp="index", yarn_truncate=truncate,
    )  # fmt: skip
    want = yarn_index_thetas(d, base, s, length, truncate=truncate)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6)


def test_yarn_index_and_wavelength_ramps_are_different_functions() -> None:
    """Same ends (theta_0 kept, the lowest frequency divided by s), a different band."""
    kwargs = dict(scaling="yarn", factor=16.0, original_max_len=4096)
    index = np.asarray(scaled_inv_freq(128, 1e4, yarn_ramp="index", **kwargs))
    paper = np.asarray(scaled_inv_freq(128, 1e4, **kwargs))
    np.testing.assert_allclose(index[[0, -1]], paper[[0, -1]], rtol=1e-6)
    assert np.max(np.abs(index / paper - 1)) > 0.1


@pytest.mark.parametrize("ramp", ["index", "wavelength"])
def test_yarn_attention_factor_and_its_override(ramp: str) -> None:
    options = {"scaling": "yarn", "factor": 8.0, "original_max_len": 64, "yarn_ramp": ramp}
    pos = np.array([[0, 9, 300]])
    thetas = (
        yarn_index_thetas(16, 1e4, 8.0, 64)
        if ramp == "index"
        else np.asarray(scaled_inv_freq(16, 1e4, scaling="yarn", factor=8.0, original_max_len=64))
    )
    check_rotation(options, pos, thetas, 0.1 * math.log(8.0) + 1.0)  # sqrt(1/t), eq. 22
    check_rotation(options | {"attention_factor": 0.8}, pos, thetas, 0.8)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"p": 1.5}, r"p \(p-RoPE\) must be in \[0, 1\], got 1.5"),
        ({"p": -0.1}, r"p \(p-RoPE\) must be in \[0, 1\]"),
        ({"scaling": "yarn", "factor": 2.0, "yarn_ramp": "paper"}, "yarn_ramp must be one of"),
        ({"scaling": "yarn", "factor": 2.0, "yarn_truncate": "no"}, "yarn_truncate must be"),
        ({"yarn_ramp": "index"}, r"yarn_ramp='index' is read only by scaling in \['yarn'\]"),
        ({"scaling": "linear", "factor": 2.0, "current_len": 8}, "current_len=8 is read only"),
        ({"scaling": "llama3", "factor": 8.0, "attention_factor": 2.0}, "attention_factor=2.0"),
        (
            {"scaling": "llama3", "factor": 8.0, "low_freq_factor": 4.0},
            "need 0 < low_freq_factor < high_freq_factor, got low_freq_factor=4.0",
        ),
        ({"scaling": "dynamic", "factor": 2.0, "current_len": 0}, "current_len must be a positive"),
        ({"scaling": "longrope", "long_factor": [1.0] * 8}, "needs short_factor, a list of 8"),
        (
            {"scaling": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 5},
            r"long_factor has 5 entries; allowed: rot_dim / 2 = 8",
        ),
        (
            {"scaling": "longrope", "short_factor": [1.0] * 7 + [0.0], "long_factor": [1.0] * 8},
            "short_factor entries must be > 0, got 0.0",
        ),
        ({"scaling": "yarn", "factor": 2.0, "attention_factor": -1.0}, "attention_factor must"),
        ({"scaling": "dynamic", "factor": 2.0, "fraction": 0.125}, "needs more than 2 rotated"),
    ],
)
def test_bad_variant_options_are_rejected(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("rope", position_options=options)


def test_longrope_lengths_follow_the_rotated_dimension() -> None:
    """With fraction = 0.5 of head_dim 16, d_rot = 8 and the lists need 4 entries."""
    options = {"scaling": "longrope", "fraction": 0.5, "short_factor": [1.0] * 4}
    tiny_config("rope", position_options=options | {"long_factor": [2.0] * 4})
    with pytest.raises(ValueError, match="allowed: rot_dim / 2 = 4"):
        tiny_config("rope", position_options=options | {"long_factor": [2.0] * 8})
