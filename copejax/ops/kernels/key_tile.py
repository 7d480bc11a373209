"""The GPU dk / dv program: one key tile walks the query tiles that may see it (issue 45).

Shared by the softmax (:mod:`copejax.ops.kernels.backward`), stick-breaking
(:mod:`copejax.ops.kernels.stick`) and Shaw's (:mod:`copejax.ops.kernels.relative_kernels`)
dk / dv kernels: the refs' layout, the walk over query tiles with the skip of pairs that
hold no allowed entry, and the sums ``dV_j += W^T dO``, ``dk_j += dS^T q / sqrt(H)`` and the
terms' per-key values and parameters pulled back from dS
(:mod:`copejax.ops.kernels.pullbacks`). Each kernel gives only its pair's weights W (the
softmax's P, stick-breaking's A) and score cotangent dS. Shape letters as in
:mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.pullbacks import (
    key_tile_sums,
    pull_key_values_and_params,
    write_key_tile_sums,
)
from copejax.ops.kernels.tiles import Plan, dot_f32


class QueryTile(NamedTuple):
    """One walked query tile, as a kernel's pair function reads it.

    Attributes:
      rows: the tile's slice of the per-query refs (lse, D, carries).
      q_QH, do_QW: its queries and output cotangents.
      allowed_QK: the pair's mask, or None where every entry is allowed (with
        ``mask_free``, :meth:`copejax.ops.kernels.tiles.Plan.run_pair`).
      inputs: (params, q values, k values, q positions, k positions), as
        :func:`copejax.ops.kernels.tiles.scores_QK` reads them.
    """

    rows: pl.Slice
    q_QH: jax.Array
    do_QW: jax.Array
    allowed_QK: jax.Array | None
    inputs: tuple


# (query tile, k_KH, v_KW) -> (weights W (Q, K), score cotangent dS (Q, K)), float32.
PairGrads = Callable[[QueryTile, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def key_tile_program(
    refs: tuple,
    *,
    plan: Plan,
    has: tuple,
    num_term_refs: int,
    num_extra: int,
    grads: PairGrads,
    kj: jax.Array | None = None,
    mask_free: bool = False,
) -> None:
    """The dk / dv kernel body for refs (q, k, v, dO, lse, D, the five int refs, the terms'
    refs, ``num_extra`` refs of the kernel's own, then the outputs dk, dv, the terms' per-key
    gradients and parameter partial sums); ``grads`` gives each pair's W and dS. One key
    tile: the program's (its refs' blocks are the tile's), or ``kj`` of whole-row refs
    (keys, key ints and per-key outputs (S, ...), parameter sums (count_k, P): a program that
    walks several key tiles, stick-breaking's carry groups). ``mask_free``: ``grads`` takes
    a tile whose mask is None (every entry allowed) on full pairs."""
    q_ref, k_ref, v_ref, do_ref = refs[:4]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    dk_ref, dv_ref, *grad_refs = refs[11 + num_term_refs + num_extra :]
    num_dkv = sum(h[2] for h in has)
    dkv_refs, dp_refs = grad_refs[:num_dkv], grad_refs[num_dkv:]
    whole = kj is not None
    if not whole:
        kj = pl.program_id(2)
    k_first = kj * plan.size_k
    keys = pl.ds(pl.multiple_of(k_first, plan.size_k), plan.size_k) if whole else slice(None)
    k_KH, v_KW = k_ref[keys, :], v_ref[keys, :]
    k_pos_K, k_seg_K, k_rank_K = kpos_ref[keys], kseg_ref[keys], krank_ref[keys]
    params = [None if r is None else r[...] for r in p_refs]
    k_values = [None if r is None else r[keys] for r in kv_refs]
    scale = 1.0 / math.sqrt(k_KH.shape[-1])

    def pair(qi: jax.Array, state: tuple) -> tuple:
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)
        q_seg_Q = qseg_ref[queries]

        def compute(state: tuple, allowed_QK: jax.Array | None) -> tuple:
            dk_KH, dv_KW, dkv, dparams = state
            q_QH, do_QW, q_pos_Q = q_ref[queries, :], do_ref[queries, :], qpos_ref[queries]
            q_values = [None if r is None else r[queries] for r in qv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, k_pos_K)
            tile = QueryTile(queries, q_QH, do_QW, allowed_QK, inputs)
            w_QK, ds_QK = grads(tile, k_KH, v_KW)
            dv_KW = dv_KW + dot_f32(w_QK.astype(do_QW.dtype), do_QW, (0, 0))
            dk_KH = dk_KH + dot_f32((ds_QK * scale).astype(q_QH.dtype), q_QH, (0, 0))
            dkv, dparams = pull_key_values_and_params(plan, ds_QK, inputs, dkv, dparams)
            return dk_KH, dv_KW, dkv, dparams

        mask_args = (q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return plan.run_pair(mask_args, compute, state, mask_free=mask_free)

    first, end = plan.query_tiles(kj)
    sum_refs = (dkv_refs, dp_refs)
    init = key_tile_sums(plan, k_KH, v_KW, (dkv_refs, [r.at[0] if whole else r for r in dp_refs]))
    sums = jax.lax.fori_loop(first, end, pair, init)
    write_key_tile_sums(sums, dk_ref, dv_ref, sum_refs, (keys, pl.ds(kj, 1)) if whole else None)
