"""RoPE frequency vectors: RoFormer's theta_i and their length-extension scalings.

Pure functions, arrays in and arrays out; every result has shape (d // 2,) (F, one frequency
per rotated pair) in float32. Sources, one per scaling (HF = transformers'
``modeling_rope_utils.ROPE_INIT_FUNCTIONS``, whose ``rope_type`` names are used here):

- RoFormer (Su et al. 2021, arXiv 2104.09864, eq. 15): theta_i = base^(-2i / d).
- ``linear``: position interpolation (Chen et al. 2023, arXiv 2306.15595): theta_i / s.
- ``ntk``: NTK-aware (r/LocalLLaMA 2023): base' = base s^(d / (d - 2)).
- ``dynamic``: dynamic NTK (emozilla, r/LocalLLaMA 2023; HF ``dynamic``): the NTK base for the
  current length N, base' = base (s N / L - (s - 1))^(d / (d - 2)) with N = max(N, L).
- ``yarn``: YaRN "NTK-by-parts" (Peng et al. 2023, arXiv 2309.00071, eq. 17-18) with either
  the paper's ramp in r = L / lambda or the reference code's ramp in pair index (HF ``yarn``).
- ``llama3``: Llama 3.1's scaling (Meta's reference ``apply_scaling``; HF ``llama3``).
- ``longrope``: LongRoPE (Ding et al. 2024, arXiv 2402.13753): theta_i / lambda_i with
  searched per-pair factors, a short and a long list chosen by length (HF ``longrope``).
- p-RoPE (Barbero et al. 2024, arXiv 2410.06205, section 6): the lowest frequencies set to 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
YARN_RAMPS = ("wavelength", "index")


def rope_inv_freq(rot_dim: int, base: float) -> jax.Array:
    """theta_i = base^(-2i / rot_dim) for i < rot_dim / 2; shape (rot_dim // 2,), float32."""
    return base ** (-jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)


def ntk_inv_freq(rot_dim: int, base: float, factor: float | jax.Array) -> jax.Array:
    """NTK-aware scaling: RoFormer's frequencies with base * factor^(d / (d - 2))."""
    new_base = base * factor ** (rot_dim / (rot_dim - 2))
    return new_base ** (-jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)


def dynamic_ntk_inv_freq(
    rot_dim: int, base: float, factor: float, original_max_len: int, length: jax.Array | int
) -> jax.Array:
    """Dynamic NTK: NTK scaling with the factor s N / L - (s - 1), N = max(length, L).

    At N <= L this is plain RoPE; at N = L (2 - 1/s) it equals static NTK with factor s, and
    past that the effective factor keeps growing linearly in N.
    ``length`` may be a traced scalar (the current call's length).
    """
    n = jnp.maximum(jnp.asarray(length, jnp.float32), float(original_max_len))
    return ntk_inv_freq(rot_dim, base, factor * n / original_max_len - (factor - 1.0))


def yarn_ramp_wavelength(
    inv_freq_F: jax.Array, original_max_len: int, alpha: float, beta: float
) -> jax.Array:
    """gamma_i = clip((r_i - alpha) / (beta - alpha), 0, 1), r_i = L theta_i / (2 pi) (paper
    eq. 17): 1 keeps theta_i (extrapolation), 0 gives theta_i / s (interpolation)."""
    ratio_F = original_max_len * inv_freq_F / (2 * math.pi)
    return jnp.clip((ratio_F - alpha) / (beta - alpha), 0.0, 1.0)


def yarn_correction_dim(
    rotations: float, rot_dim: int, base: float, original_max_len: int
) -> float:
    """The (fractional) pair index i at which r_i = L / lambda_i equals ``rotations``:
    i = d ln(L / (2 pi rotations)) / (2 ln base)."""
    return rot_dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_index(
    rot_dim: int, base: float, original_max_len: int, *, alpha: float, beta: float, truncate: bool
) -> jax.Array:
    """The reference code's ramp (jquesnelle/yarn; HF ``_compute_yarn_parameters``).

    The pair indices low / high where r = beta / r = alpha are rounded outwards (floor /
    ceil, unless ``truncate`` is False) and clipped to [0, d - 1]; the ramp falls linearly in
    the pair index from 1 (i <= low, extrapolation) to 0 (i >= high, interpolation). Same
    orientation as :func:`yarn_ramp_wavelength` (1 keeps theta_i).
    """
    low = yarn_correction_dim(beta, rot_dim, base, original_max_len)
    high = yarn_correction_dim(alpha, rot_dim, base, original_max_len)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    index_F = jnp.arange(rot_dim // 2, dtype=jnp.float32)
    return 1.0 - jnp.clip((index_F - low) / (high - low), 0.0, 1.0)


def yarn_inv_freq(
    rot_dim: int,
    base: float,
    factor: float,
    original_max_len: int,
    *,
    alpha: float = 1.0,
    beta: float = 32.0,
    ramp: str = "wavelength",
    truncate: bool = True,
) -> jax.Array:
    """YaRN's theta'_i = (1 - gamma_i) theta_i / s + gamma_i theta_i with ``ramp`` gamma."""
    inv_freq_F = rope_inv_freq(rot_dim, base)
    if ramp == "wavelength":
        gamma_F = yarn_ramp_wavelength(inv_freq_F, original_max_len, alpha, beta)
    elif ramp == "index":
        gamma_F = yarn_ramp_index(
            rot_dim, base, original_max_len, alpha=alpha, beta=beta, truncate=truncate
        )
    else:
        raise ValueError(f"rope: yarn_ramp must be one of {YARN_RAMPS}, got {ramp!r}")
    return (1.0 - gamma_F) * inv_freq_F / factor + gamma_F * inv_freq_F


def llama3_inv_freq(
    rot_dim: int,
    base: float,
    factor: float,
    original_max_len: int,
    *,
    low_freq_factor: float,
    high_freq_factor: float,
) -> jax.Array:
    """Llama 3.1: wavelengths below L / high_freq_factor keep theta_i, those above
    L / low_freq_factor get theta_i / s, and in between theta_i blends as
    (1 - g) theta_i / s + g theta_i with g = (L / lambda_i - low) / (high - low)."""
    inv_freq_F = rope_inv_freq(rot_dim, base)
    wavelength_F = 2 * math.pi / inv_freq_F
    smooth_F = (original_max_len / wavelength_F - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended_F = (1.0 - smooth_F) * inv_freq_F / factor + smooth_F * inv_freq_F
    out_F = jnp.where(
        wavelength_F > original_max_len / low_freq_factor, inv_freq_F / factor, blended_F
    )
    return jnp.where(wavelength_F < original_max_len / high_freq_factor, inv_freq_F, out_F)


def longrope_inv_freq(
    rot_dim: int,
    base: float,
    *,
    short_factor: Sequence[float],
    long_factor: Sequence[float],
    original_max_len: int,
    length: jax.Array | int,
) -> jax.Array:
    """LongRoPE: theta_i / lambda_i, lambda = ``long_factor`` when length > L, else
    ``short_factor`` (each one factor per rotated pair). ``length`` may be traced."""
    inv_freq_F = rope_inv_freq(rot_dim, base)
    short_F = jnp.asarray(short_factor, jnp.float32)
    long_F = jnp.asarray(long_factor, jnp.float32)
    lambda_F = jnp.where(jnp.asarray(length) > original_max_len, long_F, short_F)
    return inv_freq_F / lambda_F


def keep_highest_frequencies(inv_freq_F: jax.Array, p: float) -> jax.Array:
    """p-RoPE: keeps the first floor(p F) frequencies (the highest; theta_i falls with i) and
    sets the rest to 0, so those pairs are not rotated. p = 1 is RoPE, p = 0 is NoPE.
    The count follows gemma's ``rope_proportion`` (``int(p * d // 2)``)."""
    num_pairs = inv_freq_F.shape[0]
    kept = int(p * 2 * num_pairs // 2)
    return jnp.where(jnp.arange(num_pairs) < kept, inv_freq_F, 0.0)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln(s) + 1 (paper eq. 22), the multiplier of q and of k."""
    return 0.1 * math.log(factor) + 1.0


def longrope_attention_factor(factor: float, original_max_len: int) -> float:
    """LongRoPE's (Phi-3's) sqrt(1 + ln(s) / ln(L)), 1 when s <= 1; multiplies q and k."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(factor) / math.log(original_max_len))


def scaled_inv_freq(
    rot_dim: int,
    base: float,
    *,
    scaling: str = "none",
    factor: float = 1.0,
    original_max_len: int | None = None,
    yarn_alpha: float = 1.0,
    yarn_beta: float = 32.0,
    yarn_ramp: str = "wavelength",
    yarn_truncate: bool = True,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    short_factor: Sequence[float] | None = None,
    long_factor: Sequence[float] | None = None,
    length: jax.Array | int | None = None,
) -> jax.Array:
    """RoPE frequencies after a length-extension scaling; shape (rot_dim // 2,), float32.

    Args:
      rot_dim: d, the number of rotated features (even).
      base: the frequency base.
      scaling: one of ``SCALINGS`` (see the module docstring).
      factor: s >= 1, the context extension factor.
      original_max_len: L, the training context length (dynamic, yarn, llama3, longrope).
      yarn_alpha, yarn_beta: YaRN's ramp bounds on r = L / wavelength (HF beta_slow, beta_fast).
      yarn_ramp: "wavelength" (paper, linear in r) or "index" (reference code, linear in i).
      yarn_truncate: the index ramp's floor / ceil of its bounds (HF ``truncate``).
      low_freq_factor, high_freq_factor: Llama 3.1's band edges, in L / wavelength.
      short_factor, long_factor: LongRoPE's per-pair factors (rot_dim // 2 each).
      length: the current length N for ``dynamic`` and ``longrope`` (may be traced); None
        reads N = L (plain RoPE for dynamic, the short factors for longrope).
    """
    if scaling == "none":
        return rope_inv_freq(rot_dim, base)
    if scaling == "linear":
        return rope_inv_freq(rot_dim, base) / factor
    if scaling == "ntk":
        return ntk_inv_freq(rot_dim, base, factor)
    if scaling not in SCALINGS:
        raise ValueError(f"rope: scaling must be one of {SCALINGS}, got {scaling!r}")
    if original_max_len is None:
        raise ValueError(f"rope: scaling={scaling!r} needs original_max_len")
    current = original_max_len if length is None else length
    if scaling == "dynamic":
        return dynamic_ntk_inv_freq(rot_dim, base, factor, original_max_len, current)
    if scaling == "yarn":
        return yarn_inv_freq(
            rot_dim,
            base,
            factor,
            original_max_len,
            alpha=yarn_alpha,
            beta=yarn_beta,
            ramp=yarn_ramp,
            truncate=yarn_truncate,
        )
    if scaling == "llama3":
        return llama3_inv_freq(
            rot_dim,
            base,
            factor,
            original_max_len,
            low_freq_factor=low_freq_factor,
            high_freq_factor=high_freq_factor,
        )
    if short_factor is None or long_factor is None:
        raise ValueError("rope: scaling='longrope' needs short_factor and long_factor")
    return longrope_inv_freq(
        rot_dim,
        base,
        short_factor=short_factor,
        long_factor=long_factor,
        original_max_len=original_max_len,
        length=current,
    )
