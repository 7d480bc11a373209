"""The fused kernels as one differentiable function: the forward kernel, the backward
kernels, and the ``jax.custom_vjp`` that wires them (issue 45).

:func:`attend` is what :func:`copejax.ops.kernels.attention.fused_attention` and
:func:`copejax.ops.kernels.offset.offset_attention` call. Its halves, :func:`attend_forward` and
:func:`attend_backward`, are public so that a caller can run several calls' backward from
residuals of its own: PaTH's levels (:mod:`copejax.model.path_levels`) keep one output and
log-sum-exp for all their calls instead of one per call. Which kernels run: Shaw's tables on
a GPU (:mod:`copejax.ops.kernels.relative_calls`), else the GPU's Triton kernels
(:mod:`copejax.ops.kernels.forward`, :mod:`~copejax.ops.kernels.backward`) or the TPU's
(:mod:`copejax.ops.kernels.tpu_forward`, :mod:`~copejax.ops.kernels.tpu_backward`), by
``plan.backend``; GPT-OSS's sink folds into the output and log-sum-exp
(:mod:`copejax.ops.kernels.sink`).

Shape letters: B batch, T queries (= S keys), N query heads, G key/value heads, H head dim,
W value width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.kernels.backward import backward_calls
from copejax.ops.kernels.forward import forward_call
from copejax.ops.kernels.relative import RelativeStatic
from copejax.ops.kernels.relative_calls import relative_backward_calls, relative_forward_call
from copejax.ops.kernels.sink import fold_sink, sink_gradient
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_backward import tpu_backward_calls
from copejax.ops.kernels.tpu_forward import tpu_forward_call
from copejax.ops.kernels.tpu_relative import TpuRelative


def attend(
    plan: Plan, arrays: dict, ints: dict, rel: RelativeStatic | TpuRelative | None = None
) -> tuple[jax.Array, jax.Array]:
    """The kernels as one differentiable function of ``arrays`` (the integer ``ints`` get
    no gradient); ``rel``: Shaw's term, whose table is ``arrays["relative"]`` (on a TPU the
    reversed table of :mod:`copejax.ops.kernels.tpu_relative`).

    Returns (o_BTNW float32, lse_BNT float32), both differentiable: a cotangent of the
    log-sum-exp enters the backward as ``D_i - dL_i`` (``dL_i / ds_ij = P_ij``), which is
    how a call with a query offset (:mod:`copejax.ops.kernels.offset`) joins a larger
    softmax of its rows.
    """

    @jax.custom_vjp
    def differentiable(arrays: dict, ints: dict) -> tuple[jax.Array, jax.Array]:
        return attend_forward(plan, arrays, ints, rel)[0]

    def forward(arrays: dict, ints: dict) -> tuple[tuple[jax.Array, jax.Array], tuple]:
        return attend_forward(plan, arrays, ints, rel)

    def backward(residuals: tuple, cotangents: tuple) -> tuple[dict, None]:
        return attend_backward(plan, residuals, cotangents, rel), None

    differentiable.defvjp(forward, backward)
    return differentiable(arrays, ints)


def attend_forward(
    plan: Plan, arrays: dict, ints: dict, rel: RelativeStatic | TpuRelative | None = None
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    """The kernels' forward: ((o_BTNW float32, lse_BNT float32), the residuals of
    :func:`attend_backward`: (arrays, ints, o_BTNW, lse_BNT))."""
    tpu = plan.backend == "tpu"
    forward_kernel = tpu_forward_call if tpu else forward_call
    if rel is not None and not tpu:
        o_BTNW, lse_BNT = relative_forward_call(
            plan,
            *(arrays[key] for key in "qkv"),
            static=rel,
            ints=ints,
            terms=arrays["terms"],
            table_PH=arrays["relative"],
        )
        return _with_sink(arrays, o_BTNW, lse_BNT, ints)
    o_BTNW, lse_BNT = forward_kernel(
        plan,
        arrays["q"],
        arrays["k"],
        arrays["v"],
        ints=ints,
        terms=arrays["terms"],
        cope=arrays["cope"],
        gate_k_BSGH=arrays.get("gate_k"),
        **({} if rel is None else {"relative": (rel, arrays["relative"])}),
    )
    return _with_sink(arrays, o_BTNW, lse_BNT, ints)


def attend_backward(
    plan: Plan,
    residuals: tuple,
    cotangents: tuple,
    rel: RelativeStatic | TpuRelative | None = None,
    rowsum_BTN: jax.Array | None = None,
) -> dict:
    """The kernels' backward: the gradients of ``arrays`` (a dict of their structure) from
    ``residuals`` (arrays, ints, o_BTNW, lse_BNT) and the cotangents (do_BTNW, dlse_BNT).

    The kernels recompute each pair's probability as ``exp(s - lse)`` and subtract ``D =
    rowsum(do o) - dlse``: given a row's output and log-sum-exp over a larger set of keys
    (and that row's cotangents), they return the gradients of this call's pairs within that
    one softmax, which is how PaTH's levels (:mod:`copejax.model.path_levels`) take one
    backward over several calls without keeping each call's output. ``rowsum_BTN``, when
    given, is that ``rowsum(do o)`` (:func:`output_rowsum`), and ``o_BTNW`` may be None: the
    levels sum it once for all their calls."""
    tpu = plan.backend == "tpu"
    backward_kernels = tpu_backward_calls if tpu else backward_calls
    arrays, ints, o_BTNW, lse_BNT = residuals
    q_BTNH, k_BTGH, v_BTGW = arrays["q"], arrays["k"], arrays["v"]
    # The matmuls take the inputs' dtype; D from the same rounded cotangent, so that
    # stick-breaking's sum_k G_ik equals D (its dz subtracts the two).
    do_BTNW, dlse_BNT = cotangents
    do_BTNW = do_BTNW.astype(v_BTGW.dtype)
    if rowsum_BTN is None:
        rowsum_BTN = output_rowsum(do_BTNW, o_BTNW)
    inputs = (q_BTNH, k_BTGH, v_BTGW, do_BTNW)
    delta_BNT = jnp.moveaxis(rowsum_BTN, 2, 1) - dlse_BNT
    stats = {"lse_BNT": lse_BNT, "delta_BNT": delta_BNT}
    d_cope, d_relative_PH = None, None
    if rel is not None and not tpu:
        dq_BTNH, dk_BTNH, dv_BTNW, term_grads, d_relative_PH = relative_backward_calls(
            plan,
            *inputs,
            static=rel,
            **stats,
            ints=ints,
            terms=arrays["terms"],
            table_PH=arrays["relative"],
        )
    else:
        dq_BTNH, dk_BTNH, dv_BTNW, term_grads, d_cope = backward_kernels(
            plan,
            *inputs,
            **stats,
            ints=ints,
            terms=arrays["terms"],
            cope=arrays["cope"],
            gate_k_BSGH=arrays.get("gate_k"),
            **({} if rel is None else {"relative": (rel, arrays["relative"])}),
        )
        if rel is not None:  # the reversed table's gradient
            d_cope, d_relative_PH = None, d_cope["relative"]
    (batch, length), heads = k_BTGH.shape[:2], q_BTNH.shape[2]
    kv_heads = k_BTGH.shape[2]

    def per_kv_head(x_BTNW: jax.Array, like: jax.Array) -> jax.Array:
        x = x_BTNW.reshape(batch, length, kv_heads, heads // kv_heads, -1)
        return jnp.sum(x, axis=3).astype(like.dtype)

    grads = {
        "q": dq_BTNH,
        "k": per_kv_head(dk_BTNH, k_BTGH),
        "v": per_kv_head(dv_BTNW, v_BTGW),
        "terms": [
            {
                "params": None if g["params"] is None else jnp.sum(g["params"], axis=(0, 2)),
                "q": g["q"],
                "k": g["k"],
            }
            for g in term_grads
        ],
        "cope": None if d_cope is None else d_cope["params"],
        "sink": None,
    }
    if "gate_k" in arrays:  # per query head, like dk
        gate_k = arrays["gate_k"]
        grads["gate_k"] = None if gate_k is None else per_kv_head(d_cope["gate_k"], gate_k)
    if rel is not None:
        grads["relative"] = d_relative_PH
    if arrays["sink"] is not None:
        grads["sink"] = sink_gradient(lse_BNT, stats["delta_BNT"], arrays["sink"])
    return grads


def output_rowsum(do_BTNW: jax.Array, o_BTNW: jax.Array) -> jax.Array:
    """``rowsum(do o)`` (B, T, N) in float32, of the backward's ``D = rowsum(do o) - dlse``;
    ``do_BTNW`` as the kernels take it, rounded to the values' dtype."""
    return jnp.sum(do_BTNW.astype(jnp.float32) * o_BTNW, axis=-1)


def _with_sink(arrays: dict, o_BTNW: jax.Array, lse_BNT: jax.Array, ints: dict):
    """The forward's output and residuals, the sink (if any) folded into both."""
    if arrays["sink"] is not None:
        o_BTNW, lse_BNT = fold_sink(o_BTNW, lse_BNT, arrays["sink"])
    return (o_BTNW, lse_BNT), (arrays, ints, o_BTNW, lse_BNT)
