"""``copejax.functional`` equals the project's own attention layer, for every registered scheme.

For each scheme of the registry (defaults, and a few variants), the model's
:class:`~copejax.model.attention.Attention` layer is run on a packed batch; the same projected
q, k, v and the same site parameters through ``functional.attention`` (then the layer's output
projection) give the same outputs and the same gradients with respect to the layer input and
every site parameter, on the naive and blockwise paths. ``functional.decode`` (a prefill, then
single steps) equals one full ``functional.attention`` call. A scheme added to the registry
gets these tests automatically.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax import functional
from copejax.linen import layer_config, reads_layer_input
from copejax.model.attention import Attention
from copejax.model.config import ModelConfig
from copejax.positions import registry
from copejax.positions.base import AttentionContext
from tests.conftest import PACKED_POSITIONS_BT, PACKED_SEGMENTS_BT, perturbed

HEADS, HEAD_DIM, D, TRAIN_LEN = 2, 8, 16, 16
PROJECTIONS = ("query", "key", "value", "out")
# The default suite runs these on the naive path, and CoPE and FoX on the blockwise one too
# (about 3 s each on 2 cores); every registered scheme on both paths runs with the slow tests
# (78 cases, about 13 minutes on 2 loaded cores with -n 2).
FAST = {("cope", None), ("fox", None), ("t5", None), ("tape", None)}
FAST |= {("cope+rope", 1)}
FAST_BLOCKWISE = {("cope", None), ("fox", None)}
ALL = [(name, {}, None) for name in registry.names()] + [
    ("cope+rope", {}, 1),
    ("fox", {"key_shift": True, "value_shift": True, "output_gate": True}, None),
    ("cope", {"gates": "sep_keys"}, 1),
    ("rope", {}, 1),
    ("alibi", {}, 1),
]


def _marked(fast: set, impls: tuple[str, ...] | None = None) -> list:
    """The variants (with each impl), the ones outside ``fast`` marked slow."""
    out = []
    for impl in impls or (None,):
        for v in ALL:
            case = v if impl is None else (v, impl)
            in_fast = (v[0], v[2]) in fast and not v[1]
            out.append(
                case
                if in_fast
                else pytest.param(*(case if impl else (case,)), marks=pytest.mark.slow)
            )
    return out


EQUALITY_CASES = [
    *[c for c in _marked(FAST, ("naive",))],
    *[c for c in _marked(FAST_BLOCKWISE, ("blockwise",))],
]
VARIANTS = _marked(FAST)


def _ids(variant: tuple[str, dict, int | None]) -> str:
    name, options, kv = variant
    return name + "".join(f",{k}={v}" for k, v in options.items()) + (f",K={kv}" if kv else "")


def _case_ids(value: object) -> str:
    return _ids(value) if isinstance(value, tuple) else str(value)


class Reference(nn.Module):
    """The model's attention layer and, for shared schemes, the module the model shares."""

    cfg: ModelConfig

    def setup(self) -> None:
        self.shared = self.cfg.scheme.shared_attention_module(self.cfg.dims)
        self.attention = Attention(self.cfg, shared=self.shared)

    def __call__(self, x_BTD: jax.Array, ctx: AttentionContext) -> jax.Array:
        return self.attention(x_BTD, ctx)

    def project(self, x_BTD: jax.Array) -> tuple[jax.Array, ...]:
        layer = self.attention
        return layer.query(x_BTD), layer.key(x_BTD), layer.value(x_BTD)

    def output(self, y_BTNH: jax.Array) -> jax.Array:
        return self.attention.out(y_BTNH)


def site_params(reference: dict) -> dict:
    """The reference's parameters other than the projections: what functional.init makes."""
    own = {k: v for k, v in reference["attention"].items() if k not in PROJECTIONS}
    return {**{k: v for k, v in reference.items() if k != "attention"}, **own}


def _setup(name: str, options: dict, kv: int | None, impl: str) -> tuple:
    cfg = layer_config(
        name,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        d_model=D,
        num_kv_heads=kv,
        train_len=TRAIN_LEN,
        impl=impl,
        options=options,
    )
    x_BTD = jax.random.normal(jax.random.key(3), (2, 8, D))
    positions_BT = jnp.asarray(PACKED_POSITIONS_BT)
    ctx = AttentionContext.create(x_BTD, positions_BT, jnp.asarray(PACKED_SEGMENTS_BT))
    reference = Reference(cfg)
    carry = None
    if "carry" in cfg.scheme.sites:
        carry = functional.embed(
            x_BTD,
            scheme=name,
            params={},
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            positions=positions_BT,
            train_len=TRAIN_LEN,
            **options,
        ).carry
        ctx = ctx.replace(carry=carry)
    params = perturbed(nn.unbox(reference.init(jax.random.key(0), x_BTD, ctx)["params"]))
    return cfg, reference, params, x_BTD, ctx, carry


def _functional_output(  # noqa: PLR0917 - the pieces _setup returns
    name: str,
    options: dict,
    impl: str,
    reference: Reference,
    params: dict,
    x_BTD: jax.Array,
    ctx: AttentionContext,
    carry: Any,
) -> Any:
    def run(site: dict, x_BTD: jax.Array) -> jax.Array:
        q, k, v = reference.apply({"params": params}, x_BTD, method=Reference.project)
        y_BTNH = functional.attention(
            q,
            k,
            v,
            scheme=name,
            params=site,
            positions=ctx.q_positions_BT,
            segment_ids=ctx.q_segment_ids_BT,
            x=x_BTD,
            impl=impl,
            train_len=TRAIN_LEN,
            carry=carry,
            **options,
        )
        return reference.apply({"params": params}, y_BTNH, method=Reference.output)

    return run


@pytest.mark.parametrize(("variant", "impl"), EQUALITY_CASES, ids=_case_ids)
def test_attention_equals_the_model_layer(variant: tuple, impl: str) -> None:
    name, options, kv = variant
    _, reference, params, x_BTD, ctx, carry = _setup(name, options, kv, impl)
    run = _functional_output(name, options, impl, reference, params, x_BTD, ctx, carry)

    @jax.jit
    def reference_loss(p: dict, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        y_BTD, _ = reference.apply({"params": p}, x_BTD, ctx.replace(x_BTD=x_BTD))
        return jnp.sum(jnp.sin(y_BTD)), y_BTD

    @jax.jit
    def functional_loss(site: dict, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        y_BTD = run(site, x_BTD)
        return jnp.sum(jnp.sin(y_BTD)), y_BTD

    grad = jax.value_and_grad(reference_loss, argnums=(0, 1), has_aux=True)
    (_, want_y), (want_p, want_x) = grad(params, x_BTD)
    grad = jax.value_and_grad(functional_loss, argnums=(0, 1), has_aux=True)
    (_, got_y), (got_p, got_x) = grad(site_params(params), x_BTD)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), rtol=1e-4, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5),
        got_p,
        site_params(want_p),
    )


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_prefill_and_steps_equal_one_call(variant: tuple) -> None:
    name, options, kv = variant
    kv_heads = kv or HEADS
    key = jax.random.key(5)
    q = jax.random.normal(key, (2, 8, HEADS, HEAD_DIM))
    k, v = jax.random.normal(jax.random.key(6), (2, 2, 8, kv_heads, HEAD_DIM))
    x_BTD = jax.random.normal(jax.random.key(7), (2, 8, D))
    sizes = dict(num_heads=HEADS, head_dim=HEAD_DIM, d_model=D, train_len=TRAIN_LEN)
    params = perturbed(
        functional.init(name, jax.random.key(0), num_kv_heads=kv, **sizes, **options)
    )
    positions_BT, segments_BT = PACKED_POSITIONS_BT, PACKED_SEGMENTS_BT
    common = dict(scheme=name, params=params, train_len=TRAIN_LEN, impl="naive", **options)

    def carry_of(start: int, end: int) -> Any:
        return functional.embed(
            x_BTD[:, start:end],
            scheme=name,
            params=params,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            positions=positions_BT[:, start:end],
            train_len=TRAIN_LEN,
            **options,
        ).carry

    want = functional.attention(
        q,
        k,
        v,
        positions=positions_BT,
        segment_ids=segments_BT,
        x=x_BTD,
        carry=carry_of(0, 8),
        **common,
    )
    cache = functional.init_cache(
        name,
        params,
        batch=2,
        max_len=8,
        num_kv_heads=kv_heads,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        d_model=D,
        train_len=TRAIN_LEN,
        **options,
    )
    outputs, start = [], 0
    for size in (5, 1, 1, 1):
        end = start + size
        y, cache = functional.decode(
            q[:, start:end],
            k[:, start:end],
            v[:, start:end],
            cache,
            positions=positions_BT[:, start:end],
            segment_ids=segments_BT[:, start:end],
            x=x_BTD[:, start:end],
            carry=carry_of(start, end),
            **common,
        )
        outputs.append(np.asarray(y))
        start = end
    np.testing.assert_allclose(np.concatenate(outputs, 1), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_init_returns_plain_arrays_and_empty_for_parameter_free_schemes() -> None:
    params = functional.init("cope", jax.random.key(0), num_heads=2, head_dim=8)
    leaves = jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, nn.Partitioned))
    assert leaves and all(isinstance(a, jax.Array) for a in leaves)
    for name in ("alibi", "rope", "nope"):
        assert functional.init(name, jax.random.key(0), num_heads=2, head_dim=8) == {}


def test_defaults_positions_of_shape_T_and_no_segment_ids() -> None:
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 6, 4, 8))
    params = functional.init("cope", jax.random.key(1), num_heads=4, head_dim=8, p_max=4)
    want = functional.attention(
        q,
        k,
        v,
        scheme="cope",
        p_max=4,
        params=params,
        positions=jnp.tile(jnp.arange(6), (2, 1)),
        segment_ids=jnp.zeros((2, 6), jnp.int32),
    )
    for positions in (None, jnp.arange(6)):
        got = functional.attention(
            q, k, v, scheme="cope", params=params, positions=positions, p_max=4
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_errors_name_what_is_missing() -> None:
    q = k = v = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="known schemes: alibi, cope"):
        functional.init("copy", jax.random.key(0), num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="d_model"):
        functional.init("fox", jax.random.key(0), num_heads=2, head_dim=8)
    params = functional.init("fox", jax.random.key(0), num_heads=2, head_dim=8, d_model=D)
    with pytest.raises(ValueError, match="x=x_BTD"):
        functional.attention(q, k, v, scheme="fox", params=params)
    with pytest.raises(ValueError, match="table_size"):
        functional.init("learned", jax.random.key(0), num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="impl must be one of"):
        functional.attention(q, k, v, scheme="alibi", params={}, impl="flash")
    assert reads_layer_input("cope+fox") and not reads_layer_input("cope")


@pytest.mark.slow  # about 20 s; ring decoding: tests/test_ring_decode.py
def test_window_decodes_from_a_ring_past_max_len() -> None:
    """A window layer's cache is a ring of its window: seven tokens through four slots."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 7, 2, 8))
    params = functional.init("cope", jax.random.key(1), num_heads=2, head_dim=8, p_max=4)
    common = dict(scheme="cope", params=params, window=3, p_max=4)
    want = functional.attention(q, k, v, impl="naive", **common)
    cache = functional.init_cache(
        "cope", params, batch=1, max_len=4, num_kv_heads=2, head_dim=8, window=3, p_max=4
    )
    outputs = []
    for start, end in [(0, 5), (5, 6), (6, 7)]:
        y, cache = functional.decode(
            q[:, start:end],
            k[:, start:end],
            v[:, start:end],
            cache,
            positions=jnp.arange(start, end),
            **common,
        )
        outputs.append(np.asarray(y))
    assert cache["ring_cache"]["key"].shape[1] == 3
    np.testing.assert_allclose(np.concatenate(outputs, 1), np.asarray(want), rtol=1e-5, atol=1e-5)
