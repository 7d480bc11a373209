"""Attention between key chunks with queries per chunk, on the fused kernels: PaTH's pairs
across chunks (Yang et al. 2025, arXiv 2505.16381; issue 45).

:mod:`copejax.model.kernel_path` writes PaTH's logit of a query i and a key j of an older
chunk m as ``q'_i^(m) . k'_j / sqrt(H)``: the query transformed down to the end of chunk m,
the key up to it. ``chunked_attention`` runs those pairs through the FlashAttention-2
kernels (:mod:`copejax.ops.kernels.forward`, :mod:`~copejax.ops.kernels.backward`) with
``Plan.chunk``: query tile i walks the key tiles of the chunks before its own, reading its
rows of the key tile's chunk; the dq kernel writes one gradient per chunk (the queries differ
per chunk); the dk / dv kernel reads the one chunk its key tile belongs to. The in-kernel
terms (PaTH-FoX's forget gates), packed segments, grouped KV heads, a sliding window and
skipped empty tiles work as in :func:`~copejax.ops.kernels.attention.fused_attention`.

It returns each query's output and log-sum-exp over those keys only, both differentiable
(:func:`~copejax.ops.kernels.attend.attend`), so that the caller merges them with the
pairs inside each chunk; a query with no key in an older chunk gets ``MASKED_LOGIT``.
:mod:`copejax.model.path_levels` runs PaTH's levels of chunk pairs through the same Plan
(:func:`chunked_plan`), two chunks per call, with a backward of its own.
GPU (Triton) and TPU (Mosaic TPU: :mod:`copejax.ops.kernels.tpu_forward` and
:mod:`~copejax.ops.kernels.tpu_backward`, where the chunk of a step's key tile picks the
queries' block, and the dq kernel writes each chunk's block at the chunk's last key tile).

Shape letters: B batch, M chunks, T queries (= S keys), N query heads, G key/value heads,
H head dim, W value width.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from copejax.ops.kernels.attend import attend
from copejax.ops.kernels.attention import DEFAULT_BLOCK, term_arrays
from copejax.ops.kernels.padding import check_window, tiled_plan, token_ints
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_params import kernel_backend


def chunked_attention(
    q_BMNTH: jax.Array,
    k_BTGH: jax.Array,
    v_BTGW: jax.Array,
    *,
    chunk: int,
    q_positions_BT: jax.Array,
    k_positions_BT: jax.Array,
    segment_ids_BT: jax.Array,
    terms: Sequence[KernelTerm] = (),
    window: int | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    interpret: bool | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of each query to the keys of the chunks before its own.

    Args:
      q_BMNTH: the queries as key chunk m sees them, M = ceil(T / chunk), heads before
        tokens (the layout the kernels read, and the one PaTH's walk writes without copies).
      k_BTGH, v_BTGW: keys and values of the G key/value heads (G divides N).
      chunk: keys per chunk, a power of two and a multiple of both tiles.
      q_positions_BT, k_positions_BT, segment_ids_BT, terms, window, block_q, block_k,
        interpret: as :func:`~copejax.ops.kernels.attention.fused_attention` (no sink tokens).
      backend: "triton", "tpu" (key tiles of at least 128: so is ``chunk``) or None: "tpu"
        on a TPU, else "triton".

    Returns:
      (o_BTNW float32, lse_BTN float32; MASKED_LOGIT and 0 where a query sees no key).
    """
    count, heads, length = q_BMNTH.shape[1:4]
    kv_heads = k_BTGH.shape[2]
    if k_BTGH.shape[1] != length or heads % kv_heads:
        raise ValueError(
            f"kernel: chunked attention needs T = S and G dividing N, got q {q_BMNTH.shape}, "
            f"k {k_BTGH.shape}"
        )
    terms = tuple(terms)
    plan = chunked_plan(
        length,
        groups=heads // kv_heads,
        chunk=chunk,
        biases=tuple(t.bias for t in terms),
        window=window,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        backend=backend,
    )
    if count != -(-length // chunk):
        raise ValueError(
            f"kernel: {length} queries in chunks of {chunk} need {-(-length // chunk)} chunks "
            f"of queries, got {count}"
        )
    padded = plan.count_q * plan.size_q
    extra = padded - length
    arrays = {
        "q": jnp.pad(q_BMNTH, ((0, 0), (0, 0), (0, 0), (0, extra), (0, 0))),
        "k": jnp.pad(k_BTGH, ((0, 0), (0, extra), (0, 0), (0, 0))),
        "v": jnp.pad(v_BTGW, ((0, 0), (0, extra), (0, 0), (0, 0))),
        "terms": [term_arrays(t, padded) for t in terms],
        "cope": None,
        "sink": None,
    }
    ints = token_ints(q_positions_BT, k_positions_BT, segment_ids_BT, None, padded)
    o_BTNW, lse_BNT = attend(plan, arrays, ints)
    return o_BTNW[:, :length], jnp.moveaxis(lse_BNT, 1, 2)[:, :length]


def chunked_plan(
    length: int,
    *,
    groups: int,
    chunk: int,
    biases: tuple,
    window: int | None,
    block_q: int,
    block_k: int,
    interpret: bool | None,
    backend: str | None,
) -> Plan:
    """The Plan of a call with key chunks: ``chunk`` a power of two and a multiple of both
    tiles; ``groups`` query heads per key/value head; ``biases`` the terms' tile functions."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"kernel: chunk must be a power of two, got {chunk!r}")
    check_window(window)
    plan = tiled_plan(
        length,
        block_q=block_q,
        block_k=block_k,
        backend=kernel_backend(backend),
        interpret=interpret,
        window=window,
        sink_tokens=0,
        groups=groups,
        biases=biases,
        chunk=chunk,
    )
    if chunk % max(plan.size_q, plan.size_k):
        raise ValueError(
            f"kernel: chunk={chunk} must be a multiple of the tiles ({plan.size_q}, {plan.size_k})"
        )
    return plan
