"""Rotary position embedding (RoFormer; Su et al. 2021, arXiv 2104.09864).

q and k are rotated pairwise by angles ``position * theta_i`` with
``theta_i = base^(-2i / d_rot)`` (RoFormer eq. 15), so that q_m . k_n depends on m - n only.
Two pair layouts: ``interleaved`` pairs (x_0, x_1), (x_2, x_3), ... as in RoFormer eq. 34;
``half`` pairs (x_i, x_{i + d/2}) ("rotate-half", GPT-NeoX / Llama).

The frequencies (``copejax.positions.rope_frequencies``) may be scaled for length extension
(option ``scaling``: linear, ntk, dynamic, yarn, llama3, longrope, the ``rope_type`` names of
transformers' ``modeling_rope_utils``) and truncated as in p-RoPE (option ``p``). YaRN and
LongRoPE also multiply q and k each by an attention factor, so the logits scale by its square
(HF multiplies cos and sin by the same ``attention_scaling``).

"Current length" (dynamic NTK's N, LongRoPE's short/long choice): ``current_len`` when set;
otherwise, as HF recomputes per forward call, max(position) + 1 over the call's queries and
keys: the (longest packed document of the) batch in training and full forwards, the prompt in
a prefill and the new token's position + 1 in a decode step. Keys cached by earlier calls keep
the frequencies of their call, so past L prefill + decode would differ from one full forward
(and a token's output depends on how long its call is): :meth:`RoPE.check_decode` refuses a
cache longer than L in that mode and names the fix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_choice,
    check_positive,
)
from copejax.positions.registry import register
from copejax.positions.rope_frequencies import (
    SCALINGS,
    YARN_RAMPS,
    keep_highest_frequencies,
    longrope_attention_factor,
    rope_inv_freq,
    scaled_inv_freq,
    yarn_attention_factor,
)

__all__ = ["LAYOUTS", "SCALINGS", "RoPE", "apply_rope", "rope_inv_freq", "scaled_inv_freq"]

LAYOUTS = ("half", "interleaved")


def apply_rope(
    x_BTNH: jax.Array,
    positions_BT: jax.Array,
    inv_freq_F: jax.Array,
    layout: str = "half",
    scale_BTF: jax.Array | None = None,
) -> jax.Array:
    """Rotates the first ``2 F`` features of each head by ``positions * inv_freq``.

    Args:
      x_BTNH: queries or keys.
      positions_BT: positions (int or float).
      inv_freq_F: one frequency per rotated pair (F pairs, 2F <= H).
      layout: "half" (pairs i, i + F) or "interleaved" (pairs 2i, 2i + 1).
      scale_BTF: optional per-pair multiplier (xPos), broadcast over heads.

    Returns:
      Rotated array, same shape and dtype as ``x_BTNH``; features past 2F pass through.
    """
    num_pairs = inv_freq_F.shape[0]
    rot_dim = 2 * num_pairs
    x_rot, x_pass = x_BTNH[..., :rot_dim], x_BTNH[..., rot_dim:]
    angle_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq_F
    cos_BT1F = jnp.cos(angle_BTF)[:, :, None, :]
    sin_BT1F = jnp.sin(angle_BTF)[:, :, None, :]
    if scale_BTF is not None:
        cos_BT1F = cos_BT1F * scale_BTF[:, :, None, :]
        sin_BT1F = sin_BT1F * scale_BTF[:, :, None, :]
    x_rot = x_rot.astype(jnp.float32)
    if layout == "half":
        x1, x2 = x_rot[..., :num_pairs], x_rot[..., num_pairs:]
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    y1 = x1 * cos_BT1F - x2 * sin_BT1F
    y2 = x2 * cos_BT1F + x1 * sin_BT1F
    if layout == "half":
        y_rot = jnp.concatenate([y1, y2], axis=-1)
    else:
        y_rot = jnp.stack([y1, y2], axis=-1).reshape(x_rot.shape)
    return jnp.concatenate([y_rot.astype(x_BTNH.dtype), x_pass], axis=-1)


def rotary_dim(head_dim: int, fraction: float) -> int:
    """Number of rotated features: ``fraction * head_dim`` rounded down to an even number."""
    return int(head_dim * fraction) // 2 * 2


# The options each scaling reads besides base, layout, fraction and p; any other scaling
# option set away from its default is an error, so a value no scaling reads is never ignored.
_READS: dict[str, tuple[str, ...]] = {
    "none": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_len", "current_len"),
    "yarn": (
        "factor",
        "original_max_len",
        "yarn_alpha",
        "yarn_beta",
        "yarn_ramp",
        "yarn_truncate",
        "attention_factor",
    ),
    "llama3": ("factor", "original_max_len", "low_freq_factor", "high_freq_factor"),
    "longrope": (
        "factor",
        "original_max_len",
        "short_factor",
        "long_factor",
        "current_len",
        "attention_factor",
    ),
}
_SCALING_OPTIONS = tuple(sorted({key for keys in _READS.values() for key in keys}))


@register
@dataclasses.dataclass(frozen=True)
class RoPE(PositionScheme):
    """RoPE with base, pair layout, partial rotation, p-RoPE and length-extension scaling.

    Options:
      base: the frequency base (10000 in RoFormer).
      layout: "half" (rotate-half) or "interleaved" (RoFormer eq. 34).
      fraction: share of each head's features that rotate (GPT-NeoX's partial rotary, 0.25
        there); the d_rot = fraction * H rotated features get the full spectrum
        base^(-2i / d_rot). Must leave an even, positive number of features.
      p: p-RoPE (arXiv 2410.06205): of the d_rot / 2 frequencies, the floor(p d_rot / 2)
        highest keep theta_i = base^(-2i / d_rot) and the lowest are set to 0 (their pairs
        pass unrotated); 1 is RoPE, 0 is NoPE. Unlike ``fraction`` the kept spectrum is not
        re-spread.
      scaling: "none", "linear", "ntk", "dynamic", "yarn", "llama3" or "longrope".
      factor: s >= 1, the context extension factor (must stay 1 with scaling="none").
        LongRoPE reads it only for its attention factor (HF: max_position_embeddings /
        original_max_position_embeddings).
      original_max_len: L, the pre-training context (dynamic, yarn, llama3, longrope); None
        uses the model's ``max_len``.
      yarn_alpha, yarn_beta: YaRN's ramp bounds on r = L / wavelength (1 and 32 in the
        paper; HF beta_slow and beta_fast).
      yarn_ramp: "wavelength" (the paper's ramp, linear in r) or "index" (the reference code
        and HF: linear in the pair index between the rounded indices of r = beta, alpha).
      yarn_truncate: the index ramp rounds its bounds outwards (HF ``truncate``, default True).
      low_freq_factor, high_freq_factor: Llama 3.1's band edges (1 and 4 in Llama 3.1).
      short_factor, long_factor: LongRoPE's per-pair rescale factors, d_rot / 2 each; long
        when the current length exceeds L, short otherwise.
      current_len: fixes the current length N read by dynamic and longrope (prefill +
        decode then equals the full forward); None reads it per call, as HF does.
      attention_factor: overrides the q and k multiplier of yarn (0.1 ln s + 1) and longrope
        (sqrt(1 + ln s / ln L)); HF's ``attention_factor`` (from mscale for DeepSeek-style
        checkpoints). Other scalings use 1, Llama 3.1 included.
    """

    name = "rope"
    sites = ("qk",)
    paper = "Su et al. 2021, arXiv 2104.09864"

    base: float = 10000.0
    layout: str = "half"
    fraction: float = 1.0
    p: float = 1.0
    scaling: str = "none"
    factor: float = 1.0
    original_max_len: int | None = None
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0
    yarn_ramp: str = "wavelength"
    yarn_truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    current_len: int | None = None
    attention_factor: float | None = None

    def validate(self, dims: Dims) -> None:
        check_positive(self.name, base=self.base, fraction=self.fraction)
        check_choice(self.name, "layout", self.layout, LAYOUTS)
        if self.fraction > 1:
            raise ValueError(f"{self.name}: fraction must be in (0, 1], got {self.fraction!r}")
        if self.fraction == 1 and dims.head_dim % 2:
            raise ValueError(
                f"{self.name}: head_dim must be even to rotate pairs, got head_dim={dims.head_dim}"
            )
        rot_dim = rotary_dim(dims.head_dim, self.fraction)
        if rot_dim == 0:
            raise ValueError(
                f"{self.name}: fraction={self.fraction} of head_dim={dims.head_dim} rotates no "
                "pair; allowed: fraction * head_dim >= 2"
            )
        if not 0 <= self.p <= 1:
            raise ValueError(f"{self.name}: p (p-RoPE) must be in [0, 1], got {self.p!r}")
        check_choice(self.name, "scaling", self.scaling, SCALINGS)
        if not self.factor >= 1:
            raise ValueError(f"{self.name}: factor must be >= 1, got {self.factor!r}")
        if self.scaling == "none" and self.factor != 1:
            raise ValueError(
                f"{self.name}: factor={self.factor!r} needs a scaling; allowed with "
                "scaling='none': factor=1"
            )
        defaults = RoPE()
        for key in _SCALING_OPTIONS:
            if key not in _READS[self.scaling] and getattr(self, key) != getattr(defaults, key):
                readers = [s for s, keys in _READS.items() if key in keys]
                raise ValueError(
                    f"{self.name}: {key}={getattr(self, key)!r} is read only by scaling in "
                    f"{readers}, got scaling={self.scaling!r}"
                )
        if self.scaling in ("ntk", "dynamic") and rot_dim <= 2:
            raise ValueError(
                f"{self.name}: scaling={self.scaling!r} needs more than 2 rotated features "
                f"(exponent d/(d-2)), got {rot_dim}"
            )
        for key in ("original_max_len", "current_len"):
            value = getattr(self, key)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(
                    f"{self.name}: {key} must be a positive integer or None, got {value!r}"
                )
        if not 0 <= self.yarn_alpha < self.yarn_beta:
            raise ValueError(
                f"{self.name}: need 0 <= yarn_alpha < yarn_beta, got yarn_alpha="
                f"{self.yarn_alpha!r}, yarn_beta={self.yarn_beta!r}"
            )
        if self.scaling == "yarn" and self.yarn_ramp == "index" and self.yarn_alpha <= 0:
            raise ValueError(
                f"{self.name}: yarn_ramp='index' takes log(yarn_alpha); allowed: yarn_alpha > 0, "
                f"got {self.yarn_alpha!r}"
            )
        check_choice(self.name, "yarn_ramp", self.yarn_ramp, YARN_RAMPS)
        check_choice(self.name, "yarn_truncate", self.yarn_truncate, (True, False))
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"{self.name}: need 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, "
                f"high_freq_factor={self.high_freq_factor!r}"
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(
                f"{self.name}: attention_factor must be > 0 or None, got {self.attention_factor!r}"
            )
        if self.scaling == "longrope":
            self._validate_longrope(rot_dim)

    def _validate_longrope(self, rot_dim: int) -> None:
        for key in ("short_factor", "long_factor"):
            values = getattr(self, key)
            if values is None:
                raise ValueError(
                    f"{self.name}: scaling='longrope' needs {key}, a list of {rot_dim // 2} "
                    "positive numbers (one per rotated pair)"
                )
            if len(values) != rot_dim // 2:
                raise ValueError(
                    f"{self.name}: {key} has {len(values)} entries; allowed: rot_dim / 2 = "
                    f"{rot_dim // 2} (one per rotated pair, rot_dim = fraction * head_dim)"
                )
            bad = [v for v in values if isinstance(v, bool) or not v > 0]
            if bad:
                raise ValueError(f"{self.name}: {key} entries must be > 0, got {bad[0]!r}")

    def resolved_original_max_len(self, dims: Dims) -> int:
        return self.original_max_len if self.original_max_len is not None else dims.max_len

    @property
    def reads_length(self) -> bool:
        """Whether the frequencies depend on each call's length (dynamic / longrope without
        ``current_len``)."""
        return self.scaling in ("dynamic", "longrope") and self.current_len is None

    def inv_freq(self, dims: Dims, length: jax.Array | int | None = None) -> jax.Array:
        """The F = d_rot / 2 frequencies; ``length`` is the current length N (dynamic and
        longrope; ``current_len`` takes precedence, None reads N = L)."""
        rot_dim = rotary_dim(dims.head_dim, self.fraction)
        inv_freq_F = scaled_inv_freq(
            rot_dim,
            self.base,
            scaling=self.scaling,
            factor=self.factor,
            original_max_len=self.resolved_original_max_len(dims),
            yarn_alpha=self.yarn_alpha,
            yarn_beta=self.yarn_beta,
            yarn_ramp=self.yarn_ramp,
            yarn_truncate=self.yarn_truncate,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            short_factor=self.short_factor,
            long_factor=self.long_factor,
            length=self.current_len if self.current_len is not None else length,
        )
        return keep_highest_frequencies(inv_freq_F, self.p) if self.p != 1 else inv_freq_F

    def resolved_attention_factor(self, dims: Dims) -> float:
        """Multiplier of q and of k: ``attention_factor``, else YaRN's 0.1 ln(s) + 1,
        LongRoPE's sqrt(1 + ln(s) / ln(L)), otherwise 1 (Llama 3.1 included)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.scaling == "yarn":
            return yarn_attention_factor(self.factor)
        if self.scaling == "longrope":
            return longrope_attention_factor(self.factor, self.resolved_original_max_len(dims))
        return 1.0

    def check_decode(self, dims: Dims, cache_length: int) -> None:
        original = self.resolved_original_max_len(dims)
        if self.reads_length and cache_length > original:
            raise ValueError(
                f"{self.name}: scaling={self.scaling!r} with current_len=None reads the length of "
                f"each call (as transformers does), so a cache of {cache_length} > "
                f"original_max_len={original} slots would hold keys rotated with other "
                "frequencies than the later queries: prefill + decode would differ from the "
                f"full forward. Set current_len (e.g. current_len={cache_length}) to fix N"
            )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _RoPESite(dims=dims, scheme=self, name=self.name)


class _RoPESite(AttentionSite):
    scheme: RoPE = RoPE()

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        length = None
        if self.scheme.reads_length:  # this call's length, as HF's per-call recomputation
            length = jnp.maximum(jnp.max(ctx.q_positions_BT), jnp.max(ctx.k_positions_BS)) + 1
        inv_freq_F = self.scheme.inv_freq(self.dims, length)
        q_BTNH = apply_rope(q_BTNH, ctx.q_positions_BT, inv_freq_F, self.scheme.layout)
        k_BSNH = apply_rope(k_BSNH, ctx.k_positions_BS, inv_freq_F, self.scheme.layout)
        mscale = self.scheme.resolved_attention_factor(self.dims)
        if mscale != 1.0:
            q_BTNH = (q_BTNH.astype(jnp.float32) * mscale).astype(q_BTNH.dtype)
            k_BSNH = (k_BSNH.astype(jnp.float32) * mscale).astype(k_BSNH.dtype)
        return q_BTNH, k_BSNH, v_BSNH
