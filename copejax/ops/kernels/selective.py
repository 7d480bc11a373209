"""Selective attention's penalties in the fused kernels (Leviathan et al. 2024, arXiv
2410.02703), forward: the prefix kernel and the forward kernel.

The selecting head's scaled content logits ``l_kj`` give the selection
``S_kj = relu(l_kj)`` (or ``sigmoid``) where ``j < k``, j and k share a segment and j is not
its segment's first key, else 0; every head's scores are ``q . k / sqrt(H) - F_ij`` (plus
the other terms' biases) with
``F_ij = sum_{k < i} S_kj`` (:mod:`copejax.positions.selective`, whose naive path this
matches). The window plays no part in S: on a pair (i, j) the window allows, every k in
(j, i) also sees j, so the naive path's windowed S gives the same F there.

Query tile g holds the selectors k of its own queries, so

    F_QK = P[g, keys] + L_QQ @ S_QK,   L[i, k] = 1 where k < i (strictly lower triangular)

with ``P[g, j] = sum_{k < first query of g} S_kj``, the engine's prefix
(:mod:`copejax.ops.selective_block`), which the prefix kernel writes
(:mod:`copejax.ops.kernels.selective_prefix`): all the query tiles' rows in one call, or, where
those would pass the queries' own bytes (above T = 8192 at N = 4, H = 64 in bfloat16, tiles of
64), the prefix and forward kernels in a loop of calls of R query tiles each, the prefix
carried from one call to the next: O(T N H) at every length, B x N x R programs per forward
call. The forward kernel is FlashAttention-2's
(:mod:`copejax.ops.kernels.forward`) with the penalty added per pair: each program
recomputes the selecting head's S tile from its q and k tiles (one more Q x K x H matmul)
and ``L @ S``: three Q x Q x K bfloat16 matmuls of S split in bfloat16 pieces, exact to
float32 (:func:`~copejax.ops.kernels.exact_dots.dot_exact_f32`), on a GPU's tensor cores; one
bfloat16 or TF32 matmul would round the penalties to 3 digits. The backward is
:mod:`copejax.ops.kernels.selective_backward`.

Cost: each head's program recomputes the S tile of a pair, so a pair takes, besides
FlashAttention-2's two matmuls, one Q x K x H and three Q x Q x K (bfloat16) more in the
forward, and about as many again in the backward kernel. Memory: P (B, count_q, S) float32,
or a call's (B, R, S), lives from the prefix kernel to the forward kernel; the backward sums
it again as it walks
(:mod:`copejax.ops.kernels.selective_backward`). No (T, S) array.

The kernels add the other logit terms (:mod:`copejax.ops.kernels.terms`) as the generic ones
do, with the softmax only (no CoPE, Shaw table or stick-breaking beside the penalties);
pruning (``prune_threshold``, ``prune_budget``) is refused by the model layer
(:mod:`copejax.model.kernel_terms`).
Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_operands, term_refs
from copejax.ops.kernels.selective_prefix import call_tiles, prefix_call, tile_operand
from copejax.ops.kernels.selective_tiles import (
    keep_QK,
    penalized_scores_QK,
    term_bias,
)
from copejax.ops.kernels.tiles import (
    Plan,
    dot_f32,
    exp_gpu,
    sigmoid_gpu,
)
from copejax.ops.kernels.triton_params import compiler_params, gpu_scan

NONLINEARITIES = ("relu", "sigmoid")  # copejax.ops.selective's


@dataclasses.dataclass(frozen=True)
class SelectiveTerm:
    """Selective attention in the kernels: the selecting query head (its key/value head is
    ``head // (N / G)``) and the nonlinearity of S."""

    head: int
    nonlinearity: str = "relu"


def _forward_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    qsel_ref, ksel_ref, kstart_ref, prefix_ref, tile_ref, o_ref, lse_ref = refs[8 + num_term_refs :]
    qi = pl.program_id(2) + tile_ref[0]  # the call's query tiles start at tile_ref[0]
    q_first = qi * plan.size_q
    q_QH, q_pos_Q, q_seg_Q, q_sel_QH = q_ref[...], qpos_ref[...], qseg_ref[...], qsel_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple) -> tuple:
            max_Q, sum_Q, acc_QW = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, kstart_ref[keys])
            selectors = (q_sel_QH, ksel_ref[keys, :], keep, prefix_ref[keys])
            k_values = [None if r is None else r[keys] for r in kv_refs]
            bias_QK = term_bias(plan, (params, q_values, k_values), q_pos_Q, kpos_ref[keys])
            s_QK, _ = penalized_scores_QK(
                nonlinearity,
                q_QH,
                k_ref[keys, :],
                selectors,
                allowed_QK,
                bias_QK=bias_QK,
                scan=gpu_scan(),
                sigmoid=sigmoid_gpu,
            )
            new_max_Q = jnp.maximum(max_Q, jnp.max(s_QK, axis=1))
            p_QK = jnp.where(allowed_QK, exp_gpu(s_QK - new_max_Q[:, None]), 0.0)
            rescale_Q = exp_gpu(max_Q - new_max_Q)
            v_KW = v_ref[keys, :]
            acc_QW = acc_QW * rescale_Q[:, None] + dot_f32(p_QK.astype(v_KW.dtype), v_KW, (1, 0))
            return new_max_Q, sum_Q * rescale_Q + jnp.sum(p_QK, axis=1), acc_QW

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    first, end = plan.key_tiles(qi)
    end = jnp.where(qi < plan.count_q, end, first)  # the last call's padding tiles: no keys
    init = (
        jnp.full((plan.size_q,), -1e30, jnp.float32),
        jnp.zeros((plan.size_q,), jnp.float32),
        jnp.zeros((plan.size_q, v_ref.shape[-1]), jnp.float32),
    )
    max_Q, sum_Q, acc_QW = jax.lax.fori_loop(first, end, pair, init)
    seen_Q = sum_Q > 0
    safe_sum_Q = jnp.where(seen_Q, sum_Q, 1.0)
    o_ref[...] = (acc_QW / safe_sum_Q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, max_Q + jnp.log(safe_sum_Q), 0.0)


def selective_forward_call(
    plan: Plan,
    nonlinearity: str,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    head: int,
    ints: dict[str, jax.Array],
    terms: list[dict],
) -> tuple[jax.Array, jax.Array]:
    """The prefix and forward kernels on padded inputs: one call of each, or where the
    prefix would pass the queries' bytes (:func:`call_tiles`) a loop over calls of R query
    tiles each, the prefix carried from one to the next.

    Args:
      q_BTNH, k_BSGH, v_BSGW: queries, keys and values (T, S multiples of the tiles).
      head: the selecting query head (its q and k are read from q and k, key/value head
        ``head // plan.groups``).
      ints: int32 (B, T) "q_pos", "q_seg" and (B, S) "k_pos", "k_seg", "k_rank", "k_start"
        (1 at a segment's first key).
      terms: the other terms' arrays, as :func:`copejax.ops.kernels.forward.forward_call`
        takes them.

    Returns:
      (o_BTNW float32, lse_BNT float32): the backward keeps nothing of the selection
      (:mod:`copejax.ops.kernels.selective_backward`).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    tiles = call_tiles(plan.count_q, heads, dim, q_BTNH.dtype.itemsize)
    forward = functools.partial(_forward_tiles, plan, nonlinearity, head=head)
    if tiles >= plan.count_q:
        prefix, _ = prefix_call(plan, nonlinearity, q_BTNH, k_BSGH, head=head, ints=ints)
        return forward(
            q_BTNH,
            k_BSGH,
            v_BSGW,
            ints=ints,
            terms=terms,
            prefix=prefix,
            tile=0,
            tiles=plan.count_q,
        )
    size = tiles * plan.size_q  # queries per call; the last call's padded
    calls = -(-plan.count_q // tiles)
    extra = calls * size - length_q
    pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])
    q_BTNH, ints, terms = per_query(pad, q_BTNH, ints, terms)

    def call(c: jax.Array, carry: tuple) -> tuple:
        start_BS, o_BTNW, lse_BNT = carry
        tile = c * tiles
        rows = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, tile * plan.size_q, size, axis)
        prefix, end_BS = prefix_call(
            plan,
            nonlinearity,
            q_BTNH,
            k_BSGH,
            head=head,
            ints=ints,
            tile=tile,
            rows=tiles,
            start_BS=start_BS,
        )
        call_q, call_ints, call_terms = per_query(rows, q_BTNH, ints, terms)
        o_c, lse_c = forward(
            call_q,
            k_BSGH,
            v_BSGW,
            ints=call_ints,
            terms=call_terms,
            prefix=prefix,
            tile=tile,
            tiles=tiles,
        )
        o_BTNW = jax.lax.dynamic_update_slice_in_dim(o_BTNW, o_c, tile * plan.size_q, 1)
        lse_BNT = jax.lax.dynamic_update_slice_in_dim(lse_BNT, lse_c, tile * plan.size_q, 2)
        return end_BS, o_BTNW, lse_BNT

    init = (
        jnp.zeros((batch, k_BSGH.shape[1]), jnp.float32),
        jnp.zeros((batch, calls * size, heads, v_BSGW.shape[-1]), jnp.float32),
        jnp.zeros((batch, heads, calls * size), jnp.float32),
    )
    _, o_BTNW, lse_BNT = jax.lax.fori_loop(0, calls, call, init)
    return o_BTNW[:, :length_q], lse_BNT[:, :, :length_q]


def per_query(
    f: Callable[[jax.Array, int], jax.Array], q_BTNH: jax.Array, ints: dict, terms: list[dict]
) -> tuple[jax.Array, dict, list[dict]]:
    """``f(x, axis)`` (a pad or a slice along the queries) on every per-query array: the
    queries, their positions and segment ids, and the terms' per-query values (B, N, T)."""
    ints = {**ints, "q_pos": f(ints["q_pos"], 1), "q_seg": f(ints["q_seg"], 1)}
    terms = [{**t, "q": None if t["q"] is None else f(t["q"], 2)} for t in terms]
    return f(q_BTNH, 1), ints, terms


def _forward_tiles(
    plan: Plan,
    nonlinearity: str,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    ints: dict[str, jax.Array],
    terms: list[dict],
    prefix: jax.Array,
    tile: jax.Array | int,
    tiles: int,
    head: int,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel on ``tiles`` query tiles from tile ``tile``: q_BTNH, the queries'
    ints and the terms' per-query values hold those tiles' rows, P (``prefix``) their
    prefix rows; keys whole. Returns (o_BTNW, lse_BNT) of those rows, float32."""
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq, kv_head = plan.groups, plan.size_q, head // plan.groups
    whole = pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0))
    query_tile = pl.BlockSpec((None, sq), lambda b, n, i: (b, i))
    has, term_inputs, term_specs = term_operands(plan, terms, q_block=True, k_block=False)
    kernel = functools.partial(
        _forward_kernel,
        plan=plan,
        nonlinearity=nonlinearity,
        has=has,
        num_term_refs=len(term_inputs),
    )
    o_BTNW, lse_BNT = pl.pallas_call(
        kernel,
        grid=(batch, heads, tiles),
        in_specs=[
            pl.BlockSpec((None, sq, None, dim), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
            pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
            query_tile,
            query_tile,
            whole,
            whole,
            whole,
            *term_specs,
            pl.BlockSpec((None, sq, None, dim), lambda b, n, i: (b, i, head, 0)),
            pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, kv_head, 0)),
            whole,
            pl.BlockSpec((None, None, length_k), lambda b, n, i: (b, i, 0)),
            pl.BlockSpec((1,), lambda b, n, i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, sq, None, width), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, length_q, heads, width), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, length_q), jnp.float32),
        ],
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_forward",
    )(
        q_BTNH,
        k_BSGH,
        v_BSGW,
        ints["q_pos"],
        ints["q_seg"],
        ints["k_pos"],
        ints["k_seg"],
        ints["k_rank"],
        *term_inputs,
        q_BTNH,
        k_BSGH,
        ints["k_start"],
        prefix,
        tile_operand(tile),
    )
    return o_BTNW, lse_BNT
