"""The static layout of one blockwise-attention call (:mod:`copejax.ops.engine`).

:class:`Layout` holds the block sizes and counts, the scheme's terms and normalizer, and the
window / sink plan, and computes what every walk of the engine shares: which key blocks a
query block walks (all older ones, or the band that meets its window, plus sink blocks),
which (query, key) pairs are allowed, and the scores of one pair (content logits plus the
terms, with their carries). Shape letters as in :mod:`copejax.ops.engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.engine_blocks import BlockTerm, Normalizer, PairBlock, Pytree, content_logits_BNQK

# ----------------------------------------------------------------------------- scores

SCORE_MODES = ("auto", "full", "settled")


def _term_bias(
    term: BlockTerm, params: Pytree, pair: PairBlock, prepared: Pytree, carry: Pytree, *, mode: str
) -> tuple[jax.Array, Pytree]:
    """One term's bias for the pair and its carry after it (see :meth:`Layout.scores`)."""
    if term.settled is None or mode == "full":
        return term.bias(params, pair, prepared, carry)

    def constant(carry: Pytree) -> tuple[jax.Array, Pytree]:
        row_BNQ = term.settled(params, prepared, carry)[1].astype(jnp.float32)
        shape = (*row_BNQ.shape, pair.k_BKNH.shape[1])
        return jnp.broadcast_to(row_BNQ[..., None], shape), carry

    if mode == "settled":
        return constant(carry)

    def full(carry: Pytree) -> tuple[jax.Array, Pytree]:
        bias_BNQK, new_carry = term.bias(params, pair, prepared, carry)
        return bias_BNQK.astype(jnp.float32), new_carry

    return jax.lax.cond(term.settled(params, prepared, carry)[0], constant, full, carry)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static facts of one call: block sizes, counts, the terms and the normalizer."""

    terms: tuple[BlockTerm, ...]
    normalizer: Normalizer
    size_q: int
    size_k: int
    count_q: int
    count_k: int
    scan_impl: str
    window: int | None = None
    sink_tokens: int = 0
    explicit_index: bool = False

    @property
    def replays_oldest_first(self) -> bool:
        """Whether the flash backward replays the carries from the forward's last ones: some
        term has a carry, every such term a ``retreat``, at most one term a ``settled`` test,
        and the walk is over every older key block in order."""
        carried = [t for t in self.terms if t.init is not None]
        in_order = not (self.banded or self.explicit_index)
        # The forward settles each term on its own carry and the replay reads one flag per
        # pair: they agree when at most one term settles.
        one_settling = sum(t.settled is not None for t in self.terms) <= 1
        return (
            bool(carried)
            and in_order
            and one_settling
            and all(t.retreat is not None for t in carried)
        )

    @property
    def banded(self) -> bool:
        """Whether query blocks walk only the key blocks that meet their window."""
        return self.window is not None and not self.explicit_index

    @property
    def band_blocks(self) -> int:
        """The most key blocks a window of W keys meets from a query block of Q queries."""
        return min(self.count_k, (self.window + self.size_q - 2) // self.size_k + 2)

    def walk_plan(self, offset: jax.Array, qi: jax.Array, kn: dict) -> tuple[jax.Array, ...]:
        """The key blocks query block qi walks, newest first, and whether each is live:
        the band that meets the window, then (with sink tokens) every older block, live
        where it holds a key among its segment's first ``sink_tokens``."""
        q_first = self.q_start(offset, qi)
        newest = jnp.minimum((q_first + self.size_q - 1) // self.size_k, self.count_k - 1)
        band = newest - jnp.arange(self.band_blocks)
        live = (band >= 0) & ((band + 1) * self.size_k - 1 >= q_first - self.window + 1)
        if not self.sink_tokens:
            return band, live
        has_sink_G = jnp.any(kn["rank"] < self.sink_tokens, axis=(1, 2))
        live = live | ((band >= 0) & has_sink_G[jnp.clip(band, 0, self.count_k - 1)])
        older = jnp.arange(self.count_k)[::-1]
        older_live = (older < newest - self.band_blocks + 1) & has_sink_G[older]
        return jnp.concatenate([band, older]), jnp.concatenate([live, older_live])

    def gather(self, tree: Pytree, kj: jax.Array) -> Pytree:
        """Key block kj (clipped to the blocks) of blocked arrays (G, ...)."""
        kj = jnp.clip(kj, 0, self.count_k - 1)
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, kj, 0, False), tree)

    def q_start(self, offset: jax.Array, qi: jax.Array) -> jax.Array:
        return offset + qi * self.size_q

    def live(self, offset: jax.Array, qi: jax.Array, kj: jax.Array) -> jax.Array:
        """Whether key block kj holds any key at or before query block qi's last query
        (always, with explicit key indices: a ring buffer's slots are not in key order)."""
        if self.explicit_index:
            return jnp.asarray(True)
        return kj * self.size_k <= self.q_start(offset, qi) + self.size_q - 1

    def prepare(self, params: Sequence[Pytree], qf: dict) -> list[Pytree]:
        return [
            None if t.prepare is None else t.prepare(p, qf["q"], x)
            for t, p, x in zip(self.terms, params, qf["x"], strict=True)
        ]

    def allowed(self, offset: jax.Array, qi: jax.Array, qn: dict, kj: jax.Array, kn: dict):
        return segments.pair_allowed_BQK(
            qn["seg"],
            kn["seg"],
            self.q_start(offset, qi),
            kj * self.size_k,
            self.normalizer.include_self,
            window=self.window,
            sink_tokens=self.sink_tokens,
            k_index_BK=kn.get("idx"),
            k_rank_BK=kn.get("rank"),
        )

    def scores(
        self,
        params: Sequence[Pytree],
        prepared: Sequence[Pytree],
        carries: Sequence[Pytree],
        *,
        qf: dict,
        qn: dict,
        kf: dict,
        kn: dict,
        allowed_BQK: jax.Array,
        offset: jax.Array,
        qi: jax.Array,
        kj: jax.Array,
        mode: str = "auto",
    ) -> tuple[jax.Array, list[Pytree]]:
        """The pair's scores (content logits plus every term), float32, and the new carries.

        ``mode`` says how a term with ``settled`` (:class:`BlockTerm`) is computed: "auto"
        chooses by its carry (``lax.cond``: for walks that are not differentiated), "full"
        always calls its ``bias``, "settled" always takes its row constant (the caller has
        checked :meth:`settled`).
        """
        if mode not in SCORE_MODES:
            raise ValueError(f"engine: score mode must be one of {SCORE_MODES}, got {mode!r}")
        logits_BNQK = content_logits_BNQK(qf["q"], kf["k"])
        scores_BNQK = logits_BNQK
        new_carries = []
        for term, p, prep, old_carry, pair in zip(
            self.terms,
            params,
            prepared,
            carries,
            self._pairs(
                logits_BNQK,
                qf=qf,
                qn=qn,
                kf=kf,
                kn=kn,
                allowed_BQK=allowed_BQK,
                offset=offset,
                qi=qi,
                kj=kj,
            ),
            strict=True,
        ):
            bias_BNQK, carry = _term_bias(term, p, pair, prep, old_carry, mode=mode)
            scores_BNQK = scores_BNQK + jnp.where(
                allowed_BQK[:, None], bias_BNQK.astype(jnp.float32), 0.0
            )
            new_carries.append(carry)
        return scores_BNQK, new_carries

    def settled(
        self, params: Sequence[Pytree], prepared: Sequence[Pytree], carries: Sequence[Pytree]
    ) -> jax.Array | None:
        """Whether every term with a ``settled`` test is settled for the pair these carries
        enter (a boolean scalar), or None when no term has one."""
        flags = [
            term.settled(p, prep, carry)[0]
            for term, p, prep, carry in zip(self.terms, params, prepared, carries, strict=True)
            if term.settled is not None
        ]
        return jnp.all(jnp.stack(flags)) if flags else None

    def advance(
        self,
        params: Sequence[Pytree],
        prepared: Sequence[Pytree],
        carries: Sequence[Pytree],
        **pair: jax.Array | dict,
    ) -> list[Pytree]:
        """The carries after the pair, as :meth:`scores` returns them, computing a term's bias
        only where it has no ``advance`` of its own. A term's ``advance`` gets no content
        logits (``logits_BNQK`` None): it computes what it needs, where it needs it. ``pair``:
        :meth:`scores`'s keywords (qf, qn, kf, kn, allowed_BQK, offset, qi, kj)."""
        fallback = any(t.init is not None and t.advance is None for t in self.terms)
        logits_BNQK = content_logits_BNQK(pair["qf"]["q"], pair["kf"]["k"]) if fallback else None
        steps = [t.advance or (lambda *a, t=t: t.bias(*a)[1]) for t in self.terms]
        return self._carried(steps, params, prepared, carries, logits_BNQK=logits_BNQK, pair=pair)

    def retreat(
        self,
        params: Sequence[Pytree],
        prepared: Sequence[Pytree],
        carries: Sequence[Pytree],
        **pair: jax.Array | dict,
    ) -> list[Pytree]:
        """The carries entering a pair that is not settled from those leaving it (every
        carried term's ``retreat``; see :attr:`replays_oldest_first`); ``pair`` as in
        :meth:`advance`."""
        steps = [t.retreat for t in self.terms]
        return self._carried(steps, params, prepared, carries, logits_BNQK=None, pair=pair)

    def _carried(
        self,
        steps: Sequence[Callable | None],
        params: Sequence[Pytree],
        prepared: Sequence[Pytree],
        carries: Sequence[Pytree],
        *,
        logits_BNQK: jax.Array | None,
        pair: dict,
    ) -> list[Pytree]:
        """Each carried term's ``step(params, pair, prepared, carry)``; None for the others."""
        pairs = self._pairs(logits_BNQK, **pair)
        return [
            None if term.init is None else step(p, one_pair, prep, carry)
            for term, step, p, prep, carry, one_pair in zip(
                self.terms, steps, params, prepared, carries, pairs, strict=True
            )
        ]

    def _pairs(
        self,
        logits_BNQK: jax.Array | None,
        *,
        qf: dict,
        qn: dict,
        kf: dict,
        kn: dict,
        allowed_BQK: jax.Array,
        offset: jax.Array,
        qi: jax.Array,
        kj: jax.Array,
    ) -> list[PairBlock]:
        """What each term reads of the pair."""
        return [
            PairBlock(
                q_BQNH=qf["q"],
                k_BKNH=kf["k"],
                q_positions_BQ=qn["pos"],
                k_positions_BK=kn["pos"],
                allowed_BQK=allowed_BQK,
                logits_BNQK=logits_BNQK,
                q_arrays=qx,
                k_arrays=kx,
                q_start=self.q_start(offset, qi),
                k_start=kj * self.size_k,
            )
            for qx, kx in zip(qf["x"], kf["x"], strict=True)
        ]
