"""The online softmax of the TPU forward kernels (FlashAttention-2's, Dao 2023, arXiv
2307.08691), on VMEM scratch: :func:`init_softmax` at the first key step,
:func:`softmax_step` for each live key tile, :func:`finish_softmax` at the last.

The softmax kernel (:mod:`copejax.ops.kernels.tpu_forward`) and selective attention's
(:mod:`copejax.ops.kernels.tpu_selective`) share them. Scratch: the running max and sum
(Q, 1) and the output accumulator (Q, W), float32. Shape letters as in
:mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.kernels.tiles import MASKED_LOGIT, Plan
from copejax.ops.kernels.tpu_rows import store_row

F32 = jnp.float32
# The VMEM scratch refs: the running max (Q, 1), sum (Q, 1) and output accumulator (Q, W).
Scratch = tuple[jax.Array, jax.Array, jax.Array]


def init_softmax(scratch: Scratch) -> None:
    """An empty softmax: the max at MASKED_LOGIT, the sum and the accumulator at 0."""
    max_ref, sum_ref, acc_ref = scratch
    max_ref[...] = jnp.full(max_ref.shape, MASKED_LOGIT, F32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, F32)


def softmax_step(
    s_QK: jax.Array, allowed_QK: jax.Array | None, v_KW: jax.Array, scratch: Scratch
) -> None:
    """Folds one key tile's scores ``s_QK`` (float32) and values into the softmax: the
    weights in the values' dtype, their product accumulated in float32; ``allowed_QK`` None:
    every entry allowed (a full pair, :meth:`~copejax.ops.kernels.tiles.Plan.full`)."""
    max_ref, sum_ref, acc_ref = scratch
    max_Q1 = max_ref[...]
    new_max_Q1 = jnp.maximum(max_Q1, jnp.max(s_QK, axis=1, keepdims=True))
    p_QK = jnp.exp(s_QK - new_max_Q1)
    if allowed_QK is not None:
        p_QK = jnp.where(allowed_QK, p_QK, 0.0)
    rescale_Q1 = jnp.exp(max_Q1 - new_max_Q1)
    pv_QW = jax.lax.dot(p_QK.astype(v_KW.dtype), v_KW, preferred_element_type=F32)
    acc_ref[...] = acc_ref[...] * rescale_Q1 + pv_QW
    sum_ref[...] = sum_ref[...] * rescale_Q1 + jnp.sum(p_QK, axis=1, keepdims=True)
    max_ref[...] = new_max_Q1


def finish_softmax(plan: Plan, o_ref: jax.Array, lse_ref: jax.Array, scratch: Scratch) -> None:
    """The output (in ``o_ref``'s dtype) and the log-sum-exp. A query with no allowed key
    (padding) gets output 0 and ``plan.unseen_lse`` (with a query offset MASKED_LOGIT): the
    backward's weights there are 0."""
    max_ref, sum_ref, acc_ref = scratch
    sum_Q1 = sum_ref[...]
    seen_Q1 = sum_Q1 > 0
    safe_Q1 = jnp.where(seen_Q1, sum_Q1, 1.0)
    o_ref[...] = (acc_ref[...] / safe_Q1).astype(o_ref.dtype)
    store_row(lse_ref, jnp.where(seen_Q1, max_ref[...] + jnp.log(safe_Q1), plan.unseen_lse))
