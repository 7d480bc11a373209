"""The schemes in the JAX module systems users write models in: a Linen attention layer with
:class:`copejax.linen.PositionAttention` inside, a Flax NNX model (through
``nnx.bridge.ToNNX``, no global switch) and an Equinox model (through ``copejax.functional``),
each training a step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from copejax import functional
from copejax.linen import PositionAttention

B, T, D, N, H = 2, 6, 16, 2, 8


class LinenAttention(nn.Module):
    """A user's own attention layer with CoPE dropped in."""

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        q, k, v = (nn.DenseGeneral((N, H), name=name)(x_BTD) for name in ("q", "k", "v"))
        cope = PositionAttention("cope", N, H, options={"p_max": 8}, name="cope")
        y_BTNH = cope(q, k, v)
        return nn.DenseGeneral(D, axis=(-2, -1), name="o")(y_BTNH)


def test_linen_module_has_public_parameter_names_and_is_the_functional_call() -> None:
    x_BTD = jax.random.normal(jax.random.key(0), (B, T, D))
    model = LinenAttention()
    params = model.init(jax.random.key(1), x_BTD)["params"]
    assert set(params) == {"q", "k", "v", "o", "cope"}
    assert set(params["cope"]) == {"cope"} and set(params["cope"]["cope"]) == {"pos_emb"}
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(params))
    y = model.apply({"params": params}, x_BTD)
    q, k, v = (nn.DenseGeneral((N, H)).apply({"params": params[n]}, x_BTD) for n in ("q", "k", "v"))
    y_BTNH = functional.attention(q, k, v, scheme="cope", params=params["cope"], p_max=8)
    want = nn.DenseGeneral(D, axis=(-2, -1)).apply({"params": params["o"]}, y_BTNH)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)


class NNXAttention(nnx.Module):
    """An NNX layer with FoX's forget gates, bridged from Linen."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.qkv = nnx.Linear(D, 3 * N * H, rngs=rngs)
        self.out = nnx.Linear(N * H, D, rngs=rngs)
        self.fox = nnx.bridge.ToNNX(
            PositionAttention("fox", num_heads=N, head_dim=H, d_model=D), rngs=rngs
        )
        x_BTD = jnp.zeros((1, T, D))
        nnx.bridge.lazy_init(self.fox, *self._qkv(x_BTD), x=x_BTD)

    def _qkv(self, x_BTD: jax.Array) -> list[jax.Array]:
        return jnp.split(self.qkv(x_BTD).reshape(*x_BTD.shape[:2], 3 * N, H), 3, axis=2)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        y_BTNH = self.fox(*self._qkv(x_BTD), x=x_BTD)
        return self.out(y_BTNH.reshape(*x_BTD.shape[:2], N * H))


def test_nnx_model_trains_a_step() -> None:
    model = NNXAttention(nnx.Rngs(0))
    gates = nnx.state(model, nnx.Param)["fox"]["fox"]
    assert set(gates) == {"forget_w", "forget_b"}
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x_BTD = jax.random.normal(jax.random.key(1), (B, T, D))
    before = np.asarray(nnx.state(model, nnx.Param)["fox"]["fox"]["forget_w"].value)

    @nnx.jit
    def step(model: NNXAttention, optimizer: nnx.Optimizer) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x_BTD) - x_BTD) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(3)]
    assert losses[2] < losses[0]
    after = np.asarray(nnx.state(model, nnx.Param)["fox"]["fox"]["forget_w"].value)
    assert np.abs(after - before).max() > 0  # the scheme's own parameters train


def test_equinox_model_trains_a_step() -> None:
    eqx = pytest.importorskip("equinox")

    class EqxAttention(eqx.Module):
        """An Equinox layer with ALiBi and CoPE (cope+alibi) through copejax.functional."""

        wq: jax.Array
        wo: jax.Array
        position: dict

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3 = jax.random.split(key, 3)
            self.wq = jax.random.normal(k1, (D, 3, N, H)) / D**0.5
            self.wo = jax.random.normal(k2, (N, H, D)) / (N * H) ** 0.5
            self.position = functional.init("cope+alibi", k3, num_heads=N, head_dim=H, p_max=8)

        def __call__(self, x_BTD: jax.Array) -> jax.Array:
            q, k, v = jnp.einsum("BTD,DCNH->CBTNH", x_BTD, self.wq)
            y_BTNH = functional.attention(
                q, k, v, scheme="cope+alibi", params=self.position, p_max=8, impl="blockwise"
            )
            return jnp.einsum("BTNH,NHD->BTD", y_BTNH, self.wo)

    model = EqxAttention(jax.random.key(0))
    x_BTD = jax.random.normal(jax.random.key(1), (B, T, D))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model: EqxAttention, state: optax.OptState) -> tuple:
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((m(x_BTD) - x_BTD) ** 2))(model)
        updates, state = optimizer.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(3):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[2] < losses[0]
