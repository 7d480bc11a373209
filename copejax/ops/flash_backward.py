"""The flash backward of the blockwise engine (FlashAttention-2, Dao 2023, arXiv 2307.08691).

:func:`flash_backward` recomputes each pair's scores from the saved output and per-query
log-sum-exp and pulls ``dS = P (dP - D)`` back through the pair's score function; the
equations are in :mod:`copejax.ops.engine`'s docstring, which wires this function into a
``jax.custom_vjp``. Shape letters as there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import Pytree, Replay
from copejax.ops.engine_layout import Layout

# ----------------------------------------------------------------------------- flash


def flash_backward(
    layout: Layout,
    data: dict,
    out_GBQNW: jax.Array,
    lse_GBNQ: jax.Array,
    d_out_GBQNW: jax.Array,
    *,
    replay: Replay | None = None,
) -> dict:
    """FlashAttention-2's backward (module docstring), one query block at a time; returns the
    cotangent of ``data`` (None for its integer parts). With ``replay`` (the forward's last
    carries, stacked over query blocks; ``Layout.replays_oldest_first``) the carries are
    replayed oldest first inside the walk (``BlockTerm.retreat``), else by a pass of their
    own."""
    params, qf, qn, kf, kn = (data[key] for key in ("params", "qf", "qn", "kf", "kn"))
    v_GBKNW, offset, terms = data["v"], data["offset"], layout.terms
    no_carries = [None] * len(terms)  # the band walk: terms without a carry only
    d_out_GBQNW = d_out_GBQNW.astype(jnp.float32)
    delta_GBNQ = jnp.moveaxis(jnp.sum(d_out_GBQNW * out_GBQNW, axis=-1), 3, 2)
    zeros = zeros_like_tree

    def walk_carries(qi: jax.Array, qf_i: dict, qn_i: dict, prepared: list) -> list:
        """The terms' carries entering each key block (G, ...), in key-block order: the
        forward's walk from the newest block to the oldest, carries only."""
        batch, heads = v_GBKNW.shape[1], v_GBKNW.shape[3]
        init = [None if t.init is None else t.init(batch, heads, layout.size_q) for t in terms]

        def body(carries: list, k_in: tuple) -> tuple[list, list]:
            kj, kf_j, kn_j = k_in

            def step(carries: list) -> list:
                allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)
                return layout.advance(
                    params, prepared, carries, qf=qf_i, qn=qn_i, kf=kf_j, kn=kn_j,
                    allowed_BQK=allowed_BQK, offset=offset, qi=qi, kj=kj,
                )  # fmt: skip

            after = jax.lax.cond(layout.live(offset, qi, kj), step, lambda c: c, carries)
            return after, carries

        k_rev = jax.tree.map(lambda x: x[::-1], (jnp.arange(layout.count_k), kf, kn))
        _, entering = jax.lax.scan(body, init, k_rev)
        return jax.tree.map(lambda x: x[::-1], entering)

    def per_query_block(carry: tuple, q_in: tuple) -> tuple[tuple, dict]:
        if layout.banded:
            return per_query_band(carry, q_in)
        d_params, d_kf, d_v = carry
        qi, qf_i, qn_i, d_out_i, lse_i, delta_i, replay_i = q_in
        prepared, prepare_vjp = jax.vjp(layout.prepare, params, qf_i)
        pair_grads = pair_grads_of((qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared))
        k_in = (jnp.arange(layout.count_k), kf, kn, v_GBKNW)

        def dead_pair(kf_j: dict, v_j: jax.Array, d_leaving: list) -> tuple:
            """A key block after the query block: no gradient; the carry's cotangent passes."""
            return (
                zeros(params), zeros(qf_i), zeros(kf_j), zeros(prepared), zeros(v_j), d_leaving,
            )  # fmt: skip

        if replay_i is None:
            entering = walk_carries(qi, qf_i, qn_i, prepared)

            def body(inner: tuple, k_in: tuple) -> tuple[tuple, tuple]:
                d_params_i, d_qf_i, d_prep_i, d_leaving = inner
                kj, kf_j, kn_j, v_j, carries_j = k_in

                def live(_: None) -> tuple:
                    settled = layout.settled(params, prepared, carries_j)
                    grads = functools.partial(
                        pair_grads, kj, kf_j, kn_j, v_j, carries_j=carries_j, d_leaving=d_leaving
                    )
                    if settled is None:
                        return grads(mode="full")
                    return jax.lax.cond(
                        settled, lambda: grads(mode="settled"), lambda: grads(mode="full")
                    )

                dp, dq, dk, dprep, dv, d_entering = jax.lax.cond(
                    layout.live(offset, qi, kj), live, lambda _: dead_pair(kf_j, v_j, d_leaving),
                    None,
                )  # fmt: skip
                inner = (
                    add_trees(d_params_i, dp),
                    add_trees(d_qf_i, dq),
                    add_trees(d_prep_i, dprep),
                    d_entering,
                )
                return inner, (dk, dv)

            inner0 = (zeros(params), zeros(qf_i), zeros(prepared), zeros(_first(entering)))
            (d_params_i, d_qf_i, d_prep_i, _), (d_kf_i, d_v_i) = jax.lax.scan(
                body, inner0, (*k_in, entering)
            )
        else:

            def replay_body(inner: tuple, k_in: tuple) -> tuple[tuple, tuple]:
                """Oldest key block first; ``leaving`` is the carry leaving this block (the
                forward's last carry at the oldest one)."""
                d_params_i, d_qf_i, d_prep_i, d_leaving, leaving = inner
                kj, kf_j, kn_j, v_j = k_in
                grads = functools.partial(pair_grads, kj, kf_j, kn_j, v_j, d_leaving=d_leaving)

                def settled(_: None) -> tuple:  # a settled pair leaves its carry as it was
                    return (*grads(carries_j=leaving, mode="settled"), leaving)

                def counted(_: None) -> tuple:
                    allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)
                    entering = layout.retreat(
                        params, prepared, leaving, qf=qf_i, qn=qn_i, kf=kf_j, kn=kn_j,
                        allowed_BQK=allowed_BQK, offset=offset, qi=qi, kj=kj,
                    )  # fmt: skip
                    return (*grads(carries_j=entering, mode="full"), entering)

                def live(_: None) -> tuple:
                    return jax.lax.cond(kj <= replay_i.newest_settled, settled, counted, None)

                dp, dq, dk, dprep, dv, d_entering, entering = jax.lax.cond(
                    layout.live(offset, qi, kj),
                    live,
                    lambda _: (*dead_pair(kf_j, v_j, d_leaving), leaving),
                    None,
                )
                inner = (
                    add_trees(d_params_i, dp),
                    add_trees(d_qf_i, dq),
                    add_trees(d_prep_i, dprep),
                    d_entering,
                    entering,
                )
                return inner, (dk, dv)

            last = replay_i.carries
            inner0 = (zeros(params), zeros(qf_i), zeros(prepared), zeros(last), last)
            (d_params_i, d_qf_i, d_prep_i, _, _), (d_kf_i, d_v_i) = jax.lax.scan(
                replay_body, inner0, k_in
            )
        d_params_prep, d_qf_prep = prepare_vjp(d_prep_i)
        d_qf_i = add_trees(d_qf_i, d_qf_prep)
        carry = (
            add_trees(d_params, add_trees(d_params_i, d_params_prep)),
            add_trees(d_kf, d_kf_i),
            d_v + d_v_i,
        )
        return carry, d_qf_i

    def per_query_band(carry: tuple, q_in: tuple) -> tuple[tuple, dict]:
        """The same for a window: the band's key blocks, gathered by index, their gradients
        added back at their index."""
        d_params, d_kf, d_v = carry
        qi, qf_i, qn_i, d_out_i, lse_i, delta_i, _ = q_in
        prepared, prepare_vjp = jax.vjp(layout.prepare, params, qf_i)

        def body(inner: tuple, k_in: tuple) -> tuple[tuple, None]:
            d_params_i, d_qf_i, d_prep_i, d_kf, d_v = inner
            kj, live = k_in
            kj = jnp.clip(kj, 0, layout.count_k - 1)
            kf_j, kn_j, v_j = layout.gather((kf, kn, v_GBKNW), kj)
            dp, dq, dk, dprep, dv = jax.lax.cond(
                live,
                lambda _: pair_grads_of((qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared))(
                    kj, kf_j, kn_j, v_j, carries_j=no_carries, d_leaving=no_carries, mode="full"
                )[:5],
                lambda _: (zeros(params), zeros(qf_i), zeros(kf_j), zeros(prepared), zeros(v_j)),
                None,
            )
            d_kf = jax.tree.map(lambda a, g: a.at[kj].add(g.astype(a.dtype)), d_kf, dk)
            inner = (
                add_trees(d_params_i, dp),
                add_trees(d_qf_i, dq),
                add_trees(d_prep_i, dprep),
                d_kf,
                d_v.at[kj].add(dv),
            )
            return inner, None

        inner0 = (zeros(params), zeros(qf_i), zeros(prepared), d_kf, d_v)
        (d_params_i, d_qf_i, d_prep_i, d_kf, d_v), _ = jax.lax.scan(
            body, inner0, layout.walk_plan(offset, qi, kn)
        )
        d_params_prep, d_qf_prep = prepare_vjp(d_prep_i)
        d_qf_i = add_trees(d_qf_i, d_qf_prep)
        return (add_trees(d_params, add_trees(d_params_i, d_params_prep)), d_kf, d_v), d_qf_i

    def pair_grads_of(q_side: tuple) -> Callable:
        """The gradients of one (query block, key block) pair for query block ``q_side``:
        (qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared)."""
        qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared = q_side

        def grads(
            kj: jax.Array,
            kf_j: dict,
            kn_j: dict,
            v_j: jax.Array,
            *,
            carries_j: list,
            d_leaving: list,
            mode: str,
        ) -> tuple:
            """(d params, d qf, d kf, d prepared, d v, d carries entering) of the pair, given
            the carries entering it and the cotangent of those leaving it; ``mode`` as in
            ``Layout.scores`` ("settled": the carried terms' row constants)."""
            allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)

            def grads_as(mode: str) -> tuple:
                def score_fn(
                    p: list, q_side: dict, k_side: dict, prep: list, carries: list
                ) -> tuple[jax.Array, list]:
                    return layout.scores(
                        p,
                        prep,
                        carries,
                        qf=q_side,
                        qn=qn_i,
                        kf=k_side,
                        kn=kn_j,
                        allowed_BQK=allowed_BQK,
                        offset=offset,
                        qi=qi,
                        kj=kj,
                        mode=mode,
                    )

                primals = (params, qf_i, kf_j, prepared, carries_j)
                (scores_BNQK, _), score_vjp = jax.vjp(score_fn, *primals)
                p_BNQK = jnp.where(
                    allowed_BQK[:, None], jnp.exp(scores_BNQK - lse_i[..., None]), 0.0
                )
                d_v_j = jnp.einsum(
                    "BNQK,BQNW->BKNW", p_BNQK, d_out_i, preferred_element_type=jnp.float32
                ).astype(v_j.dtype)
                d_p_BNQK = jnp.einsum("BQNW,BKNW->BNQK", d_out_i, v_j.astype(jnp.float32))
                d_s_BNQK = p_BNQK * (d_p_BNQK - delta_i[..., None])
                dp, dq, dk, dprep, d_entering = score_vjp((d_s_BNQK, d_leaving))
                return dp, dq, dk, dprep, d_v_j, d_entering

            # A settled pair (every carried term one value per query) differentiates only
            # the row constants; callers choose outside jax.vjp, so that neither branch
            # computes or zero-fills the other's intermediates.
            return grads_as(mode)

        return grads

    init = (zeros(params), zeros(kf), jnp.zeros_like(v_GBKNW))
    q_in = (
        jnp.arange(layout.count_q),
        qf,
        qn,
        d_out_GBQNW,
        lse_GBNQ,
        delta_GBNQ,
        replay,
    )
    (d_params, d_kf, d_v), d_qf = jax.lax.scan(per_query_block, init, q_in)
    d_sink = None
    if data["sink"] is not None:
        # The sink is a key with value 0 in every row: dS = P_sink (0 - D_i).
        sink_1N1 = data["sink"].astype(jnp.float32)[None, :, None]
        p_sink_GBNQ = jnp.exp(sink_1N1 - lse_GBNQ)
        d_sink = -jnp.sum(p_sink_GBNQ * delta_GBNQ, axis=(0, 1, 3)).astype(data["sink"].dtype)
    return {
        "sink": d_sink,
        "params": d_params,
        "qf": d_qf,
        "qn": None,
        "kf": d_kf,
        "kn": None,
        "v": d_v,
        "offset": None,
    }


def _first(stacked: Pytree) -> Pytree:
    """Element 0 of a stacked pytree (G, ...)."""
    return jax.tree.map(lambda x: x[0], stacked)


def zeros_like_tree(tree: Pytree) -> Pytree:
    """Zeros shaped like ``tree`` (None leaves stay None)."""
    return jax.tree.map(jnp.zeros_like, tree)


def add_trees(a: Pytree, b: Pytree) -> Pytree:
    """Leafwise a + b in a's dtypes."""
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)
