"""Issue 45's memory target, structurally: on ``attention_impl="kernel"`` no (T, S)-sized
array exists anywhere in the traced forward and backward of a whole model, kernel bodies
included (they hold tiles and per-query or per-key rows), for every scheme the kernels cover.
The XLA temporaries at 16K against cuDNN's are measured on a GPU
(``experiments/bench_kernels_gpu.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from copejax.model.kernel_terms import kernel_refusal
from copejax.model.transformer import Transformer
from copejax.positions import registry
from tests.conftest import tiny_config
from tests.ops.test_engine import _avals

COVERED = [n for n in registry.names() if kernel_refusal(registry.make_scheme(n)) is None]


@pytest.mark.parametrize("position", COVERED)
def test_kernel_model_gradient_holds_no_length_squared_array(position: str) -> None:
    """Every array in the jaxpr of the loss gradient has at most one dimension >= T."""
    length = 256
    cfg = tiny_config(
        position, num_layers=1, max_len=length, attention_impl="kernel", attention_block=32
    )
    model = Transformer(cfg)
    tokens_BT = jnp.zeros((1, length), jnp.int32)
    positions_BT = jnp.arange(length)[None]
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens_BT, positions_BT))

    def loss(p: object) -> jax.Array:
        return jnp.sum(model.apply(p, tokens_BT, positions_BT))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    shapes = [tuple(getattr(a, "shape", ())) for a in _avals(jaxpr)]
    assert any("pallas_call" in str(e.primitive) for e in jaxpr.eqns) or _has_pallas(jaxpr), (
        f"{position}: no kernel in the traced gradient"
    )
    square = [s for s in shapes if sum(d >= length for d in s) >= 2]
    assert not square, f"{position}: (T, S)-sized arrays {sorted(set(square))[:5]}"


def _has_pallas(jaxpr: jax.extend.core.Jaxpr) -> bool:
    """Whether a pallas_call appears anywhere in the jaxpr, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr) and _has_pallas(sub.jaxpr):
                    return True
                if isinstance(sub, jax.extend.core.Jaxpr) and _has_pallas(sub):
                    return True
    return False
