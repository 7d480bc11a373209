"""The blockwise engine equals the naive path, for every registered scheme and its variants.

For each scheme of the registry (and the variants below), a model with packed documents is run
with ``model.attention_impl = "naive"`` and ``"blockwise"`` (blocks of 3 over a length of 8, so
that blocks straddle segment boundaries and the last block is padded), and the logits and the
gradients of every parameter agree. Decoding (prefill, then single steps) through the engine
equals the full forward pass. A scheme added to the registry gets these tests automatically.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from tests.conftest import (
    PACKED_POSITIONS_BT,
    PACKED_SEGMENTS_BT,
    decode_in_chunks,
    perturbed,
    tiny_config,
)
from tests.test_decode import LAYOUTS, layout_params
from tests.test_decode import SLOW_VARIANTS as SLOW_DECODE_VARIANTS
from tests.test_decode import VARIANTS as DECODE_VARIANTS

LENGTH = 8
BLOCK = 3
SEGMENTS_BT, POSITIONS_BT = PACKED_SEGMENTS_BT, PACKED_POSITIONS_BT

# Every registered scheme with its defaults runs in the default suite; the decode test's
# variants and a few that exercise other engine code are marked slow (about 5 s each on 2
# cores), except two composites.
EXTRA_VARIANTS = [
    *DECODE_VARIANTS,
    *SLOW_DECODE_VARIANTS,
    ("cope", {"force_unit_gates": True}),
    ("stickbreaking+alibi", {}),
    ("t5", {"bidirectional": True}),
    ("relative_capped", {"max_distance": 3}),
    ("alibi+rope", {}),
    ("rope", {"scaling": "dynamic", "factor": 2.0, "original_max_len": 4}),  # per-call N = 8
]
FAST_EXTRAS = {"cope+rope", "stickbreaking+alibi"}
VARIANTS = [(name, {}) for name in registry.names()] + EXTRA_VARIANTS
# PaTH (about 13 s): its blockwise layer is checked against the reference in test_path.py.
PARAMS = [
    (name, {}) if name != "path" else pytest.param((name, {}), marks=pytest.mark.slow)
    for name in registry.names()
] + [
    v if v[0] in FAST_EXTRAS and not v[1] else pytest.param(v, marks=pytest.mark.slow)
    for v in EXTRA_VARIANTS
]


def _ids(variant: tuple[str, dict]) -> str:
    name, options = variant
    return name + "".join(f",{k}={v}" for k, v in options.items())


def _model(position: str, options: dict, impl: str, **overrides: object) -> Transformer:
    scheme = registry.make_scheme(position, options)
    layers = 2 if "carry" in scheme.sites or scheme.share_across_layers else 1
    # The flash backward wherever it applies (as auto does).
    backward = "remat" if scheme.walk_carry else "flash"
    cfg = tiny_config(
        position,
        position_options=options,
        num_layers=layers,
        attention_impl=impl,
        attention_block=BLOCK,
        **{"attention_backward": backward, **overrides},
    )
    return Transformer(cfg)


def _perturbed_params(model: Transformer, tokens_BT: jax.Array) -> object:
    """Parameters with every leaf perturbed, so that zero-initialised terms are live."""
    return perturbed(model.init(jax.random.key(0), tokens_BT, jnp.asarray(POSITIONS_BT))["params"])


def _tokens() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)


@pytest.mark.parametrize("variant", PARAMS, ids=_ids)
def test_blockwise_values_and_gradients_equal_naive(variant: tuple[str, dict]) -> None:
    position, options = variant
    _check_blockwise_equals_naive(position, options)


def _check_blockwise_equals_naive(position: str, options: dict, **overrides: object) -> None:
    tokens_BT = _tokens()
    naive = _model(position, options, "naive", **overrides)
    blockwise = _model(position, options, "blockwise", **overrides)
    params = _perturbed_params(naive, tokens_BT)
    targets_BT = jnp.roll(tokens_BT, -1, axis=1)

    def loss(model: Transformer, p: object) -> tuple[jax.Array, jax.Array]:
        logits_BTV = model.apply(
            {"params": p}, tokens_BT, jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
        )
        logp_BTV = jax.nn.log_softmax(logits_BTV)
        nll = -jnp.mean(jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1))
        return nll, logits_BTV

    # Jitted: one program per model costs less than dispatching the walk's ops eagerly.
    (nll_n, logits_n), grads_n = jax.jit(
        jax.value_and_grad(lambda p: loss(naive, p), has_aux=True)
    )(params)
    (nll_b, logits_b), grads_b = jax.jit(
        jax.value_and_grad(lambda p: loss(blockwise, p), has_aux=True)
    )(params)
    assert np.all(np.isfinite(np.asarray(logits_n)))
    np.testing.assert_allclose(logits_b, logits_n, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(nll_b, nll_n, rtol=1e-6)
    flat_n = jax.tree_util.tree_leaves_with_path(grads_n)
    flat_b = dict(jax.tree_util.tree_leaves_with_path(grads_b))
    for path, grad_n in flat_n:
        np.testing.assert_allclose(
            flat_b[path], grad_n, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize(
    "variant",
    [
        v if not v[1] else pytest.param(v, marks=pytest.mark.slow)
        for v in VARIANTS
        if v[0] in ("nope", "alibi", "cope", "fox", "stickbreaking")
    ],
    ids=_ids,
)
def test_decoding_through_the_engine_equals_the_full_forward(variant: tuple[str, dict]) -> None:
    """Prefill of 5 tokens (two blocks) then single steps, every call on the engine."""
    position, options = variant
    _check_engine_decoding(position, options)


@pytest.mark.parametrize(
    "layout",
    [
        name if name == "window_gqa" else pytest.param(name, marks=pytest.mark.slow)
        for name in LAYOUTS
    ],
)
@pytest.mark.parametrize("position", ["fox", pytest.param("cope", marks=pytest.mark.slow)])
def test_attention_layouts_decode_through_the_engine(position: str, layout: str) -> None:
    _check_engine_decoding(position, {}, **LAYOUTS[layout])


def _check_engine_decoding(position: str, options: dict, **overrides: object) -> None:
    tokens_BT = _tokens()
    model = _model(position, options, "blockwise", **overrides)
    params = _perturbed_params(model, tokens_BT)
    full = model.apply(
        {"params": params}, tokens_BT, jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    )
    decoded = decode_in_chunks(
        model, params, tokens_BT, POSITIONS_BT, SEGMENTS_BT, chunks=(5, 1, 1, 1)
    )
    np.testing.assert_allclose(decoded, full, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("position", "layout"), layout_params(fast=("fox",), fast_layouts=("window_gqa",))
)
def test_attention_layouts_blockwise_values_and_gradients_equal_naive(
    position: str, layout: str
) -> None:
    """Grouped KV heads, the sink (its gradient included) and length scaling on the engine."""
    _check_blockwise_equals_naive(position, {}, **LAYOUTS[layout])


CARRY_VARIANTS = [
    *((name, {}) for name in registry.names() if registry.make_scheme(name).walk_carry),
    ("cope+rope", {}),
    ("path+fox", {}),
    ("stickbreaking+alibi", {}),
    ("stickbreaking", {"include_self": False}),
]


@pytest.mark.parametrize(
    "variant",
    [
        v if v in (("cope", {}), ("stickbreaking", {})) else pytest.param(v, marks=pytest.mark.slow)
        for v in CARRY_VARIANTS
    ],
    ids=_ids,
)
def test_the_flash_backward_of_a_walk_carry_equals_naive(variant: tuple[str, dict]) -> None:
    """The flash backward with a carried term (the carries' pass, then the pairs oldest first
    with the carry's cotangent) and stick-breaking's (copejax.ops.stick_flash) give the naive
    gradients."""
    position, options = variant
    _check_blockwise_equals_naive(position, options, attention_backward="flash")


def test_the_flash_and_remat_backwards_agree() -> None:
    """Both backward passes of the engine give the naive gradients (rope + alibi + FoX)."""
    tokens_BT = _tokens()
    grads = {}
    for backward in ("flash", "remat"):
        model = _model("fox+alibi", {}, "blockwise", attention_backward=backward)
        params = _perturbed_params(model, tokens_BT)

        def loss(p: object, model: Transformer = model) -> jax.Array:
            logits = model.apply(
                {"params": p}, tokens_BT, jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
            )
            return jnp.sum(jnp.sin(logits))

        grads[backward] = jax.grad(loss)(params)
    flash, remat = jax.tree.leaves(grads["flash"]), jax.tree.leaves(grads["remat"])
    for a, b in zip(flash, remat, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_every_registered_scheme_is_covered() -> None:
    assert {name for name, _ in VARIANTS} >= set(registry.names())
    assert dataclasses.is_dataclass(registry.make_scheme("cope"))
