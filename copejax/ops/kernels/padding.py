"""Tile lengths, the padding of the fused kernels' operands and the window's check (issue 45).

The kernels read whole tiles, so T and S are padded to a multiple of them: queries, keys and
values with zeros; positions repeat the last one; padding tokens get segment ids no real
token has (different for queries and keys, so a padding query sees no key) and a rank
that makes no padding key a sink.

Shape letters: B batch, T tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from copejax.ops.kernels.lever import TracingLever
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_params import LANES

MIN_BLOCK = 16  # Triton's smallest matmul tile
NOT_A_SINK = 2**30  # the rank given to padding keys
_FULL_TILES: TracingLever[bool] = TracingLever(True)  # full_tiles_for_tracing's setting


@contextlib.contextmanager
def full_tiles_for_tracing(full_tiles: bool | None) -> Iterator[None]:
    """Plans made inside run full pairs without the mask (True, the default) or masked like
    every other pair (False; None: the default): the GPU benchmark's lever
    (``Plan.full_tiles``), which only a GPU can say pays."""
    with _FULL_TILES.setting(full_tiles):
        yield


def check_window(window: int | None) -> None:
    """A sliding window is a positive integer, or None for full causal attention."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"kernel: window must be a positive integer or None, got {window!r}")


def tile_length(block: int, length: int) -> int:
    """A power-of-two tile of at most ``block``, no longer than needed for ``length``."""
    if isinstance(block, bool) or not isinstance(block, int) or block < MIN_BLOCK:
        raise ValueError(f"kernel: block must be an integer >= {MIN_BLOCK}, got {block!r}")
    if block & (block - 1):
        raise ValueError(f"kernel: block must be a power of two, got {block}")
    size = MIN_BLOCK
    while size < min(block, length):
        size *= 2
    return size


def tiled_plan(
    length: int,
    *,
    block_q: int,
    block_k: int,
    backend: str,
    interpret: bool | None,
    **fields: object,
) -> Plan:
    """A call's :class:`~copejax.ops.kernels.tiles.Plan`: power-of-two tiles of at most
    ``block_q`` / ``block_k`` (on a TPU key tiles of at least 128: a (1, K) block of per-key
    integers needs K % 128 == 0, or K >= S), T padded to a multiple of both, interpret mode
    (None: everywhere but on the backend's device); ``fields``: the Plan's other fields."""
    size_q, size_k = tile_length(block_q, length), tile_length(block_k, length)
    if backend == "tpu":
        size_k = tile_length(max(block_k, LANES), length)
    if interpret is None:
        interpret = jax.default_backend() != ("tpu" if backend == "tpu" else "gpu")
    padded = -(-length // max(size_q, size_k)) * max(size_q, size_k)
    fields.setdefault("full_tiles", _FULL_TILES.value())
    return Plan(
        size_q=size_q,
        size_k=size_k,
        count_q=padded // size_q,
        count_k=padded // size_k,
        interpret=bool(interpret),
        backend=backend,
        **fields,
    )


def power_of_two(size: int) -> int:
    """The smallest power of two at least ``size`` (1 for 0)."""
    return 1 << max(size - 1, 0).bit_length()


def pad_tokens(x: jax.Array, length: int, value: jax.Array | float | None = None) -> jax.Array:
    """Pads axis 1 to ``length``: with ``value``, or repeating the last entry (None)."""
    extra = length - x.shape[1]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, extra)
    if value is None:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def token_ints(
    q_positions_BT: jax.Array,
    k_positions_BT: jax.Array,
    segment_ids_BT: jax.Array,
    k_rank_BT: jax.Array | None,
    padded: int,
    *,
    k_segment_ids_BS: jax.Array | None = None,
    padded_k: int | None = None,
) -> dict[str, jax.Array]:
    """The kernels' int32 operands: "q_pos", "q_seg" (B, padded) and "k_pos", "k_seg",
    "k_rank" (each key's rank in its segment; zeros when None, no sink tokens) (B,
    padded_k). The keys' segment ids and length are the queries' unless given (a call whose
    queries and keys are different tokens: :mod:`copejax.ops.kernels.offset`)."""
    q_segments_BT = segment_ids_BT.astype(jnp.int32)
    k_segments_BS = q_segments_BT if k_segment_ids_BS is None else k_segment_ids_BS
    k_segments_BS = k_segments_BS.astype(jnp.int32)
    padded_k = padded if padded_k is None else padded_k
    # padding gets ids no real token has, unequal for queries and keys
    lowest = jnp.min(q_segments_BT)
    if k_segment_ids_BS is not None:
        lowest = jnp.minimum(lowest, jnp.min(k_segments_BS))
    rank_BS = jnp.zeros_like(k_segments_BS) if k_rank_BT is None else k_rank_BT
    return {
        "q_pos": pad_tokens(q_positions_BT.astype(jnp.int32), padded),
        "k_pos": pad_tokens(k_positions_BT.astype(jnp.int32), padded_k),
        "q_seg": pad_tokens(q_segments_BT, padded, lowest - 1),
        "k_seg": pad_tokens(k_segments_BS, padded_k, lowest - 2),
        "k_rank": pad_tokens(rank_BS.astype(jnp.int32), padded_k, NOT_A_SINK),
    }
