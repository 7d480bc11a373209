"""Fused causal attention with in-kernel logit terms, forward and backward (issue 45).

``fused_attention`` is FlashAttention-2 (Dao 2023, arXiv 2307.08691) in Pallas: the forward
kernel (:mod:`copejax.ops.kernels.forward`) keeps each query's log-sum-exp, the backward
kernels (:mod:`copejax.ops.kernels.backward`) recompute each pair's scores from it, all
wired by ``jax.custom_vjp``. The scores are ``q . k / sqrt(H)`` plus the sum of the given
:class:`~copejax.ops.kernels.terms.KernelTerm` biases, computed tile by tile inside the
kernels: no (T, S) array exists, forward or backward. With ``normalizer="stickbreaking"``
stick-breaking replaces the softmax (:mod:`copejax.ops.kernels.stick`; its GPU backward keeps
its carries per carry group of key tiles, O(T H); the TPU's in VMEM). GPT-OSS's attention
sink (``sink_N``) joins the softmax's denominator (:mod:`copejax.ops.kernels.sink`). Masking:
causal, packed segments, a sliding window W with StreamingLLM's sink tokens (the mask of
:func:`copejax.ops.segments.pair_allowed_BQK`); grouped KV heads (G divides N); tiles with
no allowed pair are skipped. Inputs in bfloat16 or float32; logits, softmax statistics and
the terms in float32; the matmuls take the inputs' dtype with float32 accumulation.

Backends: on a GPU the kernels lower to Triton (:mod:`copejax.ops.kernels.triton_params`
says why not Mosaic GPU); on a TPU, Mosaic TPU kernels of the same maths
(:mod:`copejax.ops.kernels.tpu_params`: the softmax or stick-breaking with the KernelTerm
terms, CoPE, selective attention's penalties and Shaw's tables); elsewhere Pallas
interpret mode of either (``backend``), which is how the CPU tests check them (slow: a
correctness path, not a fast one).

Shape letters: B batch, T queries (= S keys: self-attention), N query heads, G key/value
heads, H head dim, W value width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from copejax.ops.kernels.attend import attend
from copejax.ops.kernels.carry_groups import carry_starts
from copejax.ops.kernels.cope import CopeTerm
from copejax.ops.kernels.padding import (
    MIN_BLOCK,
    check_window,
    pad_tokens,
    power_of_two,
    tiled_plan,
    token_ints,
)
from copejax.ops.kernels.relative import RelativeStatic, RelativeTerm, padded_rows
from copejax.ops.kernels.selective import SelectiveTerm
from copejax.ops.kernels.selective_attention import selective_attention
from copejax.ops.kernels.terms import KernelTerm
from copejax.ops.kernels.tpu_params import kernel_backend
from copejax.ops.kernels.tpu_relative import reversed_table, tpu_relative

DEFAULT_BLOCK = 128
NORMALIZERS = ("softmax", "stickbreaking")


def fused_attention(
    q_BTNH: jax.Array,
    k_BTGH: jax.Array,
    v_BTGW: jax.Array,
    *,
    q_positions_BT: jax.Array,
    k_positions_BT: jax.Array,
    segment_ids_BT: jax.Array,
    terms: Sequence[KernelTerm] = (),
    window: int | None = None,
    sink_tokens: int = 0,
    k_rank_BT: jax.Array | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    interpret: bool | None = None,
    normalizer: str = "softmax",
    include_self: bool = True,
    backend: str | None = None,
    cope: CopeTerm | None = None,
    relative: RelativeTerm | None = None,
    selective: SelectiveTerm | None = None,
    sink_N: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention through the fused kernels.

    Args:
      q_BTNH: queries (after any qk transform).
      k_BTGH, v_BTGW: keys and values of the G key/value heads (G divides N; query head n
        reads head ``n // (N / G)``, as ``repeat_kv_heads`` does).
      q_positions_BT, k_positions_BT: integer positions the terms read.
      segment_ids_BT: packed documents; query i sees key j <= i of its own segment.
      terms: logit terms computed in the kernels (:mod:`copejax.ops.kernels.terms`).
      window: sliding window W (keys ``i - W < j <= i``); None: full causal attention.
      sink_tokens: with a window, each segment's first n keys stay visible.
      k_rank_BT: each key's index within its segment; needed for ``sink_tokens``.
      block_q, block_k: tile lengths (powers of two, at least 16; shorter for short inputs).
      interpret: Pallas interpret mode; None: everywhere but on the backend's device.
      normalizer: "softmax", or "stickbreaking" (:mod:`copejax.ops.kernels.stick`).
      include_self: whether query i sees key i (False: stick-breaking's default).
      backend: "triton" (the GPU kernels), "tpu" (the Mosaic TPU kernels,
        :mod:`copejax.ops.kernels.tpu_params`: the same schemes; key tiles of at
        least 128 keys) or None: "tpu" on a TPU, else "triton".
      cope: CoPE's carried count, any of its gates and position terms
        (:mod:`copejax.ops.kernels.cope`), with the softmax only.
      relative: Shaw's ``q_i . e[i - j]`` (:mod:`copejax.ops.kernels.relative`), with the
        softmax only and without ``cope``.
      selective: selective attention's penalties
        (:mod:`copejax.ops.kernels.selective_attention`), with the softmax and ``terms``
        (not with cope, relative or stick-breaking).
      sink_N: GPT-OSS's sink logit per query head (N,), joining every softmax denominator
        and mixing no value (:mod:`copejax.ops.kernels.sink`); not with stick-breaking.

    Returns:
      y_BTNW in ``v_BTGW``'s dtype.
    """
    length, heads = q_BTNH.shape[1:3]
    kv_heads = k_BTGH.shape[2]
    if k_BTGH.shape[1] != length or heads % kv_heads:
        raise ValueError(
            f"kernel: needs self-attention (T = S) and G dividing N, got q {q_BTNH.shape}, "
            f"k {k_BTGH.shape}"
        )
    check_window(window)
    if normalizer not in NORMALIZERS:
        raise ValueError(f"kernel: normalizer must be one of {NORMALIZERS}, got {normalizer!r}")
    if normalizer == "softmax" and not include_self:
        raise ValueError("kernel: a softmax row always includes its own key (include_self)")
    if sink_N is not None and normalizer != "softmax":
        raise ValueError(
            f"kernel: the attention sink joins a softmax denominator; {normalizer!r} has none"
        )
    if cope is not None and normalizer != "softmax":
        raise ValueError("kernel: CoPE's term runs with the softmax only")
    if relative is not None and (cope is not None or normalizer != "softmax"):
        raise ValueError("kernel: Shaw's relative term runs with the softmax and without cope")
    sinks = sink_tokens if window is not None else 0
    if sinks and k_rank_BT is None:
        raise ValueError("kernel: sink_tokens needs k_rank_BT (each key's rank in its segment)")
    backend = kernel_backend(backend)
    terms = tuple(terms)
    plan = tiled_plan(
        length,
        block_q=block_q,
        block_k=block_k,
        backend=backend,
        interpret=interpret,
        window=window,
        sink_tokens=sinks,
        groups=heads // kv_heads,
        biases=tuple(t.bias for t in terms),
        stick=normalizer == "stickbreaking",
        include_self=include_self,
        cope=None if cope is None else cope.kernel_static(),
    )
    if (plan.stick or plan.cope is not None) and backend == "triton":  # carry checkpoints
        starts = carry_starts(plan, q_BTNH.shape[-1], q_BTNH.dtype.itemsize)
        plan = dataclasses.replace(plan, carry_starts=starts)
    widths = (q_BTNH.shape[-1], v_BTGW.shape[-1])
    if (
        backend == "triton"
        and not plan.interpret
        and any(w < MIN_BLOCK or w != power_of_two(w) for w in widths)
    ):
        raise ValueError(
            f"kernel: on a GPU the head dim and value width must be powers of two >= "
            f"{MIN_BLOCK} (Triton's block shapes), got {widths}"
        )
    padded = plan.count_q * plan.size_q
    ints = token_ints(q_positions_BT, k_positions_BT, segment_ids_BT, k_rank_BT, padded)
    arrays = {
        "q": pad_tokens(q_BTNH, padded, 0),
        "k": pad_tokens(k_BTGH, padded, 0),
        "v": pad_tokens(v_BTGW, padded, 0),
        "terms": [term_arrays(t, padded) for t in terms],
        "cope": None if cope is None else cope.per_head(heads),
        "gate_k": None if cope is None else _gate_keys(cope, k_BTGH, padded),
        "sink": None if sink_N is None else sink_N.astype(jnp.float32),
    }
    rel = None
    if relative is not None and backend == "tpu":  # the reversed table, read by DMA
        rel = tpu_relative(relative.table.shape[0], relative.capped, plan.size_q, plan.size_k)
        arrays["relative"] = reversed_table(rel, relative.table)
    elif relative is not None:  # a band holds the Q + K - 1 rows one tile pair reads
        rows = relative.table.shape[0]
        rel = RelativeStatic(rows, relative.capped, power_of_two(plan.size_q + plan.size_k - 1))
        table = relative.table.astype(jnp.float32)
        arrays["relative"] = jnp.pad(table, ((0, padded_rows(rel) - rows), (0, 0)))
    if selective is not None:  # its own kernels
        y_BTNW = selective_attention(plan, selective, arrays, ints)
        return y_BTNW[:, :length].astype(v_BTGW.dtype)
    y_BTNW, _ = attend(plan, arrays, ints, rel)
    return y_BTNW[:, :length].astype(v_BTGW.dtype)


def term_arrays(
    term: KernelTerm, padded: int, padded_k: int | None = None
) -> dict[str, jax.Array | None]:
    """A term's arrays as the kernels read them: (N, P) params, (B, N, T) values; the
    per-query ones padded to ``padded`` tokens, the per-key ones to ``padded_k`` (None: the
    same)."""
    out = {"params": None, "q": None, "k": None}
    if term.params_NP is not None:  # rows padded to a power of two (Triton's block shapes)
        size = term.params_NP.shape[1]
        out["params"] = jnp.pad(
            term.params_NP.astype(jnp.float32), ((0, 0), (0, power_of_two(size) - size))
        )
    lengths = {"q": padded, "k": padded if padded_k is None else padded_k}
    for key, values_BTN in (("q", term.q_values_BTN), ("k", term.k_values_BSN)):
        if values_BTN is not None:
            # the last token's value repeated (padding takes no weight, so no gradient): a
            # separable term's origin (FoX's largest prefix sum) stays near the tile's
            padded_BTN = pad_tokens(values_BTN.astype(jnp.float32), lengths[key])
            out[key] = jnp.moveaxis(padded_BTN, 2, 1)
    return out


def _gate_keys(cope: CopeTerm, k_BTGH: jax.Array, padded: int) -> jax.Array | None:
    """CoPE's gate keys padded like k (checked to have k's shape), or None."""
    if cope.gate_k_BSGH is None:
        return None
    if cope.gate_k_BSGH.shape != k_BTGH.shape:
        raise ValueError(
            f"kernel: CoPE's gate keys need k's shape {k_BTGH.shape} (one per key/value "
            f"head), got {cope.gate_k_BSGH.shape}"
        )
    return pad_tokens(cope.gate_k_BSGH, padded, 0)
