"""Cumulative sums for contextual schemes, on ``jax.lax.associative_scan``.

CoPE's positions are suffix sums of gates over keys, FoX's decay is a prefix sum of log forget
gates, stick-breaking's log weights are suffix sums of softplus terms. All are sums, whose
associative combine is ``+``; the same operator works blockwise: a block is summarised by its
total, and a block's scan plus the running total of the blocks already walked (the *carry*)
equals the scan of the whole sequence. ``blockwise_cumsum`` states that identity in code and
is what the blockwise attention path builds on.

Accumulation is float32 whatever the input dtype. ``impl="cumsum"`` switches to
``lax.cumsum`` (measured about 1.7-2x faster on CPU for (16, 4, 512, 512), forward and
backward; see ``python -m experiments.bench_scan``); ``impl="auto"`` picks ``cumsum`` on CPU
and ``associative_scan`` elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "associative_scan", "cumsum")


def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"scan impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "cumsum" if jax.default_backend() == "cpu" else "associative_scan"
    return impl


def cumsum(x: jax.Array, axis: int = -1, reverse: bool = False, impl: str = "auto") -> jax.Array:
    """Inclusive prefix sum (or suffix sum with ``reverse=True``) in float32.

    Args:
      x: any shape; summed along ``axis``.
      axis: the scanned axis (negative values allowed).
      reverse: suffix sums ``y[i] = sum_{j >= i} x[j]`` instead of prefix sums.
      impl: "associative_scan", "cumsum" or "auto".

    Returns:
      float32 array of the shape of ``x``.
    """
    x = x.astype(jnp.float32)
    axis = axis % x.ndim  # associative_scan(reverse=True) needs a non-negative axis
    if _resolve(impl) == "cumsum":
        return jax.lax.cumsum(x, axis=axis, reverse=reverse)
    return jax.lax.associative_scan(jnp.add, x, reverse=reverse, axis=axis)


def exclusive_cumsum(
    x: jax.Array, axis: int = -1, reverse: bool = False, impl: str = "auto"
) -> jax.Array:
    """Exclusive prefix (or suffix) sum: the inclusive sum minus the element itself."""
    return cumsum(x, axis=axis, reverse=reverse, impl=impl) - x.astype(jnp.float32)


def blockwise_cumsum(
    x: jax.Array, block: int, axis: int = -1, reverse: bool = False, impl: str = "auto"
) -> jax.Array:
    """The same sums as :func:`cumsum`, computed block by block with a carried total.

    Blocks are visited in scan order (last block first when ``reverse``); each block is
    scanned on its own and shifted by the carry, the sum of the blocks already visited.
    This is the combine that blockwise attention uses across key blocks.
    """
    x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    length = x.shape[-1]
    if length % block:
        raise ValueError(f"length {length} is not a multiple of block {block}")
    blocks = jnp.moveaxis(x.reshape(*x.shape[:-1], length // block, block), -2, 0)
    if reverse:
        blocks = blocks[::-1]

    def step(carry: jax.Array, xb: jax.Array) -> tuple[jax.Array, jax.Array]:
        yb = cumsum(xb, axis=-1, reverse=reverse, impl=impl) + carry[..., None]
        return carry + jnp.sum(xb, axis=-1), yb

    _, ys = jax.lax.scan(step, jnp.zeros(x.shape[:-1], jnp.float32), blocks)
    if reverse:
        ys = ys[::-1]
    y = jnp.moveaxis(ys, 0, -2).reshape(x.shape)
    return jnp.moveaxis(y, -1, axis)


def segment_cumsum(
    x: jax.Array, starts: jax.Array, axis: int = -1, impl: str = "associative_scan"
) -> jax.Array:
    """Inclusive prefix sum that restarts at every segment start (a segmented scan), float32.

    ``y[i] = sum of x[j]`` for ``j`` from the last start at or before ``i`` up to ``i``. With
    ``impl="associative_scan"`` the restart is exact: values and gradients before a start
    never reach the sums after it (the combine of a (sum, flag) pair is
    ``(where(flag_b, sum_b, sum_a + sum_b), flag_a | flag_b)``). ``impl="cumsum"`` subtracts
    the running total at the segment start from ``lax.cumsum`` instead: the same sums up to
    float32 rounding of the larger running total. ``"auto"`` means ``"associative_scan"``:
    this scan runs over (B, T, N) gates, not (B, N, T, S) logits, so its speed does not matter.

    Args:
      x: any shape; summed along ``axis``.
      starts: boolean, broadcastable to ``x``; True where a new segment begins (element 0
        always begins one, flagged or not).
      axis: the scanned axis.
      impl: "associative_scan", "cumsum" or "auto".

    Returns:
      float32 array of the shape of ``x``.
    """
    x = x.astype(jnp.float32)
    axis = axis % x.ndim
    starts = jnp.broadcast_to(starts, x.shape).astype(bool)
    if _resolve(impl if impl != "auto" else "associative_scan") == "cumsum":
        total = jax.lax.cumsum(x, axis=axis)
        index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
        last_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=axis)
        before_start = jnp.take_along_axis(total - x, last_start, axis=axis)
        return total - before_start

    def combine(
        a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        (sum_a, flag_a), (sum_b, flag_b) = a, b
        return jnp.where(flag_b, sum_b, sum_a + sum_b), flag_a | flag_b

    sums, _ = jax.lax.associative_scan(combine, (x, starts), axis=axis)
    return sums
