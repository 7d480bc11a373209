"""How many carry checkpoints the GPU backward of stick-breaking and CoPE keeps per head, and
where (issue 45).

Their dk / dv programs need, for every query row, the carries entering their key tile:
stick-breaking's log stick remainder ``r`` and the ``G`` total ``u`` of the newer tiles
(:mod:`copejax.ops.kernels.stick`), CoPE's count and the newer tiles' pulls on their counts
(:mod:`copejax.ops.kernels.cope_backward`). Kept for every key tile that is O(T^2 / K) floats
per head (256 MiB at B x N = 8, T = 16384, K = 64: twice cuDNN's whole layer). Instead the
key tiles are cut into groups of consecutive tiles; the kernel that walks the query's key
tiles newest first writes the carries only as they enter each group, and one dk / dv program
per group walks its key tiles newest first, adding each pair's row sums to the carries in
place, so O(groups x T) floats per head.

Fewer groups is less memory and fewer programs. :func:`auto_groups` keeps the carries at
most twice the queries' bytes, O(T x H) like the rest of the backward: with the spare row
that takes the other tiles' stores, up to ``H x itemsize / 4`` rows per head (31 groups for
bfloat16 at H = 64, 63 at H = 128), each key tile its own group where there are fewer tiles
than that (T < 2048 at K = 64: the per-tile layout). :func:`balanced_starts` cuts the tiles
so that the groups hold about equal numbers of (query tile, key tile) pairs: under causal
attention an old key tile is seen by many more query tiles than a new one, so the old groups
hold fewer tiles. A GPU measures the cost of the fewer, longer programs against the per-tile
layout (``carry_groups_for_tracing``, the GPU benchmark's arms).

Within a dk / dv program a pair stores its rows' carries and a pair of the next key tile loads
them again, through global memory and maybe in other threads: each key tile starts behind a
barrier (:func:`copejax.ops.kernels.triton_params.program_barrier`, ``bar.sync``, which
orders the program's memory accesses). Interpret mode cannot show a missing one; the GPU
benchmark's check part runs both schemes with all key tiles in one group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from copejax.ops.kernels.lever import TracingLever
from copejax.ops.kernels.tiles import Plan

CARRY_BYTES_OVER_QUERY_BYTES = 2  # auto_groups' budget: carries over the queries' bytes
_GROUPS: TracingLever[int | None] = TracingLever(None)  # carry_groups_for_tracing's


def auto_groups(count_k: int, head_dim: int, itemsize: int) -> int:
    """The groups per head whose carry rows (two float32 per query: 8 bytes a row; the
    groups' rows plus the dq kernel's spare row, padded to a power of two) stay within
    ``CARRY_BYTES_OVER_QUERY_BYTES`` times a query row's ``head_dim x itemsize`` bytes, at
    most ``count_k`` (one per key tile), at least 1; or what
    :func:`carry_groups_for_tracing` says."""
    forced = _GROUPS.value()
    rows = 1 << max(CARRY_BYTES_OVER_QUERY_BYTES * head_dim * itemsize // 8, 1).bit_length() - 1
    groups = max(rows - 1, 1) if forced is None else forced
    return max(1, min(count_k, groups))


def balanced_starts(work: Sequence[int], groups: int) -> tuple[int, ...]:
    """The first key tile of each of ``groups`` runs of consecutive tiles, then
    ``len(work)``: each run's summed ``work`` (pairs per key tile) near an equal share, every
    run non-empty. Greedy from the oldest tile: a run closes where that lands nearest its
    share of what is left."""
    count = len(work)
    if not 1 <= groups <= count:
        raise ValueError(f"carry groups must be in [1, {count}] (key tiles), got {groups}")
    starts, left, total, run = [0], groups, float(sum(work)), 0.0
    for tile, pairs in enumerate(work):
        if run and left > 1:
            share = total / left
            # close the run before this tile where that lands nearer the share, or where
            # each later run needs one of the tiles left
            if count - tile == left - 1 or run + pairs - share > share - run:
                starts.append(tile)
                total, left, run = total - run, left - 1, 0.0
        run += pairs
    starts.append(count)
    return tuple(starts)


def carry_starts(plan: Plan, head_dim: int, itemsize: int) -> tuple[int, ...]:
    """The plan's groups (:func:`auto_groups` of them, :func:`balanced_starts` over the
    query tiles that may see each key tile)."""
    with jax.ensure_compile_time_eval():  # the plan's static ints, under a trace too
        first, end = plan.query_tiles(np.arange(plan.count_k, dtype=np.int32))  # every tile
        work = np.broadcast_to(np.maximum(np.asarray(end) - np.asarray(first), 0), first.shape)
    return balanced_starts(work.tolist(), auto_groups(plan.count_k, head_dim, itemsize))


@contextlib.contextmanager
def carry_groups_for_tracing(groups: int | None) -> Iterator[None]:
    """Stick-breaking and CoPE GPU kernels traced inside keep ``groups`` carry checkpoints per
    head (at most one per key tile; None: the enclosing setting, outside any
    :func:`auto_groups`' rule), for the GPU benchmark's arms."""
    with _GROUPS.setting(groups):
        yield
