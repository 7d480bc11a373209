"""PaTH attention on the fused kernels: leaf chunks in XLA, the pairs between them on the
kernels in levels of chunk pairs (Yang et al. 2025, arXiv 2505.16381; issue 45).

PaTH's logit is ``A_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(H)`` with the tokens'
Householder-like ``H_s = I - beta_s w_s w_s^T`` (:mod:`copejax.positions.path`). The keys
are cut into leaf chunks of C (the kernels' tile by default), their count padded to a power of
two. Here, in XLA:

- each leaf chunk's UT transform (:func:`copejax.ops.path_block.path_wy` with blocks of C):
  T's rows and the keys' in-chunk suffixes ``k'_j = H_e ... H_{j+1} k_j`` (e: the chunk's
  end);
- the pairs within a leaf chunk, as :func:`copejax.ops.path_block.path_block_logits` gives
  them for a block holding its queries (a (C, C) product per chunk: O(T C)), with the other
  parts' kernel terms evaluated on the chunk as one tile, the mask and a float32 softmax;
  the same call gives ``u_i = H_s ... H_i q_i`` (s: the chunk's start);
- the merge of the two softmaxes of each row by their log-sum-exps (and GPT-OSS's sink).

The pairs between leaf chunks run on the kernels, in log2(T / C) levels of chunk pairs
(:func:`copejax.model.path_levels.between_chunks`): O(T H log(T / C)) memory, no (T, S)
array, no transform inside the kernels.

JAX differentiates the leaves (the levels have one custom VJP of their own). The UT
transforms and the pairs within leaves are rematerialised in the backward
(``jax.checkpoint``), the latter over groups of chunks in sequence (:func:`leaf_groups`),
so that only one group's (C, C) intermediates are live at a time. Shape letters: B batch,
T queries (= S keys), N query heads, G key/value heads, H head dim, W value width, M chunks,
C keys per chunk, X = B M chunks in a batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from copejax.model.path_levels import between_chunks, merge_softmaxes
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kernels.padding import power_of_two
from copejax.ops.kernels.terms import KernelTerm, tile_bias_QK
from copejax.ops.kernels.tiles import MASKED_LOGIT
from copejax.ops.kernels.tpu_params import LANES, kernel_backend
from copejax.ops.path_block import path_block_logits, path_wy
from copejax.ops.segments import pair_allowed_BQK
from copejax.positions.context import repeat_kv_heads

PATH = "path"
LEAF_GROUP_BYTES = 8 << 20  # one group's (chunks, N, C, C) float32 array in the leaves


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
    """Causal PaTH self-attention: the pairs between leaf chunks on the fused kernels, those
    within a leaf chunk in XLA.

    Args:
      term: PaTH's block term (``k_arrays`` "w" (B, T, N, H) and "beta" (B, T, N), each key/value
        head's repeated to its query heads, as the site gives them).
      q_BTNH, k_BTGH, v_BTGW: queries, and the keys and values of the G key/value heads.
      terms: the other parts' kernel terms (PaTH-FoX's forget gates: ``path+fox``).
      window: sliding window W (no sink tokens: PaTH refuses them).
      block: the kernels' tile length; chunk: the leaf chunks' C, a power of two and a
        multiple of the tiles (None: the kernels' key tile).
      sink_N: GPT-OSS's sink logit per head, joining each row's softmax denominator.
      backend: the kernels' ("triton", "tpu" or None: "tpu" on a TPU); on a TPU C is at
        least 128, its key tiles. T is padded to C times a power of two: the padding's
        tiles are skipped in the kernels, not in the leaves and levels' transforms.

    Returns:
      y_BTNW in ``v_BTGW``'s dtype.
    """
    f32 = jnp.float32
    batch, length, heads, dim = q_BTNH.shape
    kv_heads = k_BTGH.shape[2]
    groups = heads // kv_heads
    backend = kernel_backend(backend)
    chunk = (max(block, LANES) if backend == "tpu" else block) if chunk is None else chunk
    count = power_of_two(-(-length // chunk))  # the levels join chunks in pairs
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
    # residuals at the backward's peak
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

    def leaves(q_BTNH: jax.Array, *rest: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return _within_chunks_remat(
            chunks(q_BTNH),
            *(chunks(repeat_kv_heads(x, heads)) for x in rest),
            ints={key: chunks(value) for key, value in ints.items()},
            terms=terms_padded,
            window=window,
        )

    # rematerialised too: the leaves' groups in sequence read their chunks in a layout of
    # their own, copies of q, k, v, w and t (w and t float32) that the backward kept
    within_XNCW, within_lse_XNC, u_XCNH = jax.checkpoint(leaves)(
        q_BTNH, k_BTGH, w_BTGH, t_BTGC, v_BTGW
    )
    y_BTNW = jnp.moveaxis(within_XNCW, 1, 2).reshape(batch, padded, heads, -1)
    lse_BTN = jnp.moveaxis(within_lse_XNC, 1, 2).reshape(batch, padded, heads)
    if count > 1:
        between_BTNW, between_lse_BTN = between_chunks(
            u_XCNH.reshape(batch, padded, heads, dim),
            suffix_BTGH,
            w_BTGH,
            t_BTGC,
            v_BTGW,
            ints={**ints, "k_rank": jnp.zeros_like(ints["q_pos"])},
            terms=terms_padded,
            chunk=chunk,
            dtype=q_BTNH.dtype,
            window=window,
            block=block,
            interpret=interpret,
            backend=backend,
        )
        y_BTNW, lse_BTN = merge_softmaxes(y_BTNW, lse_BTN, between_BTNW, between_lse_BTN)
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
    """:func:`_within_chunks` over groups of chunks in sequence (``jax.lax.map``), each under
    ``jax.checkpoint``: the backward recomputes a group's (C, C) logits, probabilities and UT
    products instead of keeping them from the forward, and holds one group's at a time
    (:func:`leaf_groups`; some twenty (B M, N, C, C) float32 arrays at once were the
    backward's peak, 640 of 970 MiB at T = 16384, (B, N, H) = (2, 4, 64), on the H100
    target)."""
    statics = tuple((t.name, t.bias) for t in terms)
    count, size, heads = tensors[0].shape[:3]
    groups = leaf_groups(count, heads, size)

    def split(x: jax.Array | None) -> jax.Array | None:  # (X, ...) -> (groups, X / groups, ...)
        return None if x is None else x.reshape(groups, count // groups, *x.shape[1:])

    def per_chunk(x_BTN: jax.Array | None) -> jax.Array | None:  # (B, T, N) -> (X, C, N)
        return None if x_BTN is None else split(x_BTN.reshape(count, size, x_BTN.shape[-1]))

    def within(tensors: tuple, ints: dict, arrays: tuple) -> tuple:
        rebuilt = tuple(KernelTerm(*s, *a) for s, a in zip(statics, arrays, strict=True))
        return _within_chunks(*tensors, ints=ints, terms=rebuilt, window=window)

    def group(xs: tuple) -> tuple:
        tensors, ints, values = xs
        arrays = tuple((t.params_NP, *v) for t, v in zip(terms, values, strict=True))
        return jax.checkpoint(within)(tensors, ints, arrays)

    values = tuple((per_chunk(t.q_values_BTN), per_chunk(t.k_values_BSN)) for t in terms)
    xs = (tuple(map(split, tensors)), {key: split(x) for key, x in ints.items()}, values)
    return tuple(x.reshape(count, *x.shape[2:]) for x in jax.lax.map(group, xs))


def leaf_groups(count: int, heads: int, size: int) -> int:
    """The groups :func:`_within_chunks_remat` runs in sequence: a power of two (at most 16)
    dividing the ``count`` chunks, the fewest that keep one group's (chunks, N, C, C)
    float32 array within ``LEAF_GROUP_BYTES``."""
    groups, total = 1, count * heads * size * size * 4
    while groups < 16 and count % (2 * groups) == 0 and total > LEAF_GROUP_BYTES * groups:
        groups *= 2
    return groups


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
