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
(:mod:`copejax.ops.selective_block`). The prefix kernel writes P: one program per (batch
row, key tile) walks the query tiles oldest first, accumulating the column sums of S, and
writes the sum entering each tile, (B, count_q, S) float32 (count_q padded to a power of
two): O(T^2 / Q), no (T, S) buffer. The forward kernel is FlashAttention-2's
(:mod:`copejax.ops.kernels.forward`) with the penalty added per pair: each program
recomputes the selecting head's S tile from its q and k tiles (one more Q x K x H matmul)
and ``L @ S``: three Q x Q x K bfloat16 matmuls of S split in bfloat16 pieces, exact to
float32 (:func:`~copejax.ops.kernels.exact_dots.dot_exact_f32`), on a GPU's tensor cores; one
bfloat16 or TF32 matmul would round the penalties to 3 digits. The backward is
:mod:`copejax.ops.kernels.selective_backward`.

Cost: each head's program recomputes the S tile of a pair, so a pair takes, besides
FlashAttention-2's two matmuls, one Q x K x H and three Q x Q x K (bfloat16) more in the
forward, and about as many again in the backward kernel. Memory: P (B, count_q, S) float32
lives from the prefix kernel to the forward kernel; the backward sums it again as it walks
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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_operands, term_refs
from copejax.ops.kernels.selective_tiles import (
    keep_QK,
    penalized_scores_QK,
    selection_live,
    selection_QK,
    term_bias,
)
from copejax.ops.kernels.tiles import (
    Plan,
    content_logits_QK,
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


def rows_of(count: int) -> int:
    """Rows of a per-tile buffer: ``count`` padded to a power of two (Triton's blocks)."""
    return 1 << max(count - 1, 0).bit_length()


def _prefix_kernel(*refs, plan: Plan, nonlinearity: str) -> None:
    qsel_ref, ksel_ref, qseg_ref, kseg_ref, kstart_ref, prefix_ref = refs
    kj = pl.program_id(1)
    k_first = kj * plan.size_k
    k_sel_KH, k_seg_K, k_starts_K = ksel_ref[...], kseg_ref[...], kstart_ref[...]
    first, end = plan.query_tiles(kj)  # with a window and no sinks, the tiles that see kj

    def step(qi: jax.Array, acc_K: jax.Array) -> jax.Array:
        # Every row is written once (no other store to race with on a GPU): what the older
        # query tiles selected; rows past the tiles that see kj are never read.
        prefix_ref[pl.ds(qi, 1), :] = acc_K[None, :]
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)

        def compute(acc_K: jax.Array) -> jax.Array:
            keep = keep_QK(q_first, k_first, qseg_ref[queries], k_seg_K, k_starts_K)
            logits_QK = content_logits_QK(qsel_ref[queries, :], k_sel_KH)
            return acc_K + jnp.sum(selection_QK(logits_QK, keep, nonlinearity, sigmoid_gpu), axis=0)

        def band(acc_K: jax.Array) -> jax.Array:  # a query tile (qi < count_q) that sees kj
            live = selection_live(plan, q_first, k_first, qseg_ref[queries], k_seg_K)
            return jax.lax.cond(live, compute, lambda a: a, acc_K)

        return jax.lax.cond((first <= qi) & (qi < end), band, lambda a: a, acc_K)

    rows = prefix_ref.shape[0]
    jax.lax.fori_loop(0, rows, step, jnp.zeros((plan.size_k,), jnp.float32))


def _forward_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    qsel_ref, ksel_ref, kstart_ref, prefix_ref, o_ref, lse_ref = refs[8 + num_term_refs :]
    qi = pl.program_id(2)
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


def prefix_call(
    plan: Plan,
    nonlinearity: str,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    *,
    head: int,
    ints: dict,
) -> jax.Array:
    """The prefix P (B, rows_of(count_q), S) float32: row g sums S over the queries of the
    query tiles before g (rows g >= count_q, and with a window those past the tiles that see
    the key, hold sums no pair reads). The GPU's backward sums it again as it walks, in the
    same order."""
    batch, length_q, _, dim = q_BTNH.shape
    length_k, sk, kv_head = k_BSGH.shape[1], plan.size_k, head // plan.groups
    rows = rows_of(plan.count_q)
    return pl.pallas_call(
        functools.partial(_prefix_kernel, plan=plan, nonlinearity=nonlinearity),
        grid=(batch, plan.count_k),
        in_specs=[
            pl.BlockSpec((None, length_q, None, dim), lambda b, j: (b, 0, head, 0)),
            pl.BlockSpec((None, sk, None, dim), lambda b, j: (b, j, kv_head, 0)),
            pl.BlockSpec((None, length_q), lambda b, j: (b, 0)),
            pl.BlockSpec((None, sk), lambda b, j: (b, j)),
            pl.BlockSpec((None, sk), lambda b, j: (b, j)),
        ],
        out_specs=pl.BlockSpec((None, rows, sk), lambda b, j: (b, 0, j)),
        out_shape=jax.ShapeDtypeStruct((batch, rows, length_k), jnp.float32),
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_selective_prefix",
    )(q_BTNH, k_BSGH, ints["q_seg"], ints["k_seg"], ints["k_start"])


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
    """The prefix and forward kernels on padded inputs.

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
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq, kv_head = plan.groups, plan.size_q, head // plan.groups
    prefix = prefix_call(plan, nonlinearity, q_BTNH, k_BSGH, head=head, ints=ints)
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
        grid=(batch, heads, plan.count_q),
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
    )
    return o_BTNW, lse_BNT
