"""The transformer itself: blocks, embeddings, packing, dtypes and configuration errors."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import checks
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from tests.conftest import tiny_config, tokens_and_positions


def _logits(cfg: ModelConfig, **kwargs: object) -> np.ndarray:
    model = Transformer(cfg)
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    return np.asarray(model.apply(params, tokens_BT, positions_BT, **kwargs))


@pytest.mark.parametrize("block", ["llama", "gpt2"])
@pytest.mark.parametrize("tie", [True, False])
def test_blocks_and_embedding_tying(block: str, tie: bool) -> None:
    cfg = tiny_config("rope", block=block, tie_embeddings=tie)
    model = Transformer(cfg)
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)["params"]
    assert ("lm_head" in params) == (not tie)
    mlp = params["block_0"]["mlp"]
    assert ("wi_gate" in mlp) == (block == "llama")
    has_bias = "bias" in params["block_0"]["attention"]["query"]
    assert has_bias == (block == "gpt2")
    assert ("bias" in params["block_0"]["attention_norm"]) == (block == "gpt2")  # LayerNorm
    assert np.all(np.isfinite(_logits(cfg)))


def test_params_are_float32_under_bfloat16_compute() -> None:
    cfg = tiny_config("rope", dtype="bfloat16")
    model = Transformer(cfg)
    tokens_BT, positions_BT = tokens_and_positions()
    variables = model.init(jax.random.key(0), tokens_BT, positions_BT)
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(variables)}
    assert dtypes == {jnp.dtype("float32")}


def test_params_carry_logical_axis_names() -> None:
    model = Transformer(tiny_config("rope"))
    tokens_BT, positions_BT = tokens_and_positions()
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens_BT, positions_BT)
    specs = jax.tree_util.tree_leaves(
        nn.get_partition_spec(variables), is_leaf=lambda spec: spec is None
    )
    assert len(specs) == len(jax.tree_util.tree_leaves(nn.unbox(variables)))
    assert all(spec is not None and len(spec) > 0 for spec in specs)


def test_packed_segments_do_not_attend_to_each_other() -> None:
    """Two documents packed into one row give the same logits as each document alone."""
    cfg = tiny_config("rope")
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(0, 13, 5), rng.integers(0, 13, 3)
    tokens_1T = jnp.asarray(np.concatenate([doc_a, doc_b])[None], jnp.int32)
    positions_1T = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2]], jnp.int32)
    segments_1T = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2]], jnp.int32)
    params = model.init(jax.random.key(0), tokens_1T, positions_1T)
    packed = model.apply(params, tokens_1T, positions_1T, segments_1T)
    alone_b = model.apply(params, jnp.asarray(doc_b[None], jnp.int32), positions_1T[:, 5:])
    alone_a = model.apply(params, jnp.asarray(doc_a[None], jnp.int32), positions_1T[:, :5])
    np.testing.assert_allclose(packed[0, 5:], alone_b[0], atol=1e-5)
    np.testing.assert_allclose(packed[0, :5], alone_a[0], atol=1e-5)


def test_positions_are_an_input_not_created_inside() -> None:
    """Shifting positions changes a nope-free scheme's output only through the scheme."""
    cfg = tiny_config("nope")
    model = Transformer(cfg)
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    a = model.apply(params, tokens_BT, positions_BT)
    b = model.apply(params, tokens_BT, positions_BT + 7)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="positions_BT shape"):
        model.apply(params, tokens_BT, positions_BT[:, :3])


@pytest.mark.parametrize("scale", [False, True])
def test_scale_embeddings_multiplies_tokens_by_sqrt_width_before_the_encoding(
    scale: bool,
) -> None:
    """Vaswani et al. 2017 §3.4: the embedding weights times sqrt(d_model), then + PE."""
    cfg = tiny_config("sinusoidal", scale_embeddings=scale)
    model = Transformer(cfg)
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    x_BTD = model.apply(params, tokens_BT, positions_BT, False, method=_embedded)
    table_VD = np.asarray(nn.unbox(params["params"]["token_embed"]["embedding"]))
    pos_T = np.arange(tokens_BT.shape[1])[:, None]
    rate_D = 1.0 / 10000 ** (2 * (np.arange(32) // 2) / 32)  # PE(pos, 2i) and (pos, 2i + 1)
    pe_TD = np.where(np.arange(32) % 2 == 0, np.sin(pos_T * rate_D), np.cos(pos_T * rate_D))
    factor = np.sqrt(32.0) if scale else 1.0
    want_BTD = factor * table_VD[np.asarray(tokens_BT)] + pe_TD
    np.testing.assert_allclose(np.asarray(x_BTD), want_BTD, rtol=1e-5, atol=1e-5)


def _embedded(model: Transformer, tokens_BT: jax.Array, positions_BT: jax.Array, det: bool):
    return model.embed(tokens_BT, positions_BT, det).x_BTD


def _truncated_std(bound: float = 2.0) -> float:
    """The std of a standard normal truncated to [-bound, bound]."""
    mass = math.erf(bound / math.sqrt(2.0))
    density = math.exp(-(bound**2) / 2) / math.sqrt(2 * math.pi)
    return math.sqrt(1.0 - 2.0 * bound * density / mass)


@pytest.mark.parametrize("dense_init", ["normal", "fan_in"])
def test_dense_init_scales_each_kernel_by_its_fan_in(dense_init: str) -> None:
    """ "fan_in" is haiku's Linear default (truncated normal, std 1 / sqrt(fan_in) before the
    truncation, so 0.8796 / sqrt(fan_in) after it); fan_in is what each kernel contracts: D
    for query and MLP input, N H (here 64, not D = 128) for the attention output, the MLP
    width for its output. "normal" keeps init_std, output projections / sqrt(2 L)."""
    cfg = tiny_config(
        "rope", d_model=128, num_heads=4, head_dim=16, mlp_dim=512, tie_embeddings=False,
        dense_init=dense_init,
    )  # fmt: skip
    tokens_BT, positions_BT = tokens_and_positions()
    variables = Transformer(cfg).init(jax.random.key(0), tokens_BT, positions_BT)
    params = nn.meta.unbox(variables)["params"]
    block = params["block_0"]
    kernels = {  # name: (kernel, fan_in, std of "normal")
        "query": (block["attention"]["query"]["kernel"], 128, 0.02),
        "out": (block["attention"]["out"]["kernel"], 64, 0.02 / math.sqrt(4)),
        "wi_gate": (block["mlp"]["wi_gate"]["kernel"], 128, 0.02),
        "wo": (block["mlp"]["wo"]["kernel"], 512, 0.02 / math.sqrt(4)),
        "lm_head": (params["lm_head"]["kernel"], 128, 0.02),
    }
    for name, (kernel, fan_in, normal_std) in kernels.items():
        w = np.asarray(kernel).ravel()
        if dense_init == "fan_in":
            assert np.abs(w).max() <= 2.0 / math.sqrt(fan_in), name
            want = _truncated_std() / math.sqrt(fan_in)
        else:
            want = normal_std
        assert w.std() == pytest.approx(want, rel=0.05), name
    embedding = np.asarray(params["token_embed"]["embedding"])
    assert embedding.std() == pytest.approx(0.02, rel=0.3)  # init_std in both (13 x 128)


def test_dropout_is_active_only_in_training() -> None:
    cfg = tiny_config("rope", dropout=0.5)
    model = Transformer(cfg)
    tokens_BT, positions_BT = tokens_and_positions()
    params = model.init(jax.random.key(0), tokens_BT, positions_BT)
    rngs = {"dropout": jax.random.key(1), "positions": jax.random.key(2)}
    train = model.apply(params, tokens_BT, positions_BT, deterministic=False, rngs=rngs)
    evals = [model.apply(params, tokens_BT, positions_BT) for _ in range(2)]
    np.testing.assert_array_equal(np.asarray(evals[0]), np.asarray(evals[1]))
    assert not np.allclose(np.asarray(train), np.asarray(evals[0]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 30, "num_heads": 4}, "d_model=30 is not divisible by model.num_heads=4"),
        ({"num_heads": 0}, "num_heads must be a positive integer, got 0"),
        ({"d_model": -8}, "d_model must be a positive integer, got -8"),
        ({"block": "t5"}, "block must be one of"),
        ({"dtype": "float16"}, "dtype must be one of"),
        ({"dropout": 1.5}, r"dropout must be in \[0, 1\)"),
        (
            {"dense_init": "xavier"},
            r"dense_init must be one of \('normal', 'fan_in'\), got 'xavier'",
        ),
        ({"position": "sinusoid"}, "unknown position scheme 'sinusoid'; known schemes: "),
        ({"position": "rope", "head_dim": 7}, "head_dim must be even"),
        ({"position": "rope", "position_options": {"bse": 2}}, r"unknown option\(s\) \['bse'\]"),
    ],
)
def test_bad_configs_name_the_value_and_what_is_allowed(
    overrides: dict[str, object], message: str
) -> None:
    kwargs: dict[str, object] = dict(vocab_size=13, d_model=32, num_heads=2, num_layers=1)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        checks.validate(ModelConfig(**kwargs))


def test_scheme_cache_does_not_confuse_equal_values_of_other_types() -> None:
    """{"qk_norm": 1} must be validated on its own, not served from {"qk_norm": True}."""
    good = ModelConfig(vocab_size=13, position="rope", position_options={"fraction": 1.0})
    other = ModelConfig(vocab_size=13, position="rope", position_options={"fraction": 1})
    assert type(good.scheme.fraction) is float
    assert type(other.scheme.fraction) is int
