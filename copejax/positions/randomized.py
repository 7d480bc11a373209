"""Randomized positional encodings (Ruoss et al. 2023, arXiv 2305.16843; "RandPE" in TAPE).

During training the positions of each sequence of length T are replaced by an ordered random
subset of ``[0, max_position)``: T distinct integers drawn without replacement and sorted, so
the model sees position values of sequences up to ``max_position`` long while training on
short ones. An ``encoding`` (sinusoidal, learned or rope) then encodes the new positions.

Relabelling: position p (in ``[0, T)``) becomes ``sample[p]``; with plain positions
``0..T-1`` that is the sorted sample itself, and with packed documents (positions restarting
at 0) each document gets an increasing prefix of it. Training positions outside ``[0, T)``
are an error when concrete and give the out-of-range sentinel (-2^31) when traced.

Evaluation: the paper (and its reference code) samples random positions at test time as
well. Here, by default, evaluation (``deterministic=True``) keeps the given positions, so
evaluation is reproducible and incremental decoding sees the same positions as a full
forward; ``sample_at_eval=True`` follows the paper (evaluation then needs a ``positions`` rng).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from copejax.positions.base import (
    AttentionSite,
    Dims,
    EmbedOutput,
    EmbedSite,
    PositionScheme,
    check_choice,
)
from copejax.positions.learned import Learned
from copejax.positions.registry import register
from copejax.positions.rope import RoPE
from copejax.positions.sinusoidal import Sinusoidal

ENCODINGS = ("sinusoidal", "learned", "rope", "none")


def sample_ordered_positions(
    key: jax.Array, batch: int, length: int, max_position: int
) -> jax.Array:
    """For each of ``batch`` rows, ``length`` distinct sorted integers from [0, max_position).

    Returns:
      int32 array of shape (batch, length).
    """
    if length > max_position:
        raise ValueError(
            f"randomized: sequence length T={length} exceeds max_position={max_position}; "
            f"allowed: T <= {max_position}"
        )

    def one_row(row_key: jax.Array) -> jax.Array:
        return jnp.sort(jax.random.choice(row_key, max_position, (length,), replace=False))

    return jax.vmap(one_row)(jax.random.split(key, batch)).astype(jnp.int32)


def relabel_positions(positions_BT: jax.Array, sample_BT: jax.Array) -> jax.Array:
    """New position ``sample[b, p]`` for each position p in ``[0, T)`` of row b."""
    length = sample_BT.shape[1]
    if not isinstance(positions_BT, jax.core.Tracer):
        values = np.asarray(positions_BT)
        if values.size and (values.min() < 0 or values.max() >= length):
            raise ValueError(
                f"randomized: training positions range over [{values.min()}, {values.max()}]; "
                f"allowed: positions in [0, T={length}) (per-document positions from 0)"
            )
    return jnp.take_along_axis(sample_BT, positions_BT.astype(jnp.int32), axis=1, mode="fill")


@register
@dataclasses.dataclass(frozen=True)
class Randomized(PositionScheme):
    """Random ordered positions from a larger range during training, then encoded.

    Options:
      encoding: "sinusoidal" (added, default options), "learned" (a table of max_position rows),
        "rope" (default options) or "none" (only relabel: compose as "randomized+alibi" etc.).
      max_position: size of the position range; None uses 4 * max_len.
      sample_at_eval: also sample at evaluation, as the paper does (default False).
    """

    name = "randomized"
    sites = ("embed", "qk")
    paper = "Ruoss et al. 2023, arXiv 2305.16843"

    encoding: str = "sinusoidal"
    max_position: int | None = None
    sample_at_eval: bool = False

    def resolved_max_position(self, dims: Dims) -> int:
        return self.max_position if self.max_position is not None else 4 * dims.max_len

    def encoding_scheme(self, dims: Dims) -> PositionScheme | None:
        if self.encoding == "sinusoidal":
            return Sinusoidal()
        if self.encoding == "learned":
            return Learned(table_size=self.resolved_max_position(dims))
        if self.encoding == "rope":
            return RoPE()
        return None

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "encoding", self.encoding, ENCODINGS)
        if self.max_position is not None and (
            not isinstance(self.max_position, int) or self.max_position < dims.max_len
        ):
            raise ValueError(
                f"{self.name}: max_position must be an integer >= max_len={dims.max_len} or "
                f"None, got {self.max_position!r}"
            )
        encoding = self.encoding_scheme(dims)
        if encoding is not None:
            encoding.validate(dims)

    def check_decode(self, dims: Dims, cache_length: int) -> None:
        if self.sample_at_eval:
            raise NotImplementedError(
                f"{self.name}: sample_at_eval=True draws new positions for every call, so "
                "incremental decoding cannot equal a full pass; decode with sample_at_eval=False"
            )
        encoding = self.encoding_scheme(dims)
        if encoding is not None:
            encoding.check_decode(dims, cache_length)

    def embed_module(self, dims: Dims) -> EmbedSite:
        return RandomizedEmbed(dims=dims, scheme=self, name=self.name)

    def attention_module(self, dims: Dims) -> AttentionSite | None:
        encoding = self.encoding_scheme(dims)
        return encoding.attention_module(dims) if encoding is not None else None


class RandomizedEmbed(EmbedSite):
    """Relabels positions (training, or always with sample_at_eval), then the encoding's embed."""

    scheme: Randomized = Randomized()

    def setup(self) -> None:
        encoding = self.scheme.encoding_scheme(self.dims)
        self.encoding_embed = encoding.embed_module(self.dims) if encoding is not None else None

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool = True
    ) -> EmbedOutput:
        if not deterministic or self.scheme.sample_at_eval:
            batch, length = positions_BT.shape
            sample_BT = sample_ordered_positions(
                self.make_rng("positions"),
                batch,
                length,
                self.scheme.resolved_max_position(self.dims),
            )
            positions_BT = relabel_positions(positions_BT, sample_BT)
        if self.encoding_embed is None:
            return EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)
        return self.encoding_embed(x_BTD, positions_BT, deterministic)
