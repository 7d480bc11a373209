"""Stick-breaking's flash backward for the blockwise engine (Tan et al. 2024, arXiv 2410.17980).

The forward (:mod:`copejax.ops.engine`'s walk, newest key block first) keeps only the output
``y_i = sum_j A_ij v_j``. With ``sp_ij = softplus(z_ij)``, ``a_ij = sum_{k > j} sp_ik`` (the
keys newer than j up to the query), ``A_ij = exp(log_sigmoid(z_ij) - a_ij)`` and, from the
cotangent ``dY_i``, ``G_ij = A_ij (dY_i . v_j)``:

    dv_j  = sum_i A_ij dY_i
    dz_ij = G_ij sigmoid(-z_ij) - sigmoid(z_ij) sum_{k < j} G_ik          (allowed pairs)

since ``z_ij`` enters ``A_ij`` through ``log_sigmoid`` and every older weight ``A_ik`` (k < j)
through ``a_ik``. The older keys' sum needs no second pass: ``sum_k G_ik = dY_i . y_i =: D_i``
(stick-breaking has no normaliser), so walking the key blocks newest first, as the forward
does, with two carries per query, ``r_i`` (the softplus total of the newer blocks, replayed
exactly as the forward computes it) and ``u_i`` (the ``G`` total of the newer blocks),

    sum_{k < j} G_ik = D_i - u_i - sum_{k >= j in the block} G_ik.

Once every query of the block has used up its stick (log remainder below ``-STICK_SPENT``,
:mod:`copejax.ops.engine_blocks`), the older key blocks are skipped, as in the forward: their
weights underflow to exactly 0 in float32, so their ``G``, ``dv`` and ``dz`` are 0.
No walk is rematerialised and nothing (T, S)-sized is kept; ``dz`` is pulled back through the
pair's score function (content logits and the terms') with ``jax.vjp``, as in
:mod:`copejax.ops.flash_backward`. Shape letters as in :mod:`copejax.ops.engine`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops import scan
from copejax.ops.engine_blocks import stick_spent, stick_weights
from copejax.ops.engine_layout import Layout
from copejax.ops.flash_backward import add_trees, zeros_like_tree


def stick_flash_backward(
    layout: Layout, data: dict, out_GBQNW: jax.Array, d_out_GBQNW: jax.Array
) -> dict:
    """The cotangent of the engine's blocked inputs ``data`` (None for their integer parts),
    one query block at a time (module docstring). Full causal walks only: no window, no
    ring-buffer keys, no term with a carry."""
    params, qf, qn, kf, kn = (data[key] for key in ("params", "qf", "qn", "kf", "kn"))
    v_GBKNW, offset = data["v"], data["offset"]
    no_carries = [None] * len(layout.terms)
    d_out_GBQNW = d_out_GBQNW.astype(jnp.float32)
    delta_GBNQ = jnp.moveaxis(jnp.sum(d_out_GBQNW * out_GBQNW, axis=-1), 3, 2)
    batch, heads, size_q = v_GBKNW.shape[1], v_GBKNW.shape[3], layout.size_q
    zeros = zeros_like_tree

    def per_query_block(carry: tuple, q_in: tuple) -> tuple[tuple, dict]:
        d_params, d_kf, d_v = carry
        qi, qf_i, qn_i, d_out_i, delta_i = q_in
        prepared, prepare_vjp = jax.vjp(layout.prepare, params, qf_i)

        def pair(state: tuple, kj: jax.Array, kf_j: dict, kn_j: dict, v_j: jax.Array) -> tuple:
            remainder_BNQ, newer_g_BNQ = state
            allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)
            allowed_B1QK = allowed_BQK[:, None]

            def score_fn(p: list, q_side: dict, k_side: dict, prep: list) -> jax.Array:
                return layout.scores(
                    p, prep, no_carries, qf=q_side, qn=qn_i, kf=k_side, kn=kn_j,
                    allowed_BQK=allowed_BQK, offset=offset, qi=qi, kj=kj,
                )[0]  # fmt: skip

            z_BNQK, score_vjp = jax.vjp(score_fn, params, qf_i, kf_j, prepared)
            z_BNQK = jnp.where(allowed_B1QK, z_BNQK, 0.0)
            e_BNQK, suffix_BNQK, a_BNQK = stick_weights(
                layout.scan_impl, z_BNQK, allowed_B1QK, remainder_BNQ
            )
            d_a_BNQK = jnp.einsum(
                "BQNW,BKNW->BNQK", d_out_i, v_j, preferred_element_type=jnp.float32
            )
            g_BNQK = d_a_BNQK * a_BNQK
            g_suffix_BNQK = scan.cumsum(g_BNQK, axis=-1, reverse=True, impl=layout.scan_impl)
            older_BNQK = (delta_i - newer_g_BNQ)[..., None] - g_suffix_BNQK
            one_plus_e_BNQK = 1.0 + e_BNQK
            sigmoid_BNQK = jnp.where(z_BNQK >= 0, 1.0, e_BNQK) / one_plus_e_BNQK
            sigmoid_neg_BNQK = jnp.where(z_BNQK >= 0, e_BNQK, 1.0) / one_plus_e_BNQK
            d_z_BNQK = jnp.where(
                allowed_B1QK, g_BNQK * sigmoid_neg_BNQK - older_BNQK * sigmoid_BNQK, 0.0
            )
            d_v_j = jnp.einsum(
                "BNQK,BQNW->BKNW",
                a_BNQK.astype(v_j.dtype),
                d_out_i.astype(v_j.dtype),
                preferred_element_type=jnp.float32,
            ).astype(v_j.dtype)
            state = (remainder_BNQ + suffix_BNQK[..., 0], newer_g_BNQ + g_suffix_BNQK[..., 0])
            return state, (*score_vjp(d_z_BNQK), d_v_j)

        def body(inner: tuple, k_in: tuple) -> tuple[tuple, tuple]:
            state, d_params_i, d_qf_i, d_prep_i = inner
            kj, kf_j, kn_j, v_j = k_in

            def dead(state: tuple) -> tuple:
                return state, (zeros(params), zeros(qf_i), zeros(kf_j), zeros(prepared), zeros(v_j))

            # The forward skipped the blocks older than a used-up stick: their weights, and
            # so G and dv, are exactly 0, and so is sum_{k < j} G_ik (not computed as the
            # difference D_i - u_i - ..., which would leave rounding noise in dz).
            walk = layout.live(offset, qi, kj) & ~stick_spent(state[0])
            state, (dp, dq, dk, dprep, dv) = jax.lax.cond(
                walk, lambda s: pair(s, kj, kf_j, kn_j, v_j), dead, state
            )
            inner = (
                state,
                add_trees(d_params_i, dp),
                add_trees(d_qf_i, dq),
                add_trees(d_prep_i, dprep),
            )
            return inner, (dk, dv)

        state0 = (jnp.zeros((batch, heads, size_q), jnp.float32),) * 2
        inner0 = (state0, zeros(params), zeros(qf_i), zeros(prepared))
        k_rev = jax.tree.map(lambda x: x[::-1], (jnp.arange(layout.count_k), kf, kn, v_GBKNW))
        (_, d_params_i, d_qf_i, d_prep_i), (d_kf_rev, d_v_rev) = jax.lax.scan(body, inner0, k_rev)
        d_params_prep, d_qf_prep = prepare_vjp(d_prep_i)
        carry = (
            add_trees(d_params, add_trees(d_params_i, d_params_prep)),
            add_trees(d_kf, jax.tree.map(lambda x: x[::-1], d_kf_rev)),
            d_v + d_v_rev[::-1],
        )
        return carry, add_trees(d_qf_i, d_qf_prep)

    init = (zeros(params), zeros(kf), jnp.zeros_like(v_GBKNW))
    q_in = (jnp.arange(layout.count_q), qf, qn, d_out_GBQNW, delta_GBNQ)
    (d_params, d_kf, d_v), d_qf = jax.lax.scan(per_query_block, init, q_in)
    return {
        "sink": None,
        "params": d_params,
        "qf": d_qf,
        "qn": None,
        "kf": d_kf,
        "kn": None,
        "v": d_v,
        "offset": None,
    }
