"""PaTH's pairs between leaf chunks as a binary tree of kernel calls with one backward
(Yang et al. 2025, arXiv 2505.16381; issue 45).

:mod:`copejax.model.kernel_path` cuts the keys into leaf chunks of C and computes the pairs
inside each leaf in XLA. Every other pair (i, j) first falls into different halves of a
parent of ``C 2^l`` tokens at exactly one level l >= 1 (parents from token 0, the padded
length a power-of-two multiple of C). At that level query i is in the second half and key j
in the first, and PaTH's logit is, with every H symmetric,

    A_ij = q_i^T H_i ... H_{j+1} k_j = u_i^(l) . k'_j^(l)

with ``u^(l)_i = H_s ... H_i q_i`` (s: the start of i's half) and ``k'^(l)_j = H_e ... H_{j+1}
k_j`` (e: the end of j's half): plain attention of the second half's queries to the first
half's keys, which the fused kernels run on those rows alone, the queries from token E of
the parent (``Plan.q_offset``; :mod:`copejax.ops.kernels.offset`). Climbing a level joins two
halves a, b of a parent, with ``P_a = H_{start} ... H_{end}`` each half's product (a dense
(H, H) matrix, :func:`chunk_products` at the leaves):

    u^(l+1) = u^(l) in a, P_a u^(l) in b;   k'^(l+1) = P_b^T k'^(l) in a, k'^(l) in b;
    P^(l+1) = P_a P_b

log2(T / C) levels of O(T H^2) transforms: no queries per chunk (O(T^2 H / C)), no walk over
chunks.

One backward for every level (:func:`between_chunks`' custom VJP). The levels' pairs are
parts of each row's one softmax; the kernels' backward recomputes a pair's probability from
the row's log-sum-exp and subtracts ``D = rowsum(do o) - dlse``, so each level's backward
(:func:`copejax.ops.kernels.attend.attend_backward`) runs from the merged output and
log-sum-exp of all levels instead of its own. A level keeps only the rows it reads (its
parents' second halves' u, first halves' k', in the kernels' dtype: O(T H) per level, O(T H
log(T / C)) in all); the backward rebuilds its operands from them, recomputes the products
and reads the kept rows back for the climb's VJP (as the kernels read them). Optimization
barriers order the levels, so that XLA holds one level's operands, outputs and gradients at
a time. Shape letters: B batch, T tokens (padded), N query heads, G key/value heads, H head
dim, W value width, M chunks, X = B T / U parents, U the tokens of a parent, E = U / 2 those
of a half, C a chunk's (the leaves' in :mod:`~copejax.model.kernel_path`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.kernels.attend import attend_backward, attend_forward, output_rowsum
from copejax.ops.kernels.attention import term_arrays
from copejax.ops.kernels.offset import offset_plan
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tiles import MASKED_LOGIT


def chunk_products(w_BTGH: jax.Array, t_BTGC: jax.Array, count: int) -> jax.Array:
    """Each chunk's ``P = H_{lC} ... H_{e_l} = I - W^T T W`` (the UT transform of
    :func:`copejax.ops.path_block.path_wy`) as a dense (H, H) matrix per key/value head:
    (B, M, G, H, H) float32."""
    batch, padded, kv_heads, dim = w_BTGH.shape
    size = padded // count
    w_BMCGH = w_BTGH.reshape(batch, count, size, kv_heads, dim)
    t_BMCGC = t_BTGC.reshape(batch, count, size, kv_heads, size)
    low_rank_BMGHK = jnp.einsum("BMSGH,BMSGU,BMUGK->BMGHK", w_BMCGH, t_BMCGC, w_BMCGH)
    return jnp.eye(dim, dtype=jnp.float32) - low_rank_BMGHK


def climb(
    u_BTNH: jax.Array, kp_BTGH: jax.Array, p_BMGHH: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One level up: the M chunks of ``p_BMGHH`` joined in pairs. Returns (u, k', the
    parents' products (B, M / 2, G, H, H)), float32. Inside, X indexes the pairs, Y one
    chunk of a pair, C a chunk's tokens and Z the query heads of a key/value head."""
    batch, length, heads, dim = u_BTNH.shape
    count, kv_heads = p_BMGHH.shape[1:3]
    halves = (batch, count // 2, 2, length // count, kv_heads)
    u_BX2CGZH = u_BTNH.astype(jnp.float32).reshape(*halves, heads // kv_heads, dim)
    u_first, u_second = jnp.split(u_BX2CGZH, 2, axis=2)
    k_first, k_second = jnp.split(kp_BTGH.astype(jnp.float32).reshape(*halves, dim), 2, axis=2)
    first_BX1GHH, second_BX1GHH = _pairs(p_BMGHH)
    moved_u = jnp.einsum("BXYGHK,BXYCGZK->BXYCGZH", first_BX1GHH, u_second)
    moved_k = jnp.einsum("BXYGKH,BXYCGK->BXYCGH", second_BX1GHH, k_first)
    parents_BXGHH = jnp.einsum("BXYGHK,BXYGKL->BXGHL", first_BX1GHH, second_BX1GHH)
    u_BTNH = jnp.concatenate([u_first, moved_u], axis=2).reshape(u_BTNH.shape)
    kp_BTGH = jnp.concatenate([moved_k, k_second], axis=2).reshape(kp_BTGH.shape)
    return u_BTNH, kp_BTGH, parents_BXGHH


def parent_products(p_BMGHH: jax.Array) -> jax.Array:
    """The products of the M chunks' pairs: ``P_a P_b`` (increasing order), (B, M / 2, G, H,
    H)."""
    return jnp.einsum("BXYGHK,BXYGKL->BXGHL", *_pairs(p_BMGHH))


def _pairs(p_BMGHH: jax.Array) -> list[jax.Array]:
    """(first, second) chunk of each pair, (B, M / 2, 1, G, H, H) each."""
    batch, count = p_BMGHH.shape[:2]
    return jnp.split(p_BMGHH.reshape(batch, count // 2, 2, *p_BMGHH.shape[2:]), 2, axis=2)


def levels(length: int, chunk: int) -> int:
    """The levels above leaf chunks of ``chunk`` in ``length`` tokens (a power-of-two
    multiple of the chunk)."""
    count = length // chunk
    if count * chunk != length or count & (count - 1):
        raise ValueError(
            f"kernel: PaTH's levels need a power-of-two number of chunks of {chunk}, got "
            f"{length} tokens"
        )
    return count.bit_length() - 1


def between_chunks(
    u_BTNH: jax.Array,
    kp_BTGH: jax.Array,
    w_BTGH: jax.Array,
    t_BTGC: jax.Array,
    v_BTGW: jax.Array,
    *,
    ints: dict[str, jax.Array],
    terms: tuple[KernelTerm, ...],
    chunk: int,
    dtype: jnp.dtype,
    window: int | None,
    block: int,
    interpret: bool | None,
    backend: str,
) -> tuple[jax.Array, jax.Array]:
    """Causal PaTH attention of each query to the keys of the leaf chunks before its own.

    Args:
      u_BTNH: each query after its leaf chunk's H up to itself (u^(0)), float32.
      kp_BTGH: each key after its leaf chunk's H after itself (k'^(0)), float32.
      w_BTGH, t_BTGC: the H's vectors and each leaf chunk's UT transform (T's row per key).
      v_BTGW: values. T: a power-of-two multiple of ``chunk``.
      ints: the kernels' int32 (B, T) "q_pos", "k_pos", "q_seg", "k_seg", "k_rank".
      terms: the kernel terms (per-token values (B, T, N)); dtype: the kernels' operands'.
      window, block, interpret, backend: as :func:`copejax.model.kernel_path.path_attention`.

    Returns:
      (o_BTNW float32, lse_BTN float32; MASKED_LOGIT and 0 where a query sees no key).
    """
    length = u_BTNH.shape[1]
    top = levels(length, chunk)
    statics = tuple((t.name, t.bias) for t in terms)
    groups = u_BTNH.shape[2] // kp_BTGH.shape[2]
    plans = [  # a half's queries from token E of the parent, the first half's keys
        offset_plan(
            chunk << (level - 1),
            chunk << (level - 1),
            offset=chunk << (level - 1),
            groups=groups,
            biases=tuple(t.bias for t in terms),
            window=window,
            block_q=block,
            block_k=block,
            interpret=interpret,
            backend=backend,
        )
        for level in range(1, top + 1)
    ]

    def read_rows(level: int, u_BTNH: jax.Array, kp_BTGH: jax.Array) -> tuple:
        """The rows level ``level`` reads, in the kernels' dtype: its parents' second halves'
        queries (X, E, N, H) and first halves' keys (X, E, G, H). The climb from
        the level's chunks reads the same rows."""
        q_XENH = halves(level, u_BTNH)[:, 1].astype(dtype)
        return q_XENH, halves(level, kp_BTGH)[:, 0].astype(dtype)

    def whole(level: int, q_XENH: jax.Array, k_XEGH: jax.Array) -> tuple:
        """(B, T, ...) arrays holding those rows, zeros elsewhere."""
        q_BTNH = jnp.stack([jnp.zeros_like(q_XENH), q_XENH], axis=1)
        k_BTGH = jnp.stack([k_XEGH, jnp.zeros_like(k_XEGH)], axis=1)
        return q_BTNH.reshape(-1, length, *q_XENH.shape[2:]), k_BTGH.reshape(
            -1, length, *k_XEGH.shape[2:]
        )

    def operands(level: int, q_XENH, k_XEGH, v_BTGW, term_values: tuple) -> dict:
        """Level ``level``'s kernel operands from its rows: the parents as the batch, their
        second halves' queries from token E (the Plan's offset) against their first halves'
        keys and values."""
        second = lambda x: None if x is None else halves(level, x)[:, 1]
        first = lambda x: None if x is None else halves(level, x)[:, 0]
        values = [
            KernelTerm(*s, p, second(q_values), first(k_values))
            for s, (p, q_values, k_values) in zip(statics, term_values, strict=True)
        ]
        half = chunk << (level - 1)
        return {
            "q": q_XENH.astype(dtype),
            "k": k_XEGH.astype(dtype),
            "v": halves(level, v_BTGW)[:, 0],
            "terms": [term_arrays(t, half) for t in values],
            "cope": None,
            "sink": None,
        }

    def halves(level: int, x_BT: jax.Array) -> jax.Array:  # (B, T, ...) -> (X, 2, E, ...)
        return x_BT.reshape(-1, 2, chunk << (level - 1), *x_BT.shape[2:])

    def level_ints(level: int, ints: dict) -> dict:  # the second halves' and the first's
        return {key: halves(level, x)[:, int(key.startswith("q_"))] for key, x in ints.items()}

    def rows(level: int, x_BT: jax.Array, lse_BTN: jax.Array) -> tuple:  # kernels' layout
        """The second halves' rows: (X, E, ...) of ``x_BT`` (output, cotangent or sums) and
        (X, N, E) of ``lse_BTN``."""
        return halves(level, x_BT)[:, 1], jnp.moveaxis(halves(level, lse_BTN)[:, 1], 1, 2)

    def merge(level: int, o_BTNW, lse_BTN, new_XENW: jax.Array, new_XNE: jax.Array) -> tuple:
        """The level's output for the second halves merged into every row's so far (level
        1: the first halves' rows start with no key)."""
        new_XEN = jnp.moveaxis(new_XNE, 1, 2)
        if o_BTNW is None:
            o_X2ENW = jnp.stack([jnp.zeros_like(new_XENW), new_XENW], axis=1)
            lse_X2EN = jnp.stack([jnp.full_like(new_XEN, MASKED_LOGIT), new_XEN], axis=1)
        else:
            o_X2ENW, lse_X2EN = halves(level, o_BTNW), halves(level, lse_BTN)
            o_XENW, lse_XEN = merge_softmaxes(o_X2ENW[:, 1], lse_X2EN[:, 1], new_XENW, new_XEN)
            o_X2ENW = jnp.stack([o_X2ENW[:, 0], o_XENW], axis=1)
            lse_X2EN = jnp.stack([lse_X2EN[:, 0], lse_XEN], axis=1)
        shape = (-1, length, *new_XENW.shape[2:])
        return o_X2ENW.reshape(shape), lse_X2EN.reshape(shape[:-1])

    @jax.custom_vjp
    def run(tensors: tuple, ints: dict, term_values: tuple) -> tuple[jax.Array, jax.Array]:
        return forward(tensors, ints, term_values)[0]

    def forward(tensors: tuple, ints: dict, term_values: tuple) -> tuple:
        u_BTNH, kp_BTGH, w_BTGH, t_BTGC, v_BTGW = tensors
        p_BMGHH = chunk_products(w_BTGH, t_BTGC, length // chunk)
        kept, o_BTNW, lse_BTN = [], None, None
        for level, plan in enumerate(plans, start=1):
            kept.append(read_rows(level, u_BTNH, kp_BTGH))
            arrays = operands(level, *kept[-1], v_BTGW, term_values)
            (o_XENW, lse_XNE), _ = attend_forward(plan, arrays, level_ints(level, ints))
            o_BTNW, lse_BTN = merge(level, o_BTNW, lse_BTN, o_XENW, lse_XNE)
            if level < top:
                u_BTNH, kp_BTGH, p_BMGHH = climb(u_BTNH, kp_BTGH, p_BMGHH)
                # the next level after this one's merge: else XLA runs every level's kernel
                # first and merges their outputs in one fusion, all of them live
                o_BTNW, lse_BTN, u_BTNH, kp_BTGH, p_BMGHH = jax.lax.optimization_barrier(
                    (o_BTNW, lse_BTN, u_BTNH, kp_BTGH, p_BMGHH)
                )
        residuals = (kept, w_BTGH, t_BTGC, v_BTGW, ints, term_values, o_BTNW, lse_BTN)
        return (o_BTNW, lse_BTN), residuals

    def backward(residuals: tuple, cotangents: tuple) -> tuple:
        # Barriers: XLA would merge the rebuilt products and operands with the forward's
        # (common subexpressions), keeping those alive from the forward on; and each level's
        # operands are rebuilt after the level above's backward.
        barrier = jax.lax.optimization_barrier
        kept, w_BTGH, t_BTGC, v_BTGW, ints, term_values, o_BTNW, lse_BTN = residuals
        w_BTGH, t_BTGC = barrier((w_BTGH, t_BTGC))
        do_BTNW, dlse_BTN = cotangents

        def leaves(w_BTGH: jax.Array, t_BTGC: jax.Array) -> jax.Array:
            return chunk_products(w_BTGH, t_BTGC, length // chunk)

        # the leaves' products, the largest, again for level 1, the last: not held through
        # the backward (1 GiB at T = 16384, (B, N, H) = (4, 16, 128))
        products = [leaves(w_BTGH, t_BTGC)]
        for _ in range(top - 1):
            products.append(parent_products(products[-1]))
        f32 = jnp.float32
        d_up = None  # cotangents of the level above's (u, k', products)
        dv_BTGW = jnp.zeros(v_BTGW.shape, f32)  # the kernels' dv per level is in v's dtype
        d_terms = jax.tree.map(jnp.zeros_like, term_values)
        # The kernels' D = rowsum(do o) - dlse, its sum for every level at once (their
        # backward rounds do to the values' dtype first): the float32 output is not held
        # through the levels. What every level slices (its first halves' values, its second
        # halves' rows of the sums, log-sum-exp and cotangents) passes each level's barrier:
        # else XLA takes every level's slices at once, the values' in the forward (as common
        # subexpressions), the rows' at the backward's start, all of them live at its peak.
        do_BTNW = do_BTNW.astype(v_BTGW.dtype)
        rowsum_BTN = output_rowsum(do_BTNW, o_BTNW)
        sliced = (v_BTGW, rowsum_BTN, lse_BTN, do_BTNW, dlse_BTN)
        for level in range(top, 0, -1):
            plan = plans[level - 1]
            if d_up is None:
                level_kept, sliced = barrier((kept[level - 1], sliced))
            else:  # the sums too: else XLA adds every level's dv at the end
                d_up, dv_BTGW, d_terms, level_kept, sliced = barrier(
                    (d_up, dv_BTGW, d_terms, kept[level - 1], sliced)
                )
            v_BTGW, rowsum_BTN, lse_BTN, do_BTNW, dlse_BTN = sliced
            if level == 1:
                w_BTGH, t_BTGC, level_kept = barrier((w_BTGH, t_BTGC, level_kept))
                products[0], pull_products = jax.vjp(leaves, w_BTGH, t_BTGC)
            q_XENH, k_XEGH = (x.astype(f32) for x in level_kept)
            if d_up is None:  # the top level: nothing above it reads its climb
                du_BTNH, dkp_BTGH = (jnp.zeros_like(x) for x in whole(level, q_XENH, k_XEGH))
                dp_BMGHH = jnp.zeros_like(products[level - 1])
            else:  # linear in (u, k'), and dP reads the rows the climb moves: the kept ones
                _, pull = jax.vjp(climb, *whole(level, q_XENH, k_XEGH), products[level - 1])
                du_BTNH, dkp_BTGH, dp_BMGHH = pull(d_up)
            arrays, pull_arrays = jax.vjp(
                lambda *a, level=level: operands(level, *a), q_XENH, k_XEGH, v_BTGW, term_values
            )
            rowsum_XEN, lse_XNE = rows(level, rowsum_BTN, lse_BTN)
            grads = attend_backward(
                plan,
                (arrays, level_ints(level, ints), None, lse_XNE),
                rows(level, do_BTNW, dlse_BTN),
                rowsum_BTN=rowsum_XEN,
            )
            grads = jax.tree.map(lambda g, a: g.astype(a.dtype), grads, arrays)
            dq_XENH, dk_XEGH, dv, dt = pull_arrays(grads)
            dq_BTNH, dk_BTGH = whole(level, dq_XENH, dk_XEGH)
            dv_BTGW = dv_BTGW + dv.astype(f32)
            d_terms = jax.tree.map(jnp.add, d_terms, dt)
            d_up = (du_BTNH + dq_BTNH, dkp_BTGH + dk_BTGH, dp_BMGHH)
        # a buffer of their own: XLA's v5p compiler failed to lay out its fusion of dt's sum
        # with the leaves' (jax 0.11.2, libtpu 0.0.48.1; v4, v5e and v6e compiled it)
        dw_BTGH, dt_BTGC = barrier(pull_products(d_up[2]))
        tensors = (d_up[0], d_up[1], dw_BTGH, dt_BTGC, dv_BTGW.astype(v_BTGW.dtype))
        return tensors, None, d_terms

    run.defvjp(forward, backward)
    term_values = tuple((t.params_NP, t.q_values_BTN, t.k_values_BSN) for t in terms)
    return run((u_BTNH, kp_BTGH, w_BTGH, t_BTGC, v_BTGW), ints, term_values)


def merge_softmaxes(
    o_BTNW: jax.Array | None, lse_BTN: jax.Array | None, new_BTNW: jax.Array, new_BTN: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Two softmaxes of each row as one, by their log-sum-exps (the first may be None):
    (output (B, T, N, W), log-sum-exp (B, T, N))."""
    if o_BTNW is None:
        return new_BTNW, new_BTN
    total_BTN = jnp.logaddexp(lse_BTN, new_BTN)
    merged_BTNW = (
        jnp.exp(lse_BTN - total_BTN)[..., None] * o_BTNW
        + jnp.exp(new_BTN - total_BTN)[..., None] * new_BTNW
    )
    return merged_BTNW, total_BTN
