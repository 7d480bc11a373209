"""Per-layer patterns (``model.layer_pattern``) and the named presets (``model.layout``).

- Parsing and every validation error, before any compute.
- A patterned model's layer i computes what a uniform model of that layer's kind computes:
  each block is re-run as a block of the uniform configuration on the block input captured
  from the patterned model.
- Decoding a patterned model with window layers (ring buffers beside full caches) equals its
  full forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode, layouts
from copejax.model.transformer import Block, Transformer
from copejax.positions.base import AttentionContext
from tests.conftest import perturbed, tiny_config

LENGTH = 10
SEGMENTS_BT = np.array([[1] * LENGTH, [1] * 4 + [2] * 6], np.int32)
POSITIONS_BT = np.array([list(range(LENGTH)), list(range(4)) + list(range(6))], np.int32)


def test_kinds_parse_into_scheme_fields_and_options() -> None:
    assert layouts.parse_kind("rope:window=512,base=10000") == (
        "rope",
        (("window", 512),),
        (("base", 10000),),
    )
    assert layouts.parse_kind("nope") == ("nope", (), ())
    assert layouts.parse_kind("alibi+rope:window=none") == ("alibi+rope", (("window", None),), ())


def test_layers_get_their_kind_and_the_pattern_repeats() -> None:
    cfg = tiny_config(
        "rope",
        num_layers=4,
        position_options={"base": 500.0},
        layer_pattern=("rope:window=3", "nope"),
        window_sink_tokens=1,
    )
    layers = [cfg.for_layer(i) for i in range(4)]
    assert [c.position for c in layers] == ["rope", "nope", "rope", "nope"]
    assert [c.window for c in layers] == [3, None, 3, None]
    assert [c.window_sink_tokens for c in layers] == [1, 0, 1, 0]
    # The model's options reach layers of the model's scheme; others start from defaults.
    assert dict(layers[0].position_options) == {"base": 500.0}
    assert layers[1].position_options == ()
    assert all(c.layer_pattern == () and c.layout is None for c in layers)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layer_pattern": ("rope", "nope", "rope")}, "does not divide model.num_layers=4"),
        ({"layer_pattern": ("rotary", "nope")}, "unknown position scheme 'rotary'"),
        ({"layer_pattern": ("rope:width=3", "nope")}, "unknown key 'width'"),
        ({"layer_pattern": ("rope:window", "nope")}, "is not key=value"),
        ({"layer_pattern": ("rope:window=0", "nope")}, "model.window must be a positive"),
        ({"layer_pattern": ("rope:base=-1", "nope")}, "'rope:base=-1'"),
        ({"layer_pattern": ("learned", "nope")}, "uses the embed site"),
        ({"layer_pattern": ("t5", "nope")}, "shares its modules"),
        ({"layer_pattern": "rope,nope"}, "must be a list of kinds"),
        ({"layout": "gemma9"}, "model.layout must be one of"),
        ({"layout": "irope", "layer_pattern": ("rope",)}, "not both"),
        ({"position": "tape", "layer_pattern": ("rope",)}, "has a carry site"),
    ],
)
def test_bad_patterns_are_refused_before_any_compute(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(overrides.pop("position", "rope"), num_layers=4, **overrides)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("irope", ("rope:window=8192",) * 3 + ("nope:window=none",)),
        (
            "gemma3",
            ("rope:window=1024,base=10000",) * 5 + ("rope:window=none,base=1000000",),
        ),
        ("swan", ("nope:window=none",) + ("rope:window=512",) * 3),
        ("rnope", ("rope:window=4096",) * 3 + ("nope:window=none",)),
    ],
)
def test_presets_spell_the_published_layouts(layout: str, expected: tuple[str, ...]) -> None:
    assert layouts.preset_pattern(layout) == expected
    layers = len(expected)
    cfg = tiny_config("nope", num_layers=layers, layout=layout, window=4)
    local_layer = next(i for i, kind in enumerate(expected) if "window=none" not in kind)
    global_layer = next(i for i, kind in enumerate(expected) if "window=none" in kind)
    local, global_ = cfg.for_layer(local_layer), cfg.for_layer(global_layer)
    assert local.position == "rope" and local.window == 4  # model.window sets the local window
    assert global_.window is None
    if layout == "gemma3":
        assert dict(local.position_options)["base"] == 10000
        assert dict(global_.position_options)["base"] == 1000000


PATTERN = ("fire:window=3", "alibi+rope", "nope:window=2,window_sink_tokens=1")


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_each_patterned_layer_equals_a_uniform_layer_of_its_kind(impl: str) -> None:
    cfg = tiny_config(
        "nope", num_layers=3, layer_pattern=PATTERN, attention_impl=impl, attention_block=3
    )
    model = Transformer(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    positions_BT, ids_BT = jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    params = perturbed(model.init(jax.random.key(0), tokens_BT, positions_BT)["params"])
    _, state = model.apply(
        {"params": params}, tokens_BT, positions_BT, ids_BT, capture_intermediates=True
    )
    captured = state["intermediates"]
    x_BTD = model.apply({"params": params}, tokens_BT, positions_BT, True, method="embed").x_BTD
    uniform = [
        tiny_config("fire", window=3, num_layers=3, attention_impl=impl, attention_block=3),
        tiny_config("alibi+rope", num_layers=3, attention_impl=impl, attention_block=3),
        tiny_config(
            "nope",
            window=2,
            window_sink_tokens=1,
            num_layers=3,
            attention_impl=impl,
            attention_block=3,
        ),
    ]
    for i, layer_cfg in enumerate(uniform):
        ctx = AttentionContext.create(x_BTD, positions_BT, ids_BT)
        y_BTD, _ = Block(layer_cfg).apply({"params": params[f"block_{i}"]}, x_BTD, ctx)
        patterned_BTD = captured[f"block_{i}"]["__call__"][0][0]
        np.testing.assert_allclose(y_BTD, patterned_BTD, rtol=1e-5, atol=1e-6, err_msg=str(i))
        x_BTD = patterned_BTD


@pytest.mark.slow  # about 20 s; window decoding per scheme: tests/test_window.py
def test_patterned_model_with_windows_decodes_like_its_full_forward() -> None:
    cfg = tiny_config(
        "rope",
        num_layers=4,
        max_len=32,
        layer_pattern=(
            "rope:window=3,window_sink_tokens=1",
            "alibi:window=2",
            "nope",
            "fox:window=3",
        ),
    )
    model = Transformer(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    positions_BT, ids_BT = jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    params = perturbed(model.init(jax.random.key(0), tokens_BT, positions_BT)["params"])
    full = model.apply({"params": params}, tokens_BT, positions_BT, ids_BT)
    cache = decode.init_cache(cfg, 2, LENGTH)
    attention = [cache[f"block_{i}"]["attention"] for i in range(4)]
    assert attention[0]["ring_cache"]["key"].shape[1] == 4  # 1 sink + window 3
    assert attention[1]["ring_cache"]["key"].shape[1] == 2
    assert attention[2]["key_cache"]["key"].shape[1] == LENGTH  # global layer: full cache
    assert attention[3]["ring_cache"]["fox_cumsum"].shape[1] == 3  # FoX's state in the ring
    outputs, start = [], 0
    for size in (4, 1, 1, 3, 1):
        end = start + size
        logits_BTV, variables = model.apply(
            {"params": params, "cache": cache},
            tokens_BT[:, start:end],
            positions_BT[:, start:end],
            ids_BT[:, start:end],
            decode=True,
            mutable=["cache"],
        )
        cache, start = variables["cache"], end
        outputs.append(np.asarray(logits_BTV))
    np.testing.assert_allclose(np.concatenate(outputs, 1), full, rtol=1e-5, atol=1e-5)
