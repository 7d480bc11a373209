"""PaTH's block term for the blockwise engine (Yang et al. 2025, arXiv 2505.16381).

The logits ``A_ij = q_i^T (H_i H_{i-1} ... H_{j+1}) k_j`` with ``H_s = I - beta_s w_s w_s^T``
(:mod:`copejax.positions.path`). Every H_s is symmetric, so ``A_ij = (H_{j+1} ... H_i q_i)^T
k_j``: walking key blocks from the newest to the oldest, the engine carries each query
transformed by the H of the newer key blocks, ``r_i`` (the carry holds ``r - q``).

Per key block of C keys c .. c + C - 1 (blocks from key 0), the UT transform (Joffrain et al.
2006; the paper's section 3.2) writes the product of the block's H in increasing order as

    H_c H_{c+1} ... H_{c+C-1} = I - W^T T W,   T = (I + diag(beta) striu(W W^T))^{-1} diag(beta)

with W the rows w_s and T upper triangular. The inverse of a contiguous principal sub-block of
a triangular matrix is the same sub-block of its inverse, so a contiguous range r of the block
has ``prod_{s in r} H_s = I - W_r^T T[r, r] W_r`` (increasing s). For query i and key j of
the block, with m the block's last key at or before query i, the range is (j, m]:

    A_ij = r_i . k_j - sum_{s, u in (j, m]} (k_j . w_s) T_su (w_u . r_i)

and since T_su = 0 unless s <= u, the range test splits into ``s > j`` and ``u <= m``:

    A = r k^T - Y L,   Y_is = sum_u [u <= m_i] (r_i . w_u) T_su,   L_sj = [s > j] (w_s . k_j)

(fla-org/flash-linear-attention computes the intra-chunk logits the same way,
``fla/ops/path_attn/intra_chunk_preprocess_fwd.py``), and the carry after the block is
``H_c ... H_m r_i = r_i - sum_s Y_is w_s``. Every step is a matrix product of the block:
O(Q C H + Q C^2) per pair, no walk over keys. A key block older than every query
(m = c + C - 1 for all i) reads each key's in-block suffix ``k'_j = H_{c+C-1} ... H_{j+1} k_j``
(:func:`path_wy`), one product fewer. No (T, S) array: O(T) memory.

Shape letters: B batch, S keys, N heads, H head dim, Q / K (and C) query / key block length,
G key blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import PairBlock


def _blocked(x_BS: jax.Array, size: int) -> jax.Array:
    """(B, S, ...) -> (B, G, size, ...), zero-padded."""
    pad = -x_BS.shape[1] % size
    x_BS = jnp.pad(x_BS, [(0, 0), (0, pad)] + [(0, 0)] * (x_BS.ndim - 2))
    return x_BS.reshape(x_BS.shape[0], -1, size, *x_BS.shape[2:])


@jax.custom_vjp
def unit_upper_inverse(u_XCC: jax.Array) -> jax.Array:
    """The inverse of unit upper triangular matrices (..., C, C), by block doubling.

    Starting from the 1 x 1 diagonal blocks (ones), each level joins neighbouring diagonal
    blocks: ``[[A, B], [0, D]]^{-1} = [[A^{-1}, -A^{-1} B D^{-1}], [0, D^{-1}]]``, log2(C)
    levels of batched matrix products. Every intermediate is a principal sub-block of the
    inverse (so no value larger than the inverse's own), as in back substitution. Used instead
    of ``jax.scipy.linalg.solve_triangular``, whose XLA CPU program intermittently hung (a
    thread waiting forever) inside the PaTH layer's forward+backward on a loaded 2-core CPU.
    The backward is the inverse's own (a custom VJP that keeps only the inverse).
    """
    size = u_XCC.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()
    batch = u_XCC.shape[:-2]
    if padded != size:  # identity rows and columns after the last
        pad = [(0, 0)] * len(batch) + [(0, padded - size)] * 2
        u_XCC = jnp.pad(u_XCC, pad) + jnp.diag((jnp.arange(padded) >= size).astype(u_XCC.dtype))
    inv_XMSS = jnp.ones((*batch, padded, 1, 1), u_XCC.dtype)
    width = 1
    while width < padded:
        count = padded // (2 * width)
        blocks_XMCC = u_XCC.reshape(*batch, count, 2 * width, count, 2 * width)
        blocks_XMCC = jnp.moveaxis(jnp.diagonal(blocks_XMCC, axis1=-4, axis2=-2), -1, -3)
        upper_XMSS = blocks_XMCC[..., :width, width:]
        first_XMSS, second_XMSS = inv_XMSS[..., 0::2, :, :], inv_XMSS[..., 1::2, :, :]
        corner_XMSS = -first_XMSS @ upper_XMSS @ second_XMSS
        top_XMSC = jnp.concatenate([first_XMSS, corner_XMSS], axis=-1)
        bottom_XMSC = jnp.concatenate([jnp.zeros_like(second_XMSS), second_XMSS], axis=-1)
        inv_XMSS = jnp.concatenate([top_XMSC, bottom_XMSC], axis=-2)
        width *= 2
    return inv_XMSS[..., 0, :size, :size]


def _inverse_forward(u_XCC: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_XCC = unit_upper_inverse(u_XCC)
    return inv_XCC, inv_XCC


def _inverse_backward(inv_XCC: jax.Array, grad_XCC: jax.Array) -> tuple[jax.Array]:
    """X = U^{-1}: dX = -X dU X, so dL/dU = -X^T (dL/dX) X^T. Keeps X only (the levels'
    products would keep log2(C) arrays of the size of U for the backward)."""
    inv_t_XCC = jnp.swapaxes(inv_XCC, -1, -2)
    return (-(inv_t_XCC @ grad_XCC @ inv_t_XCC),)


unit_upper_inverse.defvjp(_inverse_forward, _inverse_backward)


def path_wy(
    k_BSNH: jax.Array, w_BSNH: jax.Array, beta_BSN: jax.Array, size: int
) -> tuple[jax.Array, jax.Array]:
    """The UT / WY form of each key block of ``size`` keys (blocks from key 0), float32.

    The block's product ``P = H_c H_{c+1} ... H_{c+K-1}`` is ``I - W^T T W`` with W the rows
    w_s and T = (I + diag(beta) striu(W W^T))^{-1} diag(beta), upper triangular (the UT
    transform; Joffrain et al. 2006, as PaTH's section 3.2 uses it). A contiguous sub-range of
    the block has the sub-matrix of T (T^{-1} is triangular). Returns (T's row of each key
    (B, S, N, K), each key's in-block suffix ``k'_j = H_{c+K-1} ... H_{j+1} k_j`` (B, S, N, H)).
    """
    length = k_BSNH.shape[1]
    w_BGKNH = _blocked(w_BSNH.astype(jnp.float32), size)
    k_BGKNH = _blocked(k_BSNH.astype(jnp.float32), size)
    beta_BGNK = jnp.moveaxis(_blocked(beta_BSN.astype(jnp.float32), size), 2, 3)
    gram_BGNKK = jnp.einsum("BGSNH,BGUNH->BGNSU", w_BGKNH, w_BGKNH)
    upper_KK = jnp.triu(jnp.ones((size, size), bool), 1)
    unit_BGNKK = jnp.eye(size) + jnp.where(upper_KK, beta_BGNK[..., None] * gram_BGNKK, 0.0)
    t_BGNKK = unit_upper_inverse(unit_BGNKK) * beta_BGNK[..., None, :]
    # k'_j = (H_{j+1} ... H_{e-1})^T k_j = k_j - sum_{s, u > j} w_s T_us (w_u . k_j)
    later_KK = jnp.tril(jnp.ones((size, size), bool), -1)  # [u, j]: u > j
    proj_BGNUJ = jnp.where(later_KK, jnp.einsum("BGUNH,BGJNH->BGNUJ", w_BGKNH, k_BGKNH), 0.0)
    mixed_BGNSJ = jnp.where(later_KK, jnp.einsum("BGNUS,BGNUJ->BGNSJ", t_BGNKK, proj_BGNUJ), 0.0)
    kp_BGKNH = k_BGKNH - jnp.einsum("BGSNH,BGNSJ->BGJNH", w_BGKNH, mixed_BGNSJ)
    t_BSNK = jnp.moveaxis(t_BGNKK, 2, 3).reshape(k_BSNH.shape[0], -1, *t_BGNKK.shape[2:4])
    kp_BSNH = kp_BGKNH.reshape(k_BSNH.shape[0], -1, *k_BSNH.shape[2:])
    return t_BSNK[:, :length], kp_BSNH[:, :length]


def path_block_logits(
    r_BQNH: jax.Array,
    k_BKNH: jax.Array,
    w_BKNH: jax.Array,
    t_BKNK: jax.Array,
    *,
    q_index_Q: jax.Array,
    k_index_K: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Unscaled PaTH logits of one key block holding some of the queries, in matrix form.

    ``r_BQNH`` are the queries transformed by the H of every newer key block; ``t_BKNK`` the
    block's UT transform (row s of T for key s, :func:`path_wy`). Query i takes the H of the
    block's keys u <= ``q_index_Q[i]`` (``k_index_K[u]``). Returns (logits (B, N, Q, K)
    float32, r after the block: ``H_c ... H_m r_i``).
    """
    f32 = jnp.float32
    r_BQNH, k_BKNH, w_BKNH = (a.astype(f32) for a in (r_BQNH, k_BKNH, w_BKNH))
    upto_QK = k_index_K[None, :] <= q_index_Q[:, None]  # [i, u]: u <= m_i
    rw_BQNK = jnp.where(upto_QK[:, None], jnp.einsum("BQNH,BUNH->BQNU", r_BQNH, w_BKNH), 0.0)
    y_BQNK = jnp.einsum("BQNU,BSNU->BQNS", rw_BQNK, t_BKNK.astype(f32))
    size = k_BKNH.shape[1]
    later_KK = jnp.tril(jnp.ones((size, size), bool), -1)  # [s, j]: s > j
    wk_BNKK = jnp.where(later_KK, jnp.einsum("BSNH,BJNH->BNSJ", w_BKNH, k_BKNH), 0.0)
    logits_BNQK = jnp.einsum("BQNH,BKNH->BNQK", r_BQNH, k_BKNH)
    logits_BNQK = logits_BNQK - jnp.einsum("BQNS,BNSJ->BNQJ", y_BQNK, wk_BNKK)
    return logits_BNQK, r_BQNH - jnp.einsum("BQNS,BSNH->BQNH", y_BQNK, w_BKNH)


def path_pair(
    params: None, pair: PairBlock, prepared: None, carry: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The engine's block term: PaTH logits minus the content logits for one pair; the carry is
    ``r - q`` for the query block (zeros before its newest key block).

    ``pair.k_arrays``: "w" (B, K, N, H), "t" (T's rows, B, K, N, K) and "k_suffix" (B, K, N, H)
    of :func:`path_wy`. A key block entirely older than every query of the block (all but the
    diagonal in self-attention) takes the WY form: logits ``r . k'`` and the carry
    ``r <- P r = r - W^T T W r``. A block that holds some of the queries takes
    :func:`path_block_logits`, since each query stops at its own key.
    """
    size_q, size_k = pair.q_BQNH.shape[1], pair.k_BKNH.shape[1]
    q_BQNH = pair.q_BQNH.astype(jnp.float32)
    r_BQNH = q_BQNH + carry
    w_BKNH = pair.k_arrays["w"].astype(jnp.float32)
    t_BKNK = pair.k_arrays["t"]

    def older(r_BQNH: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits_BNQK = jnp.einsum("BQNH,BKNH->BNQK", r_BQNH, pair.k_arrays["k_suffix"])
        a_BQNK = jnp.einsum("BKNH,BQNH->BQNK", w_BKNH, r_BQNH)
        b_BQNK = jnp.einsum("BSNK,BQNK->BQNS", t_BKNK, a_BQNK)
        return logits_BNQK, r_BQNH - jnp.einsum("BKNH,BQNK->BQNH", w_BKNH, b_BQNK)

    def holding(r_BQNH: jax.Array) -> tuple[jax.Array, jax.Array]:
        return path_block_logits(
            r_BQNH,
            pair.k_BKNH,
            w_BKNH,
            t_BKNK,
            q_index_Q=pair.q_start + jnp.arange(size_q),
            k_index_K=pair.k_start + jnp.arange(size_k),
        )

    logits_BNQK, r_BQNH = jax.lax.cond(
        pair.q_start >= pair.k_start + size_k - 1, older, holding, r_BQNH
    )
    scale = 1.0 / math.sqrt(q_BQNH.shape[-1])
    return logits_BNQK * scale - pair.logits_BNQK, r_BQNH - q_BQNH
