"""One blockwise attention engine for every position scheme, in O(T) memory.

Queries go in blocks of Q, keys in blocks of K. For each (query block, key block) pair the engine
computes the scaled content logits ``q . k / sqrt(H)``, adds each scheme's *block term* (its bias
for that pair, from the two blocks' positions, q, k and per-token arrays; see
:class:`BlockTerm`) and folds the pair into an online softmax (Milakov & Gimelshein 2018,
arXiv 1805.02867) or, for stick-breaking, into the stick remainder. Key blocks are walked from
the newest to the oldest, so that a term may keep a *carry* across them: CoPE's count of the
newer blocks' gates (arXiv 2405.18719, eq. 4), stick-breaking's log remainder
(arXiv 2410.17980). Key blocks after the query block are skipped (``lax.cond``).

Sliding windows (``window`` W: query i sees keys ``i - W < j <= i``): a query block walks only
the band of key blocks that meet its window, at most ``(W + Q - 2) // K + 2`` of them, gathered
by index, so that the cost is O(T W) rather than O(T^2) (the flash backward walks the same
band). With StreamingLLM's kept sink tokens (``sink_tokens``), the older key blocks that hold a
segment's first keys are walked after the band; every older block is then tested
(``lax.cond``), but only those with a sink key are computed.

Backward passes (``backward``):

- ``"flash"`` (softmax): a ``jax.custom_vjp`` after FlashAttention-2
  (Dao 2023, arXiv 2307.08691). The forward keeps the output ``o_i`` (float32) and each
  query's log-sum-exp ``L_i = log sum_j exp s_ij``. The backward recomputes each pair's scores
  ``s_ij`` (content logits plus block terms) and, with ``P_ij = exp(s_ij - L_i)`` on allowed
  pairs, ``D_i = sum_h dO_ih o_ih``:

      dV_j  = sum_i P_ij dO_i
      dP_ij = dO_i . v_j
      dS_ij = P_ij (dP_ij - D_i)

  and pulls ``dS`` back through the score function of the pair (``jax.vjp``), which gives the
  gradients of q, k, the terms' per-token arrays, their parameters and their per-query-block
  precomputations (pulled back once per query block). No (T, S) array and no saved walk.
  A sink logit ``z_n`` (GPT-OSS; ``sink_N``) is a key of value 0 in every row, so ``L_i``
  includes it and ``dz_n = -sum_i exp(z_n - L_i) D_i``.
  A term with a carry (CoPE's count ``c``, PaTH's transformed queries) makes pair j's scores
  a function ``s_j = f_j(c_j)`` of the carry entering key block j, and ``c_{j-1} =
  a_j(c_j)`` (the walk goes from the newest block to the oldest). The backward first replays
  the carries (``c_j`` for every key block of a query block: the term's ``advance``, or its
  bias when it has none; (G, B, N, Q) for CoPE, so still O(T) per query block), then walks
  the pairs *oldest first*, so that the cotangent of the carry leaving block j,
  ``dc_{j-1}``, is known when block j is reached:

      (dq, dk, d params, dc_j) += vjp of (f_j, a_j) at c_j, applied to (dS_j, dc_{j-1})

  with ``dc`` of the oldest block's leaving carry 0; blocks after the query block pass ``dc``
  through. A term with ``retreat`` (``a_j``'s inverse; CoPE: ``c_j = c_{j-1} - sum_k g_jk``)
  needs no replay pass: the forward keeps each query block's last carry and its newest
  settled block (:class:`~copejax.ops.engine_blocks.Replay`, O(T)), and the oldest-first
  walk rebuilds ``c_j`` from ``c_{j-1}`` as it goes (settled blocks leave it unchanged).
  Either replay needs the key blocks in order, so a window's band walk (and a ring
  buffer's unordered keys) keeps remat for a carry.
  A *settled* pair (``BlockTerm.settled``: CoPE once every query of the block has counted
  ``p_max - 1`` gates) has ``f_j(c) = l_j + b(c)`` with a per-query constant ``b`` and
  ``a_j(c) = c``, so its vjp is the content logits' plus ``db_i = sum_j dS_ij``; a
  ``lax.cond`` per pair, outside ``jax.vjp``, picks it (a cond inside the differentiated
  function would make the settled branch zero-fill the full term's residuals). At
  T = 1024, B x N = 8 on a 2-core CPU this took CoPE's engine from 1.98x to 1.71x the
  term-free walk's forward+backward time (11 interleaved rounds).
- ``"remat"``: JAX differentiates the walk, each pair's body rematerialised
  (``jax.checkpoint``) and, above ``REMAT_WALKS_ABOVE`` blocks, whole query-block walks too, so
  the backward keeps carries only. ``"auto"`` takes it only for a carry or stick-breaking in
  a window (or over ring-buffer keys) and for a carry without an ``advance`` (PaTH, where
  flash measured a tie); flash measured faster from 4 key blocks on (timed against "flash" by
  ``python -m experiments.bench``, the "fox remat" arm), for CoPE's count and for
  stick-breaking.
- stick-breaking's flash backward (:mod:`copejax.ops.stick_flash`): no log-sum-exp, one walk
  newest first that replays the stick remainder and carries the newer blocks' share of
  ``D_i``; equations there.

The engine is four modules: this one (the entry point, the forward / remat walk and the
custom VJP), :mod:`~copejax.ops.engine_blocks` (the pair, term and normalizer types, blocking
and the online normaliser states), :mod:`~copejax.ops.engine_layout` (a call's static layout:
which key blocks a query block walks, the allowed pairs and a pair's scores) and
:mod:`~copejax.ops.flash_backward`.

Shape letters: B batch, T queries, S keys, N heads, H head dim (values may be wider: TAPE mixes
its position tensors as extra value features), Q / K query / key block length, G blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.engine_blocks import (
    EMPTY_KEY_INDEX,
    NORMALIZERS,
    SOFTMAX,
    BlockTerm,
    Normalizer,
    Replay,
    from_blocks,
    num_blocks,
    softmax_finish,
    softmax_init,
    softmax_update,
    stick_spent,
    stickbreaking_init,
    stickbreaking_update,
    to_blocks,
)
from copejax.ops.engine_layout import Layout
from copejax.ops.flash_backward import flash_backward
from copejax.ops.stick_flash import stick_flash_backward

# Rematerialise whole query-block walks only above this many key blocks (remat backward).
REMAT_WALKS_ABOVE = 8
BACKWARDS = ("auto", "flash", "remat")


# ----------------------------------------------------------------------------- remat walk


def _remat_walk(layout: Layout, data: dict) -> tuple[jax.Array, jax.Array, Replay]:
    """Every query block walks its key blocks newest first; JAX differentiates the walk.

    ``data``: the blocked inputs, {"params", "qf", "qn", "kf", "kn", "v", "offset"} (see
    :func:`blockwise_attention`). Returns (outputs (G, B, Q, N, W) float32, per-query statistic
    (G, B, N, Q): the log-sum-exp for softmax, the log stick remainder for stick-breaking,
    and per query block what the flash backward replays the carries from (:class:`Replay`)).
    """
    params, qf, qn, kf, kn = (data[key] for key in ("params", "qf", "qn", "kf", "kn"))
    v_GBKNW, offset = data["v"], data["offset"]
    batch, heads, width = v_GBKNW.shape[1], v_GBKNW.shape[3], v_GBKNW.shape[4]
    sticks = layout.normalizer.kind == "stickbreaking"
    tracks_settled = any(t.settled is not None for t in layout.terms)
    k_index_rev = jnp.arange(layout.count_k)[::-1]
    k_rev = jax.tree.map(lambda x: x[::-1], (kf, kn, v_GBKNW))

    def one_query_block(qi: jax.Array, qf_i: dict, qn_i: dict) -> tuple[jax.Array, jax.Array]:
        prepared = layout.prepare(params, qf_i)
        if sticks:
            init_acc = stickbreaking_init(batch, heads, layout.size_q, width)
        else:
            init_acc = softmax_init(batch, heads, layout.size_q, width, data["sink"])
        init_carries = [
            None if t.init is None else t.init(batch, heads, layout.size_q) for t in layout.terms
        ]

        def step(state: tuple, kj: jax.Array, kf_j: dict, kn_j: dict, v_j: jax.Array) -> tuple:
            acc, carries, newest_settled = state
            if tracks_settled:  # the flash backward's replay reads which blocks were settled
                settled = layout.settled(params, prepared, carries)
                newest_settled = jnp.where(settled, jnp.maximum(newest_settled, kj), newest_settled)
            allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)
            scores_BNQK, carries = layout.scores(
                params,
                prepared,
                carries,
                qf=qf_i,
                qn=qn_i,
                kf=kf_j,
                kn=kn_j,
                allowed_BQK=allowed_BQK,
                offset=offset,
                qi=qi,
                kj=kj,
            )
            if sticks:
                acc = stickbreaking_update(acc, scores_BNQK, allowed_BQK, v_j, layout.scan_impl)
            else:
                acc = softmax_update(acc, scores_BNQK, allowed_BQK, v_j)
            return acc, carries, newest_settled

        def body(state: tuple, k_in: tuple) -> tuple[tuple, None]:
            kj, (kf_j, kn_j, v_j) = k_in
            walk = layout.live(offset, qi, kj)
            if sticks:  # older blocks of a used-up stick weigh exactly 0 (STICK_SPENT)
                walk = walk & ~stick_spent(state[0]["remainder_BNQ"])
            state = jax.lax.cond(walk, lambda s: step(s, kj, kf_j, kn_j, v_j), lambda s: s, state)
            return state, None

        def band_body(state: tuple, k_in: tuple) -> tuple[tuple, None]:
            kj, live = k_in
            kj = jnp.clip(kj, 0, layout.count_k - 1)
            kf_j, kn_j, v_j = layout.gather((kf, kn, v_GBKNW), kj)
            if sticks:  # the plan walks newest first too
                live = live & ~stick_spent(state[0]["remainder_BNQ"])
            state = jax.lax.cond(live, lambda s: step(s, kj, kf_j, kn_j, v_j), lambda s: s, state)
            return state, None

        init = (init_acc, init_carries, jnp.asarray(-1, jnp.int32))
        if layout.banded:
            band_body = jax.checkpoint(band_body, prevent_cse=False)
            (acc, carries, newest_settled), _ = jax.lax.scan(
                band_body, init, layout.walk_plan(offset, qi, kn)
            )
        else:
            body = jax.checkpoint(body, prevent_cse=False)
            (acc, carries, newest_settled), _ = jax.lax.scan(body, init, (k_index_rev, k_rev))
        if sticks:
            out, stat = acc["acc_BQNW"], -acc["remainder_BNQ"]
        else:
            out, stat = softmax_finish(acc)
        return out, stat, Replay(carries, newest_settled)

    if layout.count_k > REMAT_WALKS_ABOVE:
        one_query_block = jax.checkpoint(one_query_block, prevent_cse=False)
    return jax.lax.map(lambda xs: one_query_block(*xs), (jnp.arange(layout.count_q), qf, qn))


def _flash_walk(layout: Layout) -> Callable:
    """The walk with the flash backward (softmax's, or stick-breaking's of
    :mod:`copejax.ops.stick_flash`), as a ``jax.custom_vjp`` of the blocked inputs ``data`` ->
    outputs (G, B, Q, N, W) float32."""

    @jax.custom_vjp
    def walk(data: dict) -> jax.Array:
        return _remat_walk(layout, data)[0]

    def forward(data: dict) -> tuple[jax.Array, tuple]:
        out_GBQNW, lse_GBNQ, replay = _remat_walk(layout, data)
        if not layout.replays_oldest_first:
            replay = None
        return out_GBQNW, (data, out_GBQNW, lse_GBNQ, replay)

    def backward(residuals: tuple, d_out_GBQNW: jax.Array) -> tuple[dict]:
        data, out_GBQNW, lse_GBNQ, replay = residuals
        if layout.normalizer.kind == "stickbreaking":
            return (stick_flash_backward(layout, data, out_GBQNW, d_out_GBQNW),)
        return (flash_backward(layout, data, out_GBQNW, lse_GBNQ, d_out_GBQNW, replay=replay),)

    walk.defvjp(forward, backward)
    return walk


# ----------------------------------------------------------------------------- entry point


def blockwise_attention(
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    v_BSNW: jax.Array,
    *,
    q_positions_BT: jax.Array | None = None,
    k_positions_BS: jax.Array | None = None,
    q_segment_ids_BT: jax.Array | None = None,
    k_segment_ids_BS: jax.Array | None = None,
    offset: jax.Array | int = 0,
    terms: Sequence[BlockTerm] = (),
    normalizer: Normalizer = SOFTMAX,
    block: int = 128,
    scan_impl: str = "auto",
    backward: str = "auto",
    window: int | None = None,
    sink_tokens: int = 0,
    k_index_BS: jax.Array | None = None,
    k_rank_BS: jax.Array | None = None,
    sink_N: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention over (query block, key block) pairs, never a (T, S) array.

    Args:
      q_BTNH, k_BSNH: queries and keys after the qk site.
      v_BSNW: values (W = H, or wider when a scheme mixes extra per-key features).
      q_positions_BT, k_positions_BS: integer positions (what the terms read), (B, T) or
        (T,); None: ``offset + t`` for query t, s for key s.
      q_segment_ids_BT, k_segment_ids_BS: packed documents; query t (key ``offset + t``) sees
        key s iff s <= offset + t and the ids are equal. None: one document per row.
      offset: the key index of query 0 (0 in self-attention, the cache index when decoding).
      terms: the schemes' block terms, summed into the scores.
      normalizer: softmax, or stick-breaking.
      block: the block length (queries use ``min(block, T)``, keys ``min(block, S)``).
      scan_impl: suffix sums of stick-breaking (``copejax.ops.scan``).
      backward: "auto" (flash where it applies: softmax, and for a term with a carry no
        window, no ring buffer and an ``advance``; remat otherwise), "flash" or "remat".
      window: a sliding window W (query i sees keys ``i - W < j <= i``); None: full causal.
      sink_tokens: with a window, the first n keys of each segment stay visible
        (StreamingLLM, arXiv 2309.17453).
      k_index_BS: each key's index when the keys are not in order (a ring-buffer decode
        cache; empty slots carry a huge index); every key block is then walked.
      k_rank_BS: each key's index within its segment (for the sinks); None: derived from
        ``k_segment_ids_BS``.
      sink_N: a learned logit per head (float, (N,)) that joins every query's softmax
        denominator and mixes no value (GPT-OSS's attention sink); seeds the online softmax.
        Softmax only; differentiable on both backwards.

    Returns:
      (y_BTNW in ``v_BSNW``'s dtype, stat_BNT): with the remat backward, the per-query
      log-sum-exp (softmax; the sink included) or the log of the stick remainder,
      log prod_k (1 - beta_ik) (stick-breaking; once every query of a block is below
      ``-STICK_SPENT`` the older blocks are skipped and it stays at its value there, whose
      exp is 0 in float32 either way), float32; None with the flash backward.
    """
    if backward not in BACKWARDS:
        raise ValueError(f"engine: backward must be one of {BACKWARDS}, got {backward!r}")
    if normalizer.kind not in NORMALIZERS:
        raise ValueError(f"engine: normalizer must be one of {NORMALIZERS}, got {normalizer!r}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"engine: window must be a positive integer or None, got {window!r}")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"engine: sink_tokens must be an integer >= 0, got {sink_tokens!r}")
    sink_tokens = sink_tokens if window is not None else 0
    batch, length_q, length_k = q_BTNH.shape[0], q_BTNH.shape[1], k_BSNH.shape[1]
    if q_positions_BT is None:
        q_positions_BT = jnp.asarray(offset, jnp.int32) + jnp.arange(length_q, dtype=jnp.int32)
    if k_positions_BS is None:
        k_positions_BS = jnp.arange(length_k, dtype=jnp.int32)
    q_positions_BT = jnp.broadcast_to(q_positions_BT, (batch, length_q))
    k_positions_BS = jnp.broadcast_to(k_positions_BS, (batch, length_k))
    q_segment_ids_BT = segments.default_segment_ids(q_segment_ids_BT, batch, length_q)
    k_segment_ids_BS = segments.default_segment_ids(k_segment_ids_BS, batch, length_k)
    size_q, size_k = min(block, length_q), min(block, length_k)
    terms = tuple(terms)
    layout = Layout(
        terms=terms,
        normalizer=normalizer,
        size_q=size_q,
        size_k=size_k,
        count_q=num_blocks(length_q, size_q),
        count_k=num_blocks(length_k, size_k),
        scan_impl=scan_impl,
        window=window,
        sink_tokens=sink_tokens,
        explicit_index=k_index_BS is not None,
    )
    qf = {
        "q": to_blocks(q_BTNH, size_q),
        "x": [jax.tree.map(lambda a: to_blocks(a, size_q), t.q_arrays) for t in terms],
    }
    qn = {"pos": to_blocks(q_positions_BT, size_q), "seg": to_blocks(q_segment_ids_BT, size_q)}
    kf = {
        "k": to_blocks(k_BSNH, size_k),
        "x": [jax.tree.map(lambda a: to_blocks(a, size_k), t.k_arrays) for t in terms],
    }
    kn = {"pos": to_blocks(k_positions_BS, size_k), "seg": to_blocks(k_segment_ids_BS, size_k)}
    if k_index_BS is not None:  # padding keys get a huge index: never visible
        pad = layout.count_k * size_k - length_k
        padded_BS = jnp.pad(k_index_BS, ((0, 0), (0, pad)), constant_values=EMPTY_KEY_INDEX)
        kn["idx"] = to_blocks(padded_BS.astype(jnp.int32), size_k)
    if sink_tokens:
        if k_rank_BS is None:
            k_rank_BS = segments.segment_rank_BS(k_segment_ids_BS)
        kn["rank"] = to_blocks(k_rank_BS.astype(jnp.int32), size_k)
    if sink_N is not None and normalizer.kind != "softmax":
        raise ValueError(
            f"engine: sink_N joins a softmax denominator; normalizer {normalizer.kind!r} has none"
        )
    data = {
        "sink": sink_N,
        "params": [t.params for t in terms],
        "qf": qf,
        "qn": qn,
        "kf": kf,
        "kn": kn,
        "v": to_blocks(v_BSNW, size_k),
        "offset": jnp.asarray(offset, jnp.int32),
    }
    carried = any(t.init is not None for t in terms)
    in_order = not (layout.banded or layout.explicit_index)
    if normalizer.kind == "softmax":
        flash_applies = in_order or not carried
    else:  # stick-breaking's flash backward walks every older key block, with no term carry
        flash_applies = in_order and not carried
    if backward == "flash" and not flash_applies:
        raise ValueError(
            "engine: backward='flash' needs a walk over every older key block in order (no "
            "window, no ring-buffer keys) for a term with a carry or for stick-breaking; use "
            "'remat'"
        )
    # "auto": flash wherever it applies. Side-by-side rounds on a 2-core CPU (B x N = 8,
    # H = 64, one layer forward+backward, median over 11 rounds of process CPU time relative
    # to the round's fastest nope arm) had it ahead of remat at 4 and 8 key blocks as well:
    # T = 512 nope 1.00 vs 1.11, FoX 1.18 vs 1.31; T = 1024 nope 1.00 vs 1.08, FoX 1.12 vs
    # 1.25. (An earlier wall-time reading at T = 1024, remat ahead, was within the load noise.)
    # A carry with an ``advance`` of its own (CoPE's count) takes flash too: on the same
    # rounds' footing (T = 1024 / 4096, process CPU time, 7 / 5 rounds) CoPE's layer went
    # from 1.96x / 2.32x the fastest nope with remat to 1.73x / 1.72x. A carry without one
    # (PaTH's transformed queries) would recompute its whole term in the carries' pass:
    # 4.21x against remat's 4.27x at T = 1024, a tie, so auto keeps remat there.
    # Stick-breaking's flash backward (copejax.ops.stick_flash), same footing: 1.87x / 2.33x
    # with remat, 1.78x / 1.88x with flash at T = 1024 / 4096.
    flash = backward == "flash" or (
        backward == "auto"
        and flash_applies
        and all(t.init is None or t.advance is not None for t in terms)
    )
    if flash:
        out_GBQNW = _flash_walk(layout)(data)
        stat_GBNQ = None
    else:
        out_GBQNW, stat_GBNQ, _ = _remat_walk(layout, data)
    y_BTNW = from_blocks(out_GBQNW, length_q).astype(v_BSNW.dtype)
    if stat_GBNQ is None:
        return y_BTNW, None
    stat_BNT = jnp.moveaxis(from_blocks(jnp.moveaxis(stat_GBNQ, 3, 2), length_q), 2, 1)
    return y_BTNW, stat_BNT
