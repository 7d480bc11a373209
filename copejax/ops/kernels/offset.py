"""Attention of a later block of queries to an earlier block of keys on the fused kernels
(issue 45): PaTH's levels of chunk pairs (Yang et al. 2025, arXiv 2505.16381).

Query row r is token ``offset + r`` and key row j token j (``Plan.q_offset``): query r sees
key j iff ``j <= offset + r``, both belong to the same segment and, with a window W,
``offset + r - W < j``. The FlashAttention-2 kernels (:mod:`copejax.ops.kernels.forward`,
:mod:`~copejax.ops.kernels.backward`; on a TPU :mod:`~copejax.ops.kernels.tpu_forward` and
:mod:`~copejax.ops.kernels.tpu_backward`) run it unchanged: the Plan adds the offset wherever
a query tile's rows become tokens (its key tiles, query tiles, skip test and mask), so the
arrays hold only the rows the call reads. The in-kernel terms (PaTH-FoX's forget gates),
packed segments, grouped KV heads, a window and skipped empty tiles work as in
:func:`~copejax.ops.kernels.attention.fused_attention`.

The rows are parts of larger softmaxes, so ``offset_attention`` returns each query's output
and log-sum-exp over these keys only, both differentiable
(:func:`~copejax.ops.kernels.attend.attend`), for the caller to merge
(:func:`copejax.model.path_levels.merge_softmaxes`); a query with no key here gets
``MASKED_LOGIT``. :mod:`copejax.model.path_levels` runs each level's second halves' queries
against its first halves' keys through :func:`offset_plan`, with a backward of its own.

Shape letters: B batch, T queries, S keys, N query heads, G key/value heads, H head dim,
W value width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from copejax.ops.kernels.attend import attend
from copejax.ops.kernels.attention import DEFAULT_BLOCK, term_arrays
from copejax.ops.kernels.padding import check_window, pad_tokens, tiled_plan, token_ints
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_params import kernel_backend


def offset_attention(
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    offset: int,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    q_segment_ids_BT: jax.Array,
    k_segment_ids_BS: jax.Array,
    terms: Sequence[KernelTerm] = (),
    window: int | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    interpret: bool | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of queries that start at token ``offset`` to keys that start at 0.

    Args:
      q_BTNH: the queries, row r being token ``offset + r``.
      k_BSGH, v_BSGW: keys and values of the G key/value heads (G divides N).
      offset: a positive integer (0 is :func:`~copejax.ops.kernels.attention.
        fused_attention`'s self-attention).
      q_positions_BT, k_positions_BS: integer positions the terms read.
      q_segment_ids_BT, k_segment_ids_BS: packed documents: a query sees keys of its own.
      terms: logit terms computed in the kernels, per-query values (B, T, N) and per-key
        values (B, S, N).
      window, block_q, block_k, interpret: as :func:`~copejax.ops.kernels.attention.
        fused_attention` (no sink tokens).
      backend: "triton", "tpu" (key tiles of at least 128) or None: "tpu" on a TPU, else
        "triton".

    Returns:
      (o_BTNW float32, lse_BTN float32; MASKED_LOGIT and 0 where a query sees no key).
    """
    (length_q, heads), (length_k, kv_heads) = q_BTNH.shape[1:3], k_BSGH.shape[1:3]
    if heads % kv_heads:
        raise ValueError(f"kernel: G must divide N, got q {q_BTNH.shape}, k {k_BSGH.shape}")
    terms = tuple(terms)
    plan = offset_plan(
        length_q,
        length_k,
        offset=offset,
        groups=heads // kv_heads,
        biases=tuple(t.bias for t in terms),
        window=window,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        backend=backend,
    )
    padded_q, padded_k = plan.count_q * plan.size_q, plan.count_k * plan.size_k
    arrays = {
        "q": pad_tokens(q_BTNH, padded_q, 0),
        "k": pad_tokens(k_BSGH, padded_k, 0),
        "v": pad_tokens(v_BSGW, padded_k, 0),
        "terms": [term_arrays(t, padded_q, padded_k) for t in terms],
        "cope": None,
        "sink": None,
    }
    ints = token_ints(
        q_positions_BT,
        k_positions_BS,
        q_segment_ids_BT,
        None,
        padded_q,
        k_segment_ids_BS=k_segment_ids_BS,
        padded_k=padded_k,
    )
    o_BTNW, lse_BNT = attend(plan, arrays, ints)
    return o_BTNW[:, :length_q], jnp.moveaxis(lse_BNT, 1, 2)[:, :length_q]


def offset_plan(
    length_q: int,
    length_k: int,
    *,
    offset: int,
    groups: int,
    biases: tuple,
    window: int | None,
    block_q: int,
    block_k: int,
    interpret: bool | None,
    backend: str | None,
) -> Plan:
    """The Plan of ``length_q`` queries from token ``offset`` (a positive integer) against
    ``length_k`` keys from token 0: ``groups`` query heads per key/value head, ``biases`` the
    terms' tile functions; each length padded to a multiple of its tiles."""
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 1:
        raise ValueError(f"kernel: offset must be a positive integer, got {offset!r}")
    check_window(window)
    plan = tiled_plan(
        max(length_q, length_k),
        block_q=block_q,
        block_k=block_k,
        backend=kernel_backend(backend),
        interpret=interpret,
        window=window,
        sink_tokens=0,
        groups=groups,
        biases=biases,
        q_offset=offset,
    )
    return dataclasses.replace(
        plan, count_q=-(-length_q // plan.size_q), count_k=-(-length_k // plan.size_k)
    )
