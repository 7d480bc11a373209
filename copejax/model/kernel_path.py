"""PaTH attention on the fused kernels, split at key chunks (Yang et al. 2025, arXiv
2505.16381; issue 45).

PaTH's logit is ``A_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(H)`` with the tokens'
Householder-like ``H_s = I - beta_s w_s w_s^T`` (:mod:`copejax.positions.path`). Cut the keys
into chunks of C (chunk m holds keys mC .. mC + C - 1, ending at e_m). For a key j of chunk m
and a query i of a later chunk c, the product splits at the chunk ends, and every H is
symmetric, so

    A_ij = (P_{m+1} ... P_{c-1} u_i) . k'_j / sqrt(H),   P_l = H_{lC} ... H_{e_l},
    u_i = H_{cC} ... H_i q_i,   k'_j = H_{e_m} ... H_{j+1} k_j

(increasing order inside each P_l: the transpose of the decreasing product). Writing
``q'_i^(m) = P_{m+1} ... P_{c-1} u_i`` for the query transformed down to the end of chunk
m, the pairs between chunks are plain attention whose query depends on the key's chunk,
which the fused kernels run with ``Plan.chunk`` (:mod:`copejax.ops.kernels.chunked`): no
transform inside the kernels, no (T, S) array.

Here, in XLA:

- each chunk's UT transform (:func:`copejax.ops.path_block.path_wy` with blocks of C): the
  keys' in-chunk suffixes k', and each chunk's product as a dense (H, H) matrix
  ``P = I - W^T T W`` per key/value head;
- the pairs within a chunk, as :func:`copejax.ops.path_block.path_block_logits` gives them
  for a block holding its queries (a (C, C) product per chunk: O(T C) memory), with the other
  parts' kernel terms evaluated on the chunk as one tile, the mask and a float32 softmax;
  the same call gives u (the query after its own chunk's transforms);
- q'^(m) for every chunk m, by a scan from the newest chunk to the oldest (``r <- P_m r``):
  (B, M, N, T, H), O(T^2 H / C) memory and O(T^2 H^2 / C) flops;
- the merge of the two softmaxes of each row by their log-sum-exps (and GPT-OSS's sink).

JAX differentiates all of it, the kernels through their custom VJP (the log-sum-exp's
cotangent included), the scan of q'^(m) through its own (:func:`_queries_per_chunk`: it keeps
no float32 state per chunk, reading back the queries the kernels keep); the UT transforms and
the pairs within chunks are rematerialised in the backward (``jax.checkpoint``), so that
their (C, C) intermediates are not live beside the queries per chunk. C trades the queries
per chunk (T^2 H / C) against the chunks' dense pairs (T C): :func:`path_chunk` takes the
power of two nearest ``sqrt(T H / 8)``, at least the kernels' tile. Shape letters: B batch,
T queries (= S keys), N query heads, G key/value heads, H head dim, W value width, M chunks,
C keys per chunk, X = B M chunks in a batch.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.chunked import chunked_attention
from copejax.ops.kernels.terms import KernelTerm, tile_bias_QK
from copejax.ops.kernels.tiles import MASKED_LOGIT
from copejax.ops.kernels.tpu_params import LANES, kernel_backend
from copejax.ops.path_block import path_block_logits, path_wy
from copejax.ops.segments import pair_allowed_BQK
from copejax.positions.context import repeat_kv_heads

PATH = "path"


def path_refusal(names: list[str]) -> str | None:
    """Why the kernels cannot run PaTH with the other parts ``names``, or None: its logits
    replace the content logits, which CoPE's gates, selective attention's selection, Shaw's
    ``q . e`` and XL's widened queries read, and its two softmaxes per row need the softmax."""
    others = sorted(
        {"cope", "selective", "relative", "relative_capped", "transformer_xl", "stickbreaking"}
        & set(names)
    )
    if others or names.count(PATH) > 1:
        return (
            f"its transformed logits with {others or [PATH]} (the kernels run PaTH with the "
            "softmax and position-only terms)"
        )
    return None


def path_chunk(length: int, head_dim: int, tile: int) -> int:
    """C: the power of two nearest ``sqrt(T H / 8)``, at least ``tile`` (a multiple of the
    kernels' tiles)."""
    target = math.sqrt(length * head_dim / 8)
    return max(tile, 1 << max(round(math.log2(max(target, 1.0))), 0))


def path_attention(
    term: BlockTerm,
    q_BTNH: jax.Array,
    k_BTGH: jax.Array,
    v_BTGW: jax.Array,
    *,
    q_positions_BT: jax.Array,
    k_positions_BT: jax.Array,
    segment_ids_BT: jax.Array,
    terms: tuple[KernelTerm, ...] = (),
    window: int | None = None,
    block: int = 64,
    chunk: int | None = None,
    interpret: bool | None = None,
    sink_N: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Causal PaTH self-attention: the pairs between chunks on the fused kernels, those within
    a chunk in XLA.

    Args:
      term: PaTH's block term (``k_arrays`` "w" (B, T, N, H) and "beta" (B, T, N), each key/value
        head's repeated to its query heads, as the site gives them).
      q_BTNH, k_BTGH, v_BTGW: queries, and the keys and values of the G key/value heads.
      terms: the other parts' kernel terms (PaTH-FoX's forget gates: ``path+fox``).
      window: sliding window W (no sink tokens: PaTH refuses them).
      block: the kernels' tile length; chunk: C (None: :func:`path_chunk`).
      sink_N: GPT-OSS's sink logit per head, joining each row's softmax denominator.
      backend: the kernels' ("triton", "tpu" or None: "tpu" on a TPU); on a TPU C is at
        least 128, its key tiles.

    Returns:
      y_BTNW in ``v_BTGW``'s dtype.
    """
    f32 = jnp.float32
    batch, length, heads, dim = q_BTNH.shape
    kv_heads = k_BTGH.shape[2]
    groups = heads // kv_heads
    backend = kernel_backend(backend)
    tile = max(block, LANES) if backend == "tpu" else block
    chunk = path_chunk(length, dim, tile) if chunk is None else chunk
    count = -(-length // chunk)
    padded = count * chunk

    def pad(x: jax.Array, value: float | None = 0.0) -> jax.Array:
        widths = [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2)
        if value is None:
            return jnp.pad(x, widths, mode="edge")
        return jnp.pad(x, widths, constant_values=value)

    # Transforms per key/value head (the site repeats them to the query heads); padding keys
    # get beta = 0 (H = I).
    w_BTGH = pad(term.k_arrays["w"][:, :, ::groups].astype(f32))
    beta_BTG = pad(term.k_arrays["beta"][:, :, ::groups].astype(f32))
    q_BTNH, k_BTGH, v_BTGW = pad(q_BTNH), pad(k_BTGH), pad(v_BTGW)
    # rematerialised: the UT transform's triangular solves kept (B M, G, C, C) float32
    # residuals at the backward's peak (about 540 MiB at T = 16384, (B, N, H) = (2, 4, 64))
    t_BTGC, suffix_BTGH = jax.checkpoint(path_wy, static_argnums=(3,))(
        k_BTGH, w_BTGH, beta_BTG, chunk
    )
    terms_padded = _padded_terms(terms, padded - length)  # per-token values, zeros
    segments_BT = segment_ids_BT.astype(jnp.int32)
    lowest = jnp.min(segments_BT)  # padding: ids no real token has, unequal q and k
    ints = {
        "q_pos": pad(q_positions_BT.astype(jnp.int32), None),
        "k_pos": pad(k_positions_BT.astype(jnp.int32), None),
        "q_seg": pad(segments_BT, lowest - 1),
        "k_seg": pad(segments_BT, lowest - 2),
    }

    def chunks(x_BT: jax.Array) -> jax.Array:  # (B, T, ...) -> (X, C, ...)
        return x_BT.reshape(batch * count, chunk, *x_BT.shape[2:])

    within_XNCW, within_lse_XNC, u_XCNH = _within_chunks_remat(
        chunks(q_BTNH),
        *(chunks(repeat_kv_heads(x, heads)) for x in (k_BTGH, w_BTGH, t_BTGC, v_BTGW)),
        ints={key: chunks(value) for key, value in ints.items()},
        terms=terms_padded,
        window=window,
    )
    y_BTNW = jnp.moveaxis(within_XNCW, 1, 2).reshape(batch, padded, heads, -1)
    lse_BTN = jnp.moveaxis(within_lse_XNC, 1, 2).reshape(batch, padded, heads)
    if count > 1:
        u_BNTH = jnp.moveaxis(u_XCNH.reshape(batch, padded, heads, dim), 2, 1)
        products_BMGHH = _chunk_products(w_BTGH, t_BTGC, count)
        q_BMNTH = _queries_per_chunk(u_BNTH, products_BMGHH, chunk, q_BTNH.dtype)
        between_BTNW, between_lse_BTN = chunked_attention(
            q_BMNTH,
            suffix_BTGH.astype(k_BTGH.dtype),
            v_BTGW,
            chunk=chunk,
            q_positions_BT=ints["q_pos"],
            k_positions_BT=ints["k_pos"],
            segment_ids_BT=ints["q_seg"],
            terms=terms_padded,
            window=window,
            block_q=block,
            block_k=block,
            interpret=interpret,
            backend=backend,
        )
        total_BTN = jnp.logaddexp(lse_BTN, between_lse_BTN)
        y_BTNW = (
            jnp.exp(lse_BTN - total_BTN)[..., None] * y_BTNW
            + jnp.exp(between_lse_BTN - total_BTN)[..., None] * between_BTNW
        )
        lse_BTN = total_BTN
    if sink_N is not None:  # one more logit in the denominator, mixing no value
        total_BTN = jnp.logaddexp(lse_BTN, sink_N.astype(f32))
        y_BTNW = jnp.exp(lse_BTN - total_BTN)[..., None] * y_BTNW
    return y_BTNW[:, :length].astype(v_BTGW.dtype)


def _within_chunks_remat(
    *tensors: jax.Array,
    ints: dict[str, jax.Array],
    terms: tuple[KernelTerm, ...],
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_within_chunks` under ``jax.checkpoint``: its backward recomputes the chunks'
    (C, C) logits, probabilities and UT products instead of keeping them from the forward,
    where they were live beside the queries per chunk and dq per chunk at the backward's
    peak (nine (B M, N, C, C) float32 arrays, 1.1 GiB of 3.7 at T = 16384, (B, N, H) = (2, 4,
    64), on the H100 target)."""
    statics = tuple((t.name, t.bias) for t in terms)

    def within(tensors: tuple, ints: dict, arrays: tuple) -> tuple:
        rebuilt = tuple(KernelTerm(*s, *a) for s, a in zip(statics, arrays, strict=True))
        return _within_chunks(*tensors, ints=ints, terms=rebuilt, window=window)

    arrays = tuple((t.params_NP, t.q_values_BTN, t.k_values_BSN) for t in terms)
    return jax.checkpoint(within)(tensors, ints, arrays)


def _within_chunks(
    q_XCNH: jax.Array,
    k_XCNH: jax.Array,
    w_XCNH: jax.Array,
    t_XCNC: jax.Array,
    v_XCNW: jax.Array,
    *,
    ints: dict[str, jax.Array],
    terms: tuple[KernelTerm, ...],
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pairs within each chunk: (output (X, N, C, W) float32, log-sum-exp (X, N, C),
    MASKED_LOGIT for a query with no key; u (X, C, N, H), each query after its chunk's H up
    to itself)."""
    size = q_XCNH.shape[1]
    index_C = jnp.arange(size)
    logits_XNCC, u_XCNH = path_block_logits(
        q_XCNH, k_XCNH, w_XCNH, t_XCNC, q_index_Q=index_C, k_index_K=index_C
    )
    scores_XNCC = logits_XNCC / math.sqrt(q_XCNH.shape[-1])
    if terms:
        scores_XNCC = scores_XNCC + _term_bias_XNCC(terms, ints, size)
    allowed_X1CC = pair_allowed_BQK(ints["q_seg"], ints["k_seg"], 0, 0, window=window)[:, None]
    scores_XNCC = jnp.where(allowed_X1CC, scores_XNCC, MASKED_LOGIT)
    max_XNC = jnp.max(scores_XNCC, axis=-1)
    p_XNCC = jnp.where(allowed_X1CC, jnp.exp(scores_XNCC - max_XNC[..., None]), 0.0)
    sum_XNC = jnp.sum(p_XNCC, axis=-1)
    seen_XNC = sum_XNC > 0
    safe_XNC = jnp.where(seen_XNC, sum_XNC, 1.0)
    out_XNCW = jnp.einsum("XNQK,XKNW->XNQW", p_XNCC, v_XCNW.astype(jnp.float32))
    lse_XNC = jnp.where(seen_XNC, max_XNC + jnp.log(safe_XNC), MASKED_LOGIT)
    return out_XNCW / safe_XNC[..., None], lse_XNC, u_XCNH


def _term_bias_XNCC(
    terms: tuple[KernelTerm, ...], ints: dict[str, jax.Array], size: int
) -> jax.Array:
    """The kernel terms' bias on each chunk as one (C, C) tile per head: their tile functions,
    vmapped over heads and chunks, as the kernels evaluate them on a tile."""
    biases = tuple(t.bias for t in terms)

    def per_token(values_BTN: jax.Array | None) -> jax.Array | None:  # -> (X, N, C)
        if values_BTN is None:
            return None
        values_XCN = values_BTN.astype(jnp.float32).reshape(-1, size, values_BTN.shape[-1])
        return jnp.moveaxis(values_XCN, 2, 1)

    params = [None if t.params_NP is None else t.params_NP.astype(jnp.float32) for t in terms]
    q_values = [per_token(t.q_values_BTN) for t in terms]
    k_values = [per_token(t.k_values_BSN) for t in terms]

    def tile(p: list, qv: list, kv: list, q_pos_C: jax.Array, k_pos_C: jax.Array) -> jax.Array:
        return tile_bias_QK(biases, (p, qv, kv), q_pos_C, k_pos_C)

    per_head = jax.vmap(tile, in_axes=(0, 0, 0, None, None))
    per_chunk = jax.vmap(per_head, in_axes=(None, 0, 0, 0, 0))
    return per_chunk(params, q_values, k_values, ints["q_pos"], ints["k_pos"])


def _padded_terms(terms: tuple[KernelTerm, ...], extra: int) -> tuple[KernelTerm, ...]:
    """The terms with their per-token values padded by ``extra`` tokens (zeros)."""
    if not extra:
        return terms

    def pad(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else jnp.pad(x, ((0, 0), (0, extra), (0, 0)))

    return tuple(
        KernelTerm(t.name, t.bias, t.params_NP, pad(t.q_values_BTN), pad(t.k_values_BSN))
        for t in terms
    )


def _chunk_products(w_BTGH: jax.Array, t_BTGC: jax.Array, count: int) -> jax.Array:
    """Each chunk's ``P = H_{lC} ... H_{e_l} = I - W^T T W`` as a dense (H, H) matrix per
    key/value head: (B, M, G, H, H) float32."""
    batch, padded, kv_heads, dim = w_BTGH.shape
    size = padded // count
    w_BMCGH = w_BTGH.reshape(batch, count, size, kv_heads, dim)
    t_BMCGC = t_BTGC.reshape(batch, count, size, kv_heads, size)
    low_rank_BMGHK = jnp.einsum("BMSGH,BMSGU,BMUGK->BMGHK", w_BMCGH, t_BMCGC, w_BMCGH)
    return jnp.eye(dim, dtype=jnp.float32) - low_rank_BMGHK


def _queries_per_chunk(
    u_BNTH: jax.Array, products_BMGHH: jax.Array, size: int, dtype: jnp.dtype
) -> jax.Array:
    """q'^(m) for every chunk m: (B, M, N, T, H) in ``dtype`` (the kernels' queries), walking
    chunks from the newest to the oldest in float32. Row i of chunk m holds query i
    transformed down to chunk m's end where i is in a later chunk (elsewhere u_i, which the
    kernels never read). Heads before tokens, as the walk's per-head matmuls want them and the
    kernels read them: XLA makes no transposed copy of the output (one per use, 1 GiB each at
    T = 16384, (B, N, H) = (2, 4, 64), with the (B, M, T, N, H) layout).

    Its VJP is by hand (:func:`_queries_per_chunk_vjp`): JAX's would keep every step's float32
    state, (B, M, N, T, H), and masks of that shape, beside the output the kernels keep anyway
    (about 6 GiB of 8 at T = 16384, (B, N, H) = (2, 4, 64)); this one reads the output back
    instead, so the products' gradient takes the queries as the kernels did, rounded to
    ``dtype``."""
    dtypes = (jnp.dtype(dtype), jnp.dtype(u_BNTH.dtype))
    return _queries_per_chunk_vjp(u_BNTH, products_BMGHH, size, dtypes)


def _transform(
    products_BMGHH: jax.Array, m: jax.Array, r_BNTH: jax.Array, later_T: jax.Array, transpose: bool
) -> jax.Array:
    """Chunk m's product (or its transpose) applied to the rows of later chunks, float32."""
    batch, heads, padded, dim = r_BNTH.shape
    kv_heads = products_BMGHH.shape[2]
    product_BGHK = jax.lax.dynamic_index_in_dim(products_BMGHH, m, 1, keepdims=False)
    r_BGZTH = r_BNTH.reshape(batch, kv_heads, heads // kv_heads, padded, dim)
    spec = "BGKH,BGZTK->BGZTH" if transpose else "BGHK,BGZTK->BGZTH"
    moved_BNTH = jnp.einsum(spec, product_BGHK, r_BGZTH).reshape(r_BNTH.shape)
    return jnp.where(later_T[:, None], moved_BNTH, r_BNTH)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _queries_per_chunk_vjp(
    u_BNTH: jax.Array, products_BMGHH: jax.Array, size: int, dtypes: tuple
) -> jax.Array:
    return _queries_forward(u_BNTH, products_BMGHH, size, dtypes)[0]


def _queries_forward(
    u_BNTH: jax.Array, products_BMGHH: jax.Array, size: int, dtypes: tuple
) -> tuple[jax.Array, tuple]:
    """``dtypes``: (the output's, u's). Each step writes its chunk's queries into the output
    in place."""
    batch, heads, padded, dim = u_BNTH.shape
    chunk_T = jnp.arange(padded) // size
    count = products_BMGHH.shape[1]

    def step(i: jax.Array, state: tuple) -> tuple:
        r_BNTH, q_BMNTH = state
        m = count - 1 - i  # newest first
        q_BMNTH = jax.lax.dynamic_update_index_in_dim(q_BMNTH, r_BNTH.astype(dtypes[0]), m, 1)
        return _transform(products_BMGHH, m, r_BNTH, chunk_T > m, transpose=False), q_BMNTH

    q_BMNTH = jnp.zeros((batch, count, heads, padded, dim), dtypes[0])
    _, q_BMNTH = jax.lax.fori_loop(0, count, step, (u_BNTH.astype(jnp.float32), q_BMNTH))
    return q_BMNTH, (q_BMNTH, products_BMGHH)


def _queries_backward(size: int, dtypes: tuple, residuals: tuple, dq_BMNTH: jax.Array) -> tuple:
    """Walks the chunks from the oldest: the cotangent of the state entering chunk m's output,
    ``lam_m = dq_m + A_m^T lam_(m-1)`` (A_m: chunk m's product on the later chunks' rows),
    and ``dP_m = sum over those rows of lam_(m-1) q_m^T``, with q_m the output (the state)."""
    q_BMNTH, products_BMGHH = residuals
    batch, count, heads, padded, dim = q_BMNTH.shape
    kv_heads = products_BMGHH.shape[2]
    chunk_T = jnp.arange(padded) // size

    def step(lam_BNTH: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
        later_T = chunk_T > m
        state_BNTH = jax.lax.dynamic_index_in_dim(q_BMNTH, m, 1, keepdims=False)
        lam_BGZTH = jnp.where(later_T[:, None], lam_BNTH, 0.0).reshape(
            batch, kv_heads, heads // kv_heads, padded, dim
        )
        state_BGZTK = state_BNTH.astype(jnp.float32).reshape(lam_BGZTH.shape)
        d_product_BGHK = jnp.einsum("BGZTH,BGZTK->BGHK", lam_BGZTH, state_BGZTK)
        moved = _transform(products_BMGHH, m, lam_BNTH, later_T, transpose=True)
        cotangent = jax.lax.dynamic_index_in_dim(dq_BMNTH, m, 1, keepdims=False)
        return moved + cotangent.astype(jnp.float32), d_product_BGHK

    lam_BNTH = jnp.zeros((batch, heads, padded, dim), jnp.float32)
    lam_BNTH, d_MBGHK = jax.lax.scan(step, lam_BNTH, jnp.arange(count))
    return lam_BNTH.astype(dtypes[1]), jnp.moveaxis(d_MBGHK, 0, 1)


_queries_per_chunk_vjp.defvjp(_queries_forward, _queries_backward)
