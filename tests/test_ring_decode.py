"""A window layer decodes from a ring buffer of n + W slots, for every registered scheme that
allows it (``copejax.model.ring_decode``); the others are refused with the reason.

- The decode cache of every scheme's window layer holds n + W slots whatever ``max_len``, and
  no full-length key cache (``tests/test_window.py`` checks that decoding far beyond the ring
  equals the full forward with the window, for every scheme, with and without sinks).
- Decoding far beyond the ring (W = 2, 14 tokens, packed documents, steps and a chunk)
  equals the full forward with the window, on the naive path and the blockwise engine (which
  reads the ring's keys by index).
- A model whose every layer decodes from a ring keeps only the write index in its cursor and
  decodes past ``max_len`` (4 slots, 14 tokens) exactly; any other keeps the bounded cursor.
- Selective attention's penalties live in ring slots (``ctx.ring_view``).
- A scheme that cannot decode from a ring (selective attention's fixed-budget pruning; PaTH
  with a window narrower than its convolution) is refused with the reason, and
  ``window_decode_cache="full"`` decodes it exactly with the full cache.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode, ring_decode
from copejax.model.transformer import Transformer
from copejax.positions import registry
from tests.conftest import decode_in_chunks, perturbed, tiny_config

LENGTH = 14
SEGMENTS_BT = np.array([[1] * LENGTH, [1] * 9 + [2] * (LENGTH - 9)], np.int32)
POSITIONS_BT = np.array([list(range(LENGTH)), list(range(9)) + list(range(LENGTH - 9))], np.int32)
# A prefill as wide as the ring, steps, a chunk wider than it (one call wraps the ring).
STEPS = (3, 1, 1, 4, 1, 1, 1, 1, 1)


def _config(position: str, impl: str = "naive", **overrides: object) -> object:
    scheme = registry.make_scheme(position)
    fields: dict[str, object] = dict(
        num_layers=2 if "carry" in scheme.sites or scheme.share_across_layers else 1,
        max_len=32,
        attention_impl=impl,
        attention_block=2,
        attention_backward="remat" if scheme.walk_carry else "flash",
        window=2,
        window_sink_tokens=1 if scheme.window_sinks else 0,
    )
    fields.update(overrides)
    return tiny_config(position, **fields)


def _ring_schemes() -> list[str]:
    return [p for p in registry.names() if ring_decode.ring_refusal(_config(p)) is None]


def _decode_equals_forward(cfg: object, max_len: int | None = None) -> None:
    model = Transformer(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(3).integers(0, 13, (2, LENGTH)), jnp.int32)
    positions_BT, ids_BT = jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    params = perturbed(model.init(jax.random.key(0), tokens_BT, positions_BT)["params"])
    full = model.apply({"params": params}, tokens_BT, positions_BT, ids_BT)
    decoded = decode_in_chunks(
        model, params, tokens_BT, POSITIONS_BT, SEGMENTS_BT, chunks=STEPS, max_len=max_len
    )
    assert np.all(np.isfinite(decoded))
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)


def _attention_caches(cache: object) -> list[dict]:
    return [cache[name]["attention"] for name in sorted(cache) if name.startswith("block_")]


@pytest.mark.parametrize("position", registry.names())
def test_every_window_layer_caches_n_plus_w_slots(position: str) -> None:
    cfg = _config(position)
    if ring_decode.ring_refusal(cfg) is not None:
        pytest.skip("refused with the reason (test_schemes_without_a_ring_say_why)")
    slots = cfg.window + cfg.window_sink_tokens
    shapes = []
    for max_len in (8, 16):
        cache = decode.init_cache(cfg, 2, max_len)
        for layer in _attention_caches(cache):
            assert "key_cache" not in layer, position
            ring = layer["ring_cache"]
            for name, array in ring.items():
                assert array.shape[:2] == (2, slots), (position, name, array.shape)
        # Beside the model-wide cursor, nothing in the cache grows with max_len.
        leaves = jax.tree_util.tree_leaves_with_path(
            {k: v for k, v in cache.items() if k != "decode_cursor"}
        )
        shapes.append([(jax.tree_util.keystr(p), a.shape) for p, a in leaves])
    assert shapes[0] == shapes[1]


# Slow for every scheme (CoPE about 20 s, FoX 29 s, stick-breaking 32 s on 2 loaded cores):
# the default suite decodes far beyond the ring on the naive path in test_window.py's
# test_decoding_far_beyond_the_window_equals_the_full_forward (the representatives, with and
# without sinks, a prefill and a chunk wider than the ring), and on the engine below.
@pytest.mark.slow
@pytest.mark.parametrize("position", registry.names())
def test_steps_far_beyond_the_ring_equal_the_full_forward(position: str) -> None:
    cfg = _config(position)
    if ring_decode.ring_refusal(cfg) is not None:
        pytest.skip("refused with the reason (test_schemes_without_a_ring_say_why)")
    _decode_equals_forward(cfg)


@pytest.mark.parametrize(
    "position",
    [
        pytest.param(p, marks=() if p in ("fox", "stickbreaking") else (pytest.mark.slow,))
        for p in registry.names()
    ],
)
def test_the_engine_decodes_from_the_ring(position: str) -> None:
    cfg = _config(position, "blockwise")
    if ring_decode.ring_refusal(cfg) is not None:
        pytest.skip("refused with the reason (test_schemes_without_a_ring_say_why)")
    _decode_equals_forward(cfg)


BUDGET = {"position_options": (("prune_budget", 3),)}


@pytest.mark.parametrize(
    ("position", "overrides", "reason"),
    [
        ("selective", BUDGET, "prune_budget=3 keeps a buffer"),
        ("path", {"window": 1}, "conv_size=3"),
    ],
)
def test_schemes_without_a_ring_say_why(position: str, overrides: dict, reason: str) -> None:
    cfg = _config(position, **overrides)
    with pytest.raises(ValueError, match=re.escape(reason)) as info:
        decode.init_cache(cfg, 2, 8)
    assert "window_decode_cache='full'" in str(info.value)
    full = dataclasses.replace(cfg, window_decode_cache="full")
    layer = _attention_caches(decode.init_cache(full, 2, 8))[0]
    assert layer["key_cache"]["key"].shape[1] == 8 and "ring_cache" not in layer


@pytest.mark.parametrize(
    ("position", "overrides"),
    [
        pytest.param(p, o, marks=pytest.mark.slow)
        for p, o in (("selective", BUDGET), ("path", {"window": 1}))
    ],
)
def test_the_full_cache_option_decodes_refused_schemes_exactly(
    position: str, overrides: dict
) -> None:
    _decode_equals_forward(_config(position, window_decode_cache="full", **overrides))


def test_every_registered_scheme_decodes_from_a_ring() -> None:
    assert _ring_schemes() == registry.names()


@pytest.mark.parametrize(
    "options",
    [
        pytest.param((), id="plain"),
        pytest.param((("prune_threshold", 0.5),), id="threshold", marks=pytest.mark.slow),
    ],
)
def test_selective_penalties_live_in_ring_slots(options: tuple) -> None:
    cfg = _config("selective", position_options=options)
    penalty = _attention_caches(decode.init_cache(cfg, 2, 8))[0]["selective"]["penalty"]
    assert penalty["selective_penalty"].shape == (2, cfg.window + cfg.window_sink_tokens)
    _decode_equals_forward(cfg, max_len=4)


def test_a_bad_window_decode_cache_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("model.window_decode_cache must be one of")):
        tiny_config("rope", window=2, window_decode_cache="ring_buffer")


@pytest.mark.parametrize(
    "position", ["rope", "fox", pytest.param("cope+rope", marks=pytest.mark.slow)]
)
def test_an_all_window_model_decodes_past_max_len(position: str) -> None:
    cfg = _config(position, num_layers=2)
    assert ring_decode.unbounded_decode(cfg)
    assert set(decode.init_cache(cfg, 2, 4)["decode_cursor"]) == {"index"}
    _decode_equals_forward(cfg, max_len=4)


@pytest.mark.parametrize(
    ("position", "overrides"),
    [
        ("rope", {"window": None, "layer_pattern": ("rope:window=2", "rope")}),  # a global layer
        ("rope", {"window_decode_cache": "full"}),
        ("learned", {}),  # its table ends at max_len
        ("relative", {}),  # so do Shaw's distances
        ("selective", {"window_decode_cache": "full"}),
    ],
)
def test_other_models_keep_the_bounded_cursor(position: str, overrides: dict) -> None:
    cfg = _config(position, num_layers=2, window_sink_tokens=0, **overrides)
    assert not ring_decode.unbounded_decode(cfg)
    assert decode.init_cache(cfg, 2, 4)["decode_cursor"]["positions"].shape == (2, 4)


@pytest.mark.parametrize(
    "layout",
    [
        {"logit_scaling": "ssmax", "attention_sink": True},  # ssmax counts the visible keys
        pytest.param(
            {"logit_scaling": "llama4", "llama4_floor_scale": 2.0}, marks=pytest.mark.slow
        ),
    ],
    ids=["sink_ssmax", "llama4"],
)
def test_the_ring_with_a_sink_logit_and_length_scaling(layout: dict) -> None:
    _decode_equals_forward(_config("fox", **layout), max_len=4)
