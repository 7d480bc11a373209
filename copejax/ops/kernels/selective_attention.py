"""Selective attention (Leviathan et al. 2024, arXiv 2410.02703) through the fused kernels:
the custom VJP that wires the prefix and forward kernels
(:mod:`copejax.ops.kernels.selective`) to the backward kernel
(:mod:`copejax.ops.kernels.selective_backward`), or on a TPU (``plan.backend`` "tpu") their
Mosaic TPU counterparts (:mod:`copejax.ops.kernels.tpu_selective`,
:mod:`~copejax.ops.kernels.tpu_selective_backward`), whose per-query-head gradients are summed
here.

:func:`~copejax.ops.kernels.attention.fused_attention` calls :func:`selective_attention`
with its padded inputs when given ``selective=``. The selecting head's q and k are read
inside the VJP, so their gradients (the selection's, summed over the heads) are added to
that head's dq and to its key/value head's dk before the inputs' dtype rounds them.
GPT-OSS's attention sink is folded into the output and log-sum-exp after the forward kernel
and gets its gradient from them (:mod:`copejax.ops.kernels.sink`).
Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.kernels.selective import NONLINEARITIES, SelectiveTerm, selective_forward_call
from copejax.ops.kernels.selective_backward import selective_backward_calls
from copejax.ops.kernels.sink import fold_sink, sink_gradient
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_selective import tpu_selective_forward_call
from copejax.ops.kernels.tpu_selective_backward import tpu_selective_backward_calls

BACKENDS = ("triton", "tpu")


def check_selective(selective: SelectiveTerm, plan: Plan, arrays: dict) -> None:
    """Refuses, naming it, what the selective kernels do not run: a head out of range, an
    unknown nonlinearity, an unknown backend, and CoPE, Shaw's table or stick-breaking
    beside the penalties."""
    heads = arrays["q"].shape[2]
    head = selective.head
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < heads:
        raise ValueError(f"kernel: selective head must be an integer in [0, {heads}), got {head!r}")
    if selective.nonlinearity not in NONLINEARITIES:
        raise ValueError(
            f"kernel: selective nonlinearity must be one of {NONLINEARITIES}, "
            f"got {selective.nonlinearity!r}"
        )
    backend = getattr(plan, "backend", "triton")
    if backend not in BACKENDS:
        raise ValueError(
            f"kernel: selective attention's kernels are {BACKENDS}, got backend {backend!r}"
        )
    others = [key for key in ("cope", "relative") if arrays.get(key) is not None]
    if plan.stick:
        others.append("stickbreaking")
    if others:
        raise ValueError(
            "kernel: selective attention's penalties run with the softmax and the terms of "
            f"copejax.ops.kernels.terms only, got {others}"
        )


def selective_attention(
    plan: Plan, selective: SelectiveTerm, arrays: dict, ints: dict[str, jax.Array]
) -> jax.Array:
    """softmax(q . k / sqrt(H) + terms - F) v on padded inputs, differentiable in q, k, v,
    the terms' arrays and the sink.

    Args:
      plan: the call's tiles, mask and the terms' tile functions.
      selective: the selecting head and the nonlinearity.
      arrays: the padded "q" (B, T, N, H), "k" (B, S, G, H), "v" (B, S, G, W) and "terms"
        (as fused_attention builds them), "sink" (N,) or None; "cope" and "relative" must be
        None.
      ints: int32 (B, T) "q_pos", "q_seg" and (B, S) "k_pos", "k_seg", "k_rank" (padding in
        segments of its own, as fused_attention pads them).

    Returns:
      y_BTNW float32.
    """
    check_selective(selective, plan, arrays)
    heads, kv_heads = arrays["q"].shape[2], arrays["k"].shape[2]
    kv_head = selective.head // (heads // kv_heads)
    starts_BS = segments.segment_starts_BT(ints["k_seg"]).astype(jnp.int32)
    nonlinearity = selective.nonlinearity
    tpu = plan.backend == "tpu"

    def selectors(q_BTNH: jax.Array, k_BSGH: jax.Array) -> dict[str, jax.Array]:
        return {"q": q_BTNH[:, :, selective.head], "k": k_BSGH[:, :, kv_head]}

    @jax.custom_vjp
    def attend(
        tensors: tuple, terms: list[dict], sink_N: jax.Array | None, ints: dict[str, jax.Array]
    ) -> jax.Array:
        return forward(tensors, terms, sink_N, ints)[0]

    def forward(
        tensors: tuple, terms: list[dict], sink_N: jax.Array | None, ints: dict[str, jax.Array]
    ) -> tuple:
        q_BTNH, k_BSGH, _ = tensors
        if tpu:
            o_BTNW, lse_BNT = tpu_selective_forward_call(
                plan,
                nonlinearity,
                *tensors,
                selectors=selectors(q_BTNH, k_BSGH),
                ints=ints,
                terms=terms,
            )
        else:  # the kernels read the selecting head's q and k from q and k
            o_BTNW, lse_BNT = selective_forward_call(
                plan, nonlinearity, *tensors, head=selective.head, ints=ints, terms=terms
            )
        if sink_N is not None:
            o_BTNW, lse_BNT = fold_sink(o_BTNW, lse_BNT, sink_N)
        return o_BTNW, (tensors, terms, sink_N, ints, o_BTNW, lse_BNT)

    def backward(residuals: tuple, do_BTNW: jax.Array) -> tuple:
        tensors, terms, sink_N, ints, o_BTNW, lse_BNT = residuals
        do_BTNW = do_BTNW.astype(tensors[2].dtype)  # the matmuls take the inputs' dtype
        delta_BNT = jnp.moveaxis(jnp.sum(do_BTNW.astype(jnp.float32) * o_BTNW, axis=-1), 2, 1)
        arguments = {"stats": (lse_BNT, delta_BNT), "ints": ints, "terms": terms}
        if tpu:
            arguments["selectors"] = selectors(tensors[0], tensors[1])
            grads, term_grads = _tpu_backward(plan, selective, (*tensors, do_BTNW), arguments)
        else:
            grads, term_grads = selective_backward_calls(
                plan,
                nonlinearity,
                (*tensors, do_BTNW),
                head=selective.head,
                **arguments,
            )
        term_grads = [  # a parameter's partial sums per (batch row, key tile), added up
            {**g, "params": None if g["params"] is None else jnp.sum(g["params"], axis=(0, 2))}
            for g in term_grads
        ]
        d_sink_N = None if sink_N is None else sink_gradient(lse_BNT, delta_BNT, sink_N)
        return grads, term_grads, d_sink_N, None

    attend.defvjp(forward, backward)
    tensors = (arrays["q"], arrays["k"], arrays["v"])
    sink_N = arrays.get("sink")
    return attend(tensors, arrays["terms"], sink_N, {**ints, "k_start": starts_BS})


def _tpu_backward(
    plan: Plan, selective: SelectiveTerm, tensors: tuple, arguments: dict
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], list[dict]]:
    """The TPU's backward kernels, their per-query-head gradients summed: ((dq, dk, dv) in the
    inputs' dtypes, the terms' gradients)."""
    q_BTNH, k_BSGH, v_BSGW, _ = tensors
    (batch, length, heads), kv_heads = q_BTNH.shape[:3], k_BSGH.shape[2]
    kv_head = selective.head // (heads // kv_heads)
    dq_BTNH, dk_BSNH, dv_BSNW, term_grads, dq_sel_BTH, dk_sel_BSH = tpu_selective_backward_calls(
        plan, selective.nonlinearity, tensors, **arguments
    )

    def per_kv_head(x_BSNW: jax.Array) -> jax.Array:
        x = x_BSNW.reshape(batch, length, kv_heads, heads // kv_heads, -1)
        return jnp.sum(x, axis=3)

    dq_BTNH = dq_BTNH.at[:, :, selective.head].add(dq_sel_BTH)
    dk_BSGH = per_kv_head(dk_BSNH).at[:, :, kv_head].add(dk_sel_BSH)
    grads = (
        dq_BTNH.astype(q_BTNH.dtype),
        dk_BSGH.astype(k_BSGH.dtype),
        per_kv_head(dv_BSNW).astype(v_BSGW.dtype),
    )
    return grads, term_grads
