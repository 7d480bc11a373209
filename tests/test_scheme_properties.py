"""Properties every registered scheme must have inside the model.

Parametrised over the registry, so a new scheme is covered the moment it registers:
causality by gradients, jit == eager, bfloat16 close to float32, shapes and dtypes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.positions import registry
from tests import sweeps
from tests.conftest import tiny_config, tokens_and_positions
from tests.test_decode import LAYOUTS, ROPE_VARIANTS, layout_params

SCHEMES = registry.names()


def _init(position: str, **overrides: object) -> tuple[Transformer, dict]:
    model = Transformer(tiny_config(position, **overrides))
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    return model, params


@pytest.mark.parametrize("position", SCHEMES)
def test_gradient_of_output_wrt_future_inputs_is_exactly_zero(position: str) -> None:
    _check_causal(position)


@pytest.mark.parametrize(
    ("position", "layout"),
    layout_params(fast=("cope", "fox", "stickbreaking"), fast_layouts=("mqa",)),
)
def test_attention_layouts_are_causal_and_jit_equals_eager(position: str, layout: str) -> None:
    """Grouped KV heads, the sink, length scaling and a window keep every scheme causal;
    jit equals eager, and bfloat16 stays close to float32."""
    _check_causal(position, **LAYOUTS[layout])
    model, params = _init(position, **LAYOUTS[layout])
    tokens_BT, positions_BT = tokens_and_positions()
    eager = model.apply(params, tokens_BT, positions_BT)
    jitted = jax.jit(model.apply)(params, tokens_BT, positions_BT)
    assert np.all(np.isfinite(np.asarray(eager)))
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-5)
    model16 = Transformer(tiny_config(position, dtype="bfloat16", **LAYOUTS[layout]))
    out16 = model16.apply(params, tokens_BT, positions_BT)
    np.testing.assert_allclose(np.asarray(out16), np.asarray(eager), atol=0.05, rtol=0.05)


def _check_causal(position: str, **overrides: object) -> None:
    model, params = _init(position, **overrides)
    # The batch of _init (rows are independent): its forward ops are compiled already.
    tokens_BT, positions_BT = tokens_and_positions()
    emb = model.apply(params, tokens_BT, positions_BT, True, method=Transformer.embed)
    length = tokens_BT.shape[1]

    def output_at(x_BTD: jax.Array, t: int) -> jax.Array:
        logits_BTV = model.apply(
            params, emb.replace(x_BTD=x_BTD), method=Transformer.forward_embedded
        )
        return logits_BTV[0, t].sum()

    # One compiled program for the three gradients (of output t, stacked on a leading axis).
    times = (0, 3, length - 2)
    grads_XBTD = jax.jit(jax.vmap(jax.grad(output_at), (None, 0)))(emb.x_BTD, jnp.array(times))
    for t, grad_BTD in zip(times, np.asarray(grads_XBTD), strict=True):
        assert np.all(grad_BTD[0, t + 1 :] == 0.0), f"{position}: leak into t={t}"
        assert np.any(grad_BTD[0, : t + 1] != 0.0), f"{position}: no signal at t={t}"


@pytest.mark.parametrize("position", SCHEMES)
def test_jit_equals_eager_and_shapes(position: str) -> None:
    model, params = _init(position)
    tokens_BT, positions_BT = tokens_and_positions()
    eager = model.apply(params, tokens_BT, positions_BT)
    jitted = jax.jit(model.apply)(params, tokens_BT, positions_BT)
    assert eager.shape == (2, 8, 13)
    assert eager.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(eager)))
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", SCHEMES)
def test_bfloat16_close_to_float32(position: str) -> None:
    model32, params = _init(position)
    model16 = Transformer(tiny_config(position, dtype="bfloat16"))
    tokens_BT, positions_BT = tokens_and_positions()
    out32 = np.asarray(model32.apply(params, tokens_BT, positions_BT))
    out16 = model16.apply(params, tokens_BT, positions_BT)
    assert out16.dtype == jnp.float32  # logits are float32 whatever the compute dtype
    np.testing.assert_allclose(np.asarray(out16), out32, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("position", sweeps.schemes(fast=(*sweeps.REPRESENTATIVE, "randomized")))
def test_training_mode_runs_with_dropout_and_position_rngs(position: str) -> None:
    model, params = _init(position, dropout=0.1)
    tokens_BT, positions_BT = tokens_and_positions()
    rngs = {"dropout": jax.random.key(1), "positions": jax.random.key(2)}

    def loss(p: dict) -> jax.Array:
        logits = model.apply(p, tokens_BT, positions_BT, deterministic=False, rngs=rngs)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)


@pytest.mark.parametrize("position", SCHEMES)
def test_scheme_is_documented(position: str) -> None:
    cls = registry.get(position)
    assert cls.paper, f"{position} must cite its paper"
    assert set(cls.sites) <= {"embed", "qk", "bias", "normalizer", "output", "carry"}
    assert cls.__doc__ and len(cls.__doc__) > 20


@pytest.mark.parametrize("position", SCHEMES)
def test_every_parameter_has_logical_axis_names(position: str) -> None:
    """Scheme parameters (tables, slopes, gates, MLPs) must be shardable by rules too."""
    model = Transformer(tiny_config(position))
    tokens_BT, positions_BT = tokens_and_positions()
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens_BT, positions_BT)
    specs = jax.tree_util.tree_leaves_with_path(
        nn.get_partition_spec(variables), is_leaf=lambda spec: spec is None
    )
    unnamed = [jax.tree_util.keystr(path) for path, spec in specs if spec is None]
    assert not unnamed, f"{position}: parameters without logical axis names: {unnamed}"


# Options that change a scheme's computation (scheme, options): the properties above for each.
# RoPE's per-call dynamic length (original_max_len 4 < 8 positions) is live here too.
OPTION_VARIANTS = [
    *ROPE_VARIANTS,
    ("rope", {"scaling": "dynamic", "factor": 2.0, "original_max_len": 4}),
]


@pytest.mark.parametrize(("position", "options"), OPTION_VARIANTS, ids=str)
def test_option_variants_are_causal_jittable_and_close_in_bfloat16(
    position: str, options: dict
) -> None:
    model, params = _init(position, position_options=options, num_layers=1)
    tokens_BT, positions_BT = tokens_and_positions()
    emb = model.apply(params, tokens_BT, positions_BT, True, method=Transformer.embed)

    def output_at(x_BTD: jax.Array, t: int) -> jax.Array:
        logits_BTV = model.apply(
            params, emb.replace(x_BTD=x_BTD), method=Transformer.forward_embedded
        )
        return logits_BTV[0, t].sum()

    grad_BTD = jax.grad(output_at)(emb.x_BTD, 3)
    assert np.all(np.asarray(grad_BTD[0, 4:]) == 0.0), f"{options}: leak into t=3"
    assert np.any(np.asarray(grad_BTD[0, :4]) != 0.0), f"{options}: no signal at t=3"
    eager = np.asarray(model.apply(params, tokens_BT, positions_BT))
    jitted = np.asarray(jax.jit(model.apply)(params, tokens_BT, positions_BT))
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-5)
    model16 = Transformer(
        tiny_config(position, position_options=options, num_layers=1, dtype="bfloat16")
    )
    out16 = np.asarray(model16.apply(params, tokens_BT, positions_BT))
    np.testing.assert_allclose(out16, eager, atol=0.05, rtol=0.05)
