"""Several schemes applied together, e.g. ``cope+rope`` and ``cope+relative`` (CoPE Table 5)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from copejax.ops.engine_blocks import Normalizer
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Carry,
    Dims,
    EmbedOutput,
    EmbedSite,
    PositionScheme,
    check_block_terms,
)


@dataclasses.dataclass(frozen=True)
class Composite(PositionScheme):
    """Applies its parts in order: embeds chained, qk transforms chained, biases summed.

    At most one part may use the normalizer site and at most one the carry site.
    Built by ``registry.make_scheme("a+b")``; not registered under a name of its own.
    """

    parts: tuple[PositionScheme, ...] = ()
    paper: ClassVar[str] = "combination"

    @property
    def name(self) -> str:  # type: ignore[override]
        return "+".join(p.name for p in self.parts)

    @property
    def sites(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys(s for p in self.parts for s in p.sites))

    @property
    def share_across_layers(self) -> bool:  # type: ignore[override]
        return any(p.share_across_layers for p in self.parts)

    @property
    def walk_carry(self) -> bool:  # type: ignore[override]
        return any(p.walk_carry for p in self.parts)

    @property
    def cache_in_key_order(self) -> bool:  # type: ignore[override]
        return any(p.cache_in_key_order for p in self.parts)

    @property
    def grouped_kv(self) -> bool:  # type: ignore[override]
        return all(p.grouped_kv for p in self.parts)

    @property
    def window_sinks(self) -> bool:  # type: ignore[override]
        return all(p.window_sinks for p in self.parts)

    @property
    def max_engine_block(self) -> int | None:  # type: ignore[override]
        caps = [p.max_engine_block for p in self.parts if p.max_engine_block is not None]
        return min(caps) if caps else None

    @property
    def auto_blockwise_from(self) -> int | None:  # type: ignore[override]
        starts = [p.auto_blockwise_from for p in self.parts if p.auto_blockwise_from is not None]
        return max(starts) if starts else None

    @property
    def position_only_bias(self) -> bool:  # type: ignore[override]
        return all(p.position_only_bias for p in self.parts if "bias" in p.sites)

    def ring_decode_refusal(self, dims: Dims, window: int) -> str | None:
        reasons = [p.ring_decode_refusal(dims, window) for p in self.parts]
        return next((r for r in reasons if r is not None), None)

    def validate(self, dims: Dims) -> None:
        names = [p.name for p in self.parts]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{self.name}: {repeated} appear more than once; each part's modules are named "
                "after its scheme, so a scheme may join a combination once"
            )
        for site in ("normalizer", "carry"):
            users = [p.name for p in self.parts if site in p.sites]
            if len(users) > 1:
                raise ValueError(f"{self.name}: at most one part may use the {site} site: {users}")
        widths = [p for p in self.parts if p.token_dim(dims.d_model) != dims.d_model]
        if widths:
            raise ValueError(f"{self.name}: concatenative embeddings cannot be combined")
        for part in self.parts:
            part.validate(dims)

    def check_decode(self, dims: Dims, cache_length: int) -> None:
        for part in self.parts:
            part.check_decode(dims, cache_length)

    def embed_module(self, dims: Dims) -> EmbedSite | None:
        if not any(p.embed_module is not PositionScheme.embed_module for p in self.parts):
            return None
        return _CompositeEmbed(dims=dims, parts=self.parts, name=self.name)

    def attention_module(self, dims: Dims) -> AttentionSite | None:
        return _CompositeAttention(dims=dims, parts=self.parts, name=self.name)

    def shared_attention_module(self, dims: Dims) -> tuple[Any, ...] | None:
        """One entry per part: the part's shared module, or None for a per-layer part."""
        shared = tuple(p.shared_attention_module(dims) for p in self.parts)
        return None if all(s is None for s in shared) else shared

    def layer_attention_module(self, dims: Dims, shared: Any) -> AttentionSite | None:
        if shared is None:
            shared = (None,) * len(self.parts)
        return _CompositeAttention(dims=dims, parts=self.parts, shared=shared, name=self.name)


class _CompositeEmbed(EmbedSite):
    parts: tuple[PositionScheme, ...] = ()

    def setup(self) -> None:
        self.embeds = [m for p in self.parts if (m := p.embed_module(self.dims)) is not None]

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool = True
    ) -> EmbedOutput:
        out = EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)
        for embed in self.embeds:
            new = embed(out.x_BTD, out.positions_BT, deterministic)
            out = new if new.carry is not None else new.replace(carry=out.carry)
        return out


class _CompositeAttention(AttentionSite):
    parts: tuple[PositionScheme, ...] = ()
    shared: tuple[Any, ...] = ()

    def setup(self) -> None:
        shared = self.shared or (None,) * len(self.parts)
        pairs = []
        for part, part_shared in zip(self.parts, shared, strict=True):
            own = part.layer_attention_module(self.dims, part_shared)
            pairs.append((part, own if own is not None else part_shared))
        pairs = [(p, m) for p, m in pairs if m is not None]
        self.sites_ = [m for _, m in pairs]
        users = [i for i, (p, _) in enumerate(pairs) if "normalizer" in p.sites]
        self.normalizer_index = users[0] if users else None
        carriers = [i for i, (p, _) in enumerate(pairs) if "carry" in p.sites]
        self.carry_index = carriers[0] if carriers else None

    def cache_state(self, k_BTNH, v_BTNH, ctx: AttentionContext) -> dict[str, jax.Array]:
        state: dict[str, jax.Array] = {}
        for site in self.sites_:
            part_state = site.cache_state(k_BTNH, v_BTNH, ctx)
            clash = sorted(set(state) & set(part_state))
            if clash:
                names = "+".join(p.name for p in self.parts)
                raise ValueError(f"{names}: two parts cache the same arrays {clash}")
            state.update(part_state)
        return state

    def cache_update(self, cached: dict[str, jax.Array], ctx: AttentionContext) -> dict:
        """Every part's updates; one part rewriting an array another part rewrites is refused."""
        updates: dict[str, jax.Array] = {}
        for site in self.sites_:
            part_updates = site.cache_update(cached, ctx)
            clash = sorted(set(updates) & set(part_updates))
            if clash:
                names = "+".join(p.name for p in self.parts)
                raise ValueError(f"{names}: two parts rewrite the same cached arrays {clash}")
            updates.update(part_updates)
        return updates

    def qk(self, q_BTNH, k_BSNH, v_BSNH, ctx: AttentionContext):
        for site in self.sites_:
            q_BTNH, k_BSNH, v_BSNH = site.qk(q_BTNH, k_BSNH, v_BSNH, ctx)
        return q_BTNH, k_BSNH, v_BSNH

    def bias(self, q_BTNH, k_BSNH, v_BSNH, logits_BNTS, ctx: AttentionContext):
        total = None
        for site in self.sites_:
            b = site.bias(q_BTNH, k_BSNH, v_BSNH, logits_BNTS, ctx)
            if b is not None:
                total = b if total is None else total + b
        return total

    def block_terms(self, q_BTNH, k_BSNH, v_BSNH, ctx: AttentionContext) -> tuple:
        """Every part's block terms (summed by the engine, as the naive path sums biases)."""
        terms: tuple = ()
        for site in self.sites_:
            check_block_terms(site)
            terms += tuple(site.block_terms(q_BTNH, k_BSNH, v_BSNH, ctx))
        return terms

    def block_normalizer(self, ctx: AttentionContext) -> Normalizer | None:
        if self.normalizer_index is None:
            return None
        return self.sites_[self.normalizer_index].block_normalizer(ctx)

    def mixed_values(self, ctx: AttentionContext) -> jax.Array | None:
        if self.carry_index is None:
            return None
        return self.sites_[self.carry_index].mixed_values(ctx)

    def normalize(self, logits_BNTS: jax.Array, ctx: AttentionContext) -> jax.Array:
        if self.normalizer_index is None:
            return super().normalize(logits_BNTS, ctx)
        return self.sites_[self.normalizer_index].normalize(logits_BNTS, ctx)

    def output(self, y_BTNH: jax.Array, ctx: AttentionContext) -> jax.Array:
        for site in self.sites_:
            y_BTNH = site.output(y_BTNH, ctx)
        return y_BTNH

    def carry_after_attention(
        self, carry: Carry, mixed_BTNC: jax.Array | None, ctx: AttentionContext
    ) -> Carry:
        for index, site in enumerate(self.sites_):
            mixed = mixed_BTNC if index == self.carry_index else None
            carry = site.carry_after_attention(carry, mixed, ctx)
        return carry

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        for site in self.sites_:
            carry = site.carry_after_mlp(carry, attn_out_BTD, x_BTD)
        return carry
