"""Sliding-window attention and StreamingLLM's kept sink tokens, for every registered scheme.

- The window mask against a brute-force reference written from the definition (query i sees
  keys i - W < j <= i of its segment, plus the segment's first n keys).
- The blockwise engine equals the naive path with a window and sinks (values and gradients)
  for every registered scheme, with packed documents and blocks that straddle the window.
- Decoding far beyond W equals the full forward pass with the window mask, for every
  registered scheme, through a ring buffer of n + W slots whose shape does not depend on the
  cache length (``tests/test_ring_decode.py``: every scheme's cache, the engine, refusals,
  which decode with the full cache).
- Causality and locality: the gradient of a one-layer model's output at t with respect to
  the input at s is exactly zero outside the window and the sinks.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode, ring_decode
from copejax.model.transformer import Transformer
from copejax.ops import engine_blocks, engine_layout, segments
from copejax.positions import registry
from tests import sweeps
from tests.conftest import decode_in_chunks, perturbed, tiny_config

LENGTH = 14
BLOCK = 3
# Row 0 one document; row 1 packs two (the second starts at 6), so sinks exist per segment.
SEGMENTS_BT = np.array([[1] * LENGTH, [1] * 6 + [2] * (LENGTH - 6)], np.int32)
POSITIONS_BT = np.array([list(range(LENGTH)), list(range(6)) + list(range(LENGTH - 6))], np.int32)
CHUNKS = (5, 1, 1, 4, 1, 1, 1)  # prefill, steps and a 4-token chunk: 14 tokens, W = 3


def _reference_mask(ids: np.ndarray, window: int | None, sinks: int) -> np.ndarray:
    batch, length = ids.shape
    mask = np.zeros((batch, length, length), bool)
    for b in range(batch):
        for i in range(length):
            for j in range(i + 1):
                if ids[b, j] != ids[b, i]:
                    continue
                first = min(s for s in range(length) if ids[b, s] == ids[b, j])
                in_window = window is None or i - j < window
                is_sink = window is not None and j - first < sinks
                mask[b, i, j] = in_window or is_sink
    return mask


@pytest.mark.parametrize(("window", "sinks"), [(None, 0), (1, 0), (3, 0), (3, 2), (20, 1)])
def test_window_mask_matches_the_definition(window: int | None, sinks: int) -> None:
    ids = jnp.asarray(SEGMENTS_BT)
    mask = segments.causal_mask_BTS(
        ids, ids, window=window, sink_tokens=sinks, k_rank_BS=segments.segment_rank_BS(ids)
    )
    np.testing.assert_array_equal(mask, _reference_mask(SEGMENTS_BT, window, sinks))


def test_segment_rank_counts_from_each_segment_start() -> None:
    ranks = segments.segment_rank_BS(jnp.asarray(SEGMENTS_BT))
    np.testing.assert_array_equal(ranks, POSITIONS_BT)


def _model(position: str, impl: str, window: int, sinks: int, **overrides: object) -> Transformer:
    scheme = registry.make_scheme(position)
    layers = 2 if "carry" in scheme.sites or scheme.share_across_layers else 1
    backward = "remat" if scheme.walk_carry else "flash"
    cfg = tiny_config(
        position,
        num_layers=layers,
        max_len=32,
        attention_impl=impl,
        attention_block=BLOCK,
        attention_backward=backward,
        window=window,
        window_sink_tokens=sinks,
        **overrides,
    )
    return Transformer(cfg)


def _tokens() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)


# ALiBi (about 18 s here): its windowed bias is checked by
# test_outputs_ignore_inputs_outside_the_window_and_sinks and by decoding far beyond the window.
@pytest.mark.parametrize(
    "position", sweeps.schemes(fast=set(sweeps.REPRESENTATIVE) - {"tape", "alibi"})
)
def test_blockwise_with_window_and_sinks_equals_naive(position: str) -> None:
    tokens_BT, positions_BT, ids_BT = _tokens(), jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    sinks = 1 if registry.make_scheme(position).window_sinks else 0  # PaTH refuses sinks
    naive = _model(position, "naive", window=4, sinks=sinks)
    blockwise = _model(position, "blockwise", window=4, sinks=sinks)
    params = perturbed(naive.init(jax.random.key(0), tokens_BT, positions_BT)["params"])

    def loss(model: Transformer, p: object) -> tuple[jax.Array, jax.Array]:
        logits_BTV = model.apply({"params": p}, tokens_BT, positions_BT, ids_BT)
        return jnp.mean(jnp.sin(logits_BTV)), logits_BTV

    # Jitted: one program per model costs less than dispatching the walk's ops eagerly.
    (_, logits_n), grads_n = jax.jit(jax.value_and_grad(lambda p: loss(naive, p), has_aux=True))(
        params
    )
    (_, logits_b), grads_b = jax.jit(
        jax.value_and_grad(lambda p: loss(blockwise, p), has_aux=True)
    )(params)
    assert np.all(np.isfinite(np.asarray(logits_n)))
    np.testing.assert_allclose(logits_b, logits_n, rtol=2e-5, atol=2e-5)
    flat_b = dict(jax.tree_util.tree_leaves_with_path(grads_b))
    for path, grad_n in jax.tree_util.tree_leaves_with_path(grads_n):
        np.testing.assert_allclose(
            flat_b[path], grad_n, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path)
        )


def _decoded(model: Transformer, params: object, chunks: tuple[int, ...]) -> np.ndarray:
    return decode_in_chunks(model, params, _tokens(), POSITIONS_BT, SEGMENTS_BT, chunks=chunks)


def _far_beyond_cases() -> list:
    """(position, sinks) cases: the representatives but TAPE (about 12 s a case, in the slow
    set with every other scheme), ALiBi without sinks only (with them about 15 s; the sinks
    path is the engine's, checked with the other representatives)."""
    fast = set(sweeps.REPRESENTATIVE) - {"tape"}
    cases = []
    for param in sweeps.schemes(fast=fast):
        name = param.values[0]
        for sinks in (0, 2):
            slow = name not in fast or (name == "alibi" and sinks)
            marks = (pytest.mark.slow,) if slow else ()
            cases.append(pytest.param(name, sinks, marks=marks, id=f"{name}-{sinks}"))
    return cases


@pytest.mark.parametrize(("position", "sinks"), _far_beyond_cases())
def test_decoding_far_beyond_the_window_equals_the_full_forward(position: str, sinks: int) -> None:
    if sinks and not registry.make_scheme(position).window_sinks:
        pytest.skip("refused with the reason (test_path.py)")
    model = _model(position, "naive", window=3, sinks=sinks)
    if ring_decode.ring_refusal(model.cfg):  # refused with the reason (test_ring_decode.py)
        model = _model(position, "naive", window=3, sinks=sinks, window_decode_cache="full")
    tokens_BT = _tokens()
    params = perturbed(
        model.init(jax.random.key(0), tokens_BT, jnp.asarray(POSITIONS_BT))["params"]
    )
    full = model.apply(
        {"params": params}, tokens_BT, jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    )
    np.testing.assert_allclose(_decoded(model, params, CHUNKS), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "alibi+rope", "nope"])
def test_decoding_through_the_engine_with_a_ring_buffer(position: str) -> None:
    model = _model(position, "blockwise", window=4, sinks=1)
    tokens_BT = _tokens()
    params = perturbed(
        model.init(jax.random.key(0), tokens_BT, jnp.asarray(POSITIONS_BT))["params"]
    )
    full = model.apply(
        {"params": params}, tokens_BT, jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    )
    np.testing.assert_allclose(_decoded(model, params, CHUNKS), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_len", [8, 64])
def test_the_ring_buffer_holds_sinks_plus_window_slots(max_len: int) -> None:
    cfg = tiny_config("rope", window=3, window_sink_tokens=2, max_len=64)
    cache = decode.init_cache(cfg, 2, max_len)
    ring = cache["block_0"]["attention"]["ring_cache"]
    assert ring["key"].shape == (2, 5, cfg.num_heads, cfg.resolved_head_dim)
    assert ring["value"].shape == (2, 5, cfg.num_heads, cfg.resolved_head_dim)
    assert "key_cache" not in cache["block_0"]["attention"]
    # A scheme with per-key cached state keeps it in the ring's slots too.
    fox = decode.init_cache(tiny_config("fox", window=3, max_len=64), 2, max_len)
    assert fox["block_0"]["attention"]["ring_cache"]["fox_cumsum"].shape[1] == 3
    assert "key_cache" not in fox["block_0"]["attention"]
    # model.window_decode_cache="full": the full cache and the window mask.
    full_cfg = tiny_config("fox", window=3, max_len=64, window_decode_cache="full")
    full = decode.init_cache(full_cfg, 2, max_len)["block_0"]["attention"]
    assert full["key_cache"]["key"].shape[1] == max_len and "ring_cache" not in full


@pytest.mark.parametrize("position", ["nope", "rope", "alibi", "fire"])
@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_outputs_ignore_inputs_outside_the_window_and_sinks(position: str, impl: str) -> None:
    window, sinks = 3, 2
    model = _model(position, impl, window=window, sinks=sinks)
    tokens_BT, positions_BT, ids_BT = _tokens(), jnp.asarray(POSITIONS_BT), jnp.asarray(SEGMENTS_BT)
    params = perturbed(model.init(jax.random.key(0), tokens_BT, positions_BT)["params"])
    emb = model.apply({"params": params}, tokens_BT, positions_BT, False, method=Transformer.embed)
    allowed = _reference_mask(SEGMENTS_BT, window, sinks)

    def out(x_BTD: jax.Array, t: jax.Array) -> jax.Array:
        logits = model.apply(
            {"params": params},
            emb.replace(x_BTD=x_BTD),
            ids_BT,
            method=Transformer.forward_embedded,
        )
        return jnp.sum(logits[:, t] ** 2)

    # One compiled program for the three gradients (of output t, stacked on a leading axis).
    times = (5, 9, 13)
    grads_XBTD = jax.jit(jax.vmap(jax.grad(out), (None, 0)))(emb.x_BTD, jnp.array(times))
    for t, grad_BTD in zip(times, np.asarray(grads_XBTD), strict=True):
        touched_BT = np.any(grad_BTD != 0, axis=-1)
        np.testing.assert_array_equal(touched_BT, allowed[:, t, :], err_msg=f"query {t}")


def test_engine_walks_only_the_band() -> None:
    """The banded walk visits (W + Q - 2) // K + 2 key blocks per query block, not all."""
    layout = engine_layout.Layout(
        terms=(),
        normalizer=engine_blocks.SOFTMAX,
        size_q=16,
        size_k=16,
        count_q=64,
        count_k=64,
        scan_impl="auto",
        window=32,
    )
    assert layout.banded and layout.band_blocks == 4
    kj, live = layout.walk_plan(jnp.asarray(0), jnp.asarray(40), {})
    np.testing.assert_array_equal(kj, [40, 39, 38, 37])
    np.testing.assert_array_equal(live, [True, True, True, False])


def test_bad_window_values_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("model.window must be a positive integer")):
        tiny_config("rope", window=0)
    with pytest.raises(ValueError, match=re.escape("set model.window too")):
        tiny_config("rope", window_sink_tokens=2)
    with pytest.raises(ValueError, match=re.escape("window_sink_tokens must be an integer >= 0")):
        tiny_config("rope", window=4, window_sink_tokens=-1)
