"""Incremental decoding equals the full forward pass, for every scheme and the main variants.

A prompt (with packed documents in one row) is prefilled into the KV cache, the rest of the
sequence is decoded one token (or one chunk) at a time, and the logits at every position are
compared with one full forward pass over the whole sequence. Parameters that start at zero
(CoPE's table, TAPE's W2, ...) are perturbed so that every scheme's position term is live.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import decode, ring_decode
from copejax.model.transformer import Transformer
from copejax.ops.fox_core import fox_cached_cumsum
from copejax.ops.segments import causal_mask_BTS, segment_starts_BT
from copejax.positions import registry
from copejax.positions.fox import PRO_OPTIONS
from copejax.positions.stickbreaking import stickbreaking_allowed_BTS
from tests.conftest import (
    PACKED_POSITIONS_BT,
    PACKED_SEGMENTS_BT,
    decode_in_chunks,
    perturbed,
    tiny_config,
)

LENGTH = 8
PREFILL = 4
# Row 0 is one document; row 1 packs three (a boundary in the prompt and one in the steps).
SEGMENTS_BT, POSITIONS_BT = PACKED_SEGMENTS_BT, PACKED_POSITIONS_BT

# RoPE's frequency options (copejax/positions/rope_frequencies.py), each live at these sizes
# (head_dim 16, max_len 16, 8 positions): L = 32 puts pair 1 in Llama 3.1's blended band;
# dynamic and longrope fix current_len = 8 > L = 4 (per-call lengths: test_rope_variants.py).
ROPE_VARIANTS = [
    ("rope", {"p": 0.5}),
    ("rope", {"scaling": "llama3", "factor": 4.0, "original_max_len": 32}),
    ("rope", {"scaling": "dynamic", "factor": 2.0, "original_max_len": 4, "current_len": 8}),
    (
        "rope",
        {
            "scaling": "longrope",
            "short_factor": (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0),
            "long_factor": (1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0),
            "factor": 4.0,
            "original_max_len": 4,
            "current_len": 8,
        },
    ),
    ("rope", {"scaling": "yarn", "factor": 2.0, "yarn_ramp": "index"}),
]
VARIANTS = [
    ("cope+rope", {}),
    ("cope", {"gates": "sep_keys"}),
    ("cope", {"position_term": "mlp"}),
    ("fox", PRO_OPTIONS),
    ("stickbreaking", {"remainder_bias": True, "head_norm": True}),
    ("tape", {"contextualize": "attention"}),
]
SLOW_VARIANTS = [
    ("cope+relative", {}),
    ("cope", {"gates": "values"}),
    ("cope", {"position_term": "alibi"}),
    ("cope", {"p_max": 3}),
    ("stickbreaking", {"include_self": True}),
    ("tape", {"contextualize": "mlp"}),
    ("path+fox", {}),
    ("cope", {"gates": "sep_keys", "share_layers": True}),
    ("cope", {"per_head_embeddings": True, "scale_position_term": True}),
    ("cope", {"position_term": "alibi", "alibi_slopes": "press"}),
    ("cope+rope", {"gates": "sep_keys", "share_layers": True}),
    ("fox", {"output_gate": True}),
    ("fox", {"qk_norm": True}),
    ("fox", {"key_shift": True}),
    ("fox", {"value_shift": True}),
    ("fox", {"unit_forget_gate": True, "key_shift": True}),
    ("tape", {"init": "random", "block": 4, "coords": 3}),
    ("tape", {"tensorial": False, "equivariant": False}),
    ("tape", {"psi_input": "head", "hidden": 6}),
    ("rope", {"scaling": "yarn", "factor": 2.0}),
    *ROPE_VARIANTS,
    ("randomized", {"encoding": "learned"}),
    ("randomized", {"encoding": "rope"}),
    ("sinusoidal", {"mode": "concat"}),
    ("kerple", {"variant": "power"}),
]


def _layers(position: str, options: dict) -> int:
    """One layer unless state crosses layers (TAPE's carry) or is shared between them."""
    scheme = registry.make_scheme(position, options)
    return 2 if "carry" in scheme.sites or scheme.share_across_layers else 1


def _model_and_params(
    position: str, options: dict, **overrides: object
) -> tuple[Transformer, object, object]:
    cfg = tiny_config(
        position, position_options=options, num_layers=_layers(position, options), **overrides
    )
    model = Transformer(cfg)
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    params = model.init(jax.random.key(0), tokens_BT, jnp.asarray(POSITIONS_BT))["params"]
    return model, perturbed(params), cfg


def _decoded_logits(
    model: Transformer, params: object, chunks: list[int], segments: bool = True
) -> np.ndarray:
    """Logits of the whole sequence fed in consecutive chunks through the cache."""
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    segments_BT = SEGMENTS_BT if segments else None
    return decode_in_chunks(model, params, tokens_BT, POSITIONS_BT, segments_BT, chunks=chunks)


def _full_logits(model: Transformer, params: object, segments: bool = True) -> np.ndarray:
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, LENGTH)), jnp.int32)
    segment_ids = jnp.asarray(SEGMENTS_BT) if segments else None
    return np.asarray(
        model.apply({"params": params}, tokens_BT, jnp.asarray(POSITIONS_BT), segment_ids)
    )


def _check_prefill_then_steps(
    position: str, options: dict, chunks: list[int], **overrides: object
) -> None:
    model, params, _ = _model_and_params(position, options, **overrides)
    full = _full_logits(model, params)
    decoded = _decoded_logits(model, params, chunks)
    assert np.all(np.isfinite(full))
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5, err_msg=position)


STEPS = [PREFILL] + [1] * (LENGTH - PREFILL)


@pytest.mark.parametrize("position", registry.names())
def test_prefill_then_steps_equals_full_pass(position: str) -> None:
    _check_prefill_then_steps(position, {}, STEPS)


@pytest.mark.parametrize(("position", "options"), VARIANTS, ids=str)
def test_variants_prefill_then_steps_equal_full_pass(position: str, options: dict) -> None:
    _check_prefill_then_steps(position, options, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize(("position", "options"), SLOW_VARIANTS, ids=str)
def test_more_variants_prefill_then_steps_equal_full_pass(position: str, options: dict) -> None:
    _check_prefill_then_steps(position, options, STEPS)


@pytest.mark.parametrize(
    ("position", "options"),
    [
        pytest.param("cope", {"gates": "sep_keys"}, marks=pytest.mark.slow),
        ("fox", {"key_shift": True, "value_shift": True}),
        ("stickbreaking", {}),
        pytest.param("tape", {}, marks=pytest.mark.slow),
        pytest.param("path", {}, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_chunks_at_any_index_equal_full_pass(position: str, options: dict) -> None:
    """Multi-token calls after the first (chunk boundaries inside and between documents)."""
    _check_prefill_then_steps(position, options, [1, 3, 2, 2])


@pytest.mark.slow
@pytest.mark.parametrize("position", registry.names())
def test_one_token_at_a_time_without_segments_equals_full_pass(position: str) -> None:
    model, params, _ = _model_and_params(position, {})
    full = _full_logits(model, params, segments=False)
    decoded = _decoded_logits(model, params, [1] * LENGTH, segments=False)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5, err_msg=position)


# Attention layouts (issue 14): grouped KV heads, GPT-OSS's sink, length scaling of q. Every
# registered scheme with each layout it takes; a core set runs in the default suite.
LAYOUTS = {
    "gqa2": {"num_heads": 4, "num_kv_heads": 2},
    "mqa": {"num_heads": 4, "num_kv_heads": 1},
    "sink_ssmax": {"attention_sink": True, "logit_scaling": "ssmax"},
    # floor_scale 2: the factor changes within the 8 test positions.
    "llama4": {"logit_scaling": "llama4", "llama4_floor_scale": 2.0},
    # a sliding window (kept sink tokens: tests/test_window.py), with grouped heads
    "window_gqa": {"num_heads": 4, "num_kv_heads": 2, "window": 3},
}
SOFTMAX_ONLY = ("attention_sink", "logit_scaling")  # stick-breaking refuses these
CORE_SCHEMES = ("rope", "alibi", "cope", "fox", "tape", "stickbreaking")


def softmax_scheme(position: str) -> bool:
    return "normalizer" not in registry.make_scheme(position).sites


def layout_params(fast: tuple[str, ...] = CORE_SCHEMES, fast_layouts: tuple[str, ...] = ()):
    """(scheme, layout name) for every scheme and every layout it takes; slow unless the
    scheme is in ``fast`` and the layout in ``fast_layouts`` (every layout when empty)."""
    params = []
    for position in registry.names():
        for name, overrides in LAYOUTS.items():
            if set(SOFTMAX_ONLY) & set(overrides) and not softmax_scheme(position):
                continue  # refused with a reason (test_attention_layout.py)
            quick = position in fast and (not fast_layouts or name in fast_layouts)
            marks = () if quick else (pytest.mark.slow,)
            params.append(pytest.param(position, name, marks=marks, id=f"{position}-{name}"))
    return params


@pytest.mark.parametrize(
    ("position", "layout"),
    layout_params(fast=("rope", "cope", "fox"), fast_layouts=("gqa2", "window_gqa")),
)
def test_attention_layouts_prefill_then_steps_equal_full_pass(position: str, layout: str) -> None:
    overrides = dict(LAYOUTS[layout])
    if ring_decode.ring_refusal(tiny_config(position, **overrides)):
        overrides["window_decode_cache"] = "full"  # the reason: tests/test_ring_decode.py
    _check_prefill_then_steps(position, {}, STEPS, **overrides)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_decode_cache_holds_the_key_value_heads(num_kv_heads: int) -> None:
    """The cache holds K heads of keys and values (B, S, K, H), not N."""
    cfg = tiny_config("rope", num_heads=4, num_kv_heads=num_kv_heads)
    cache = decode.init_cache(cfg, 2, LENGTH)
    slots = cache["block_0"]["attention"]["key_cache"]
    assert slots["key"].shape == (2, LENGTH, num_kv_heads, cfg.resolved_head_dim)
    assert slots["value"].shape == (2, LENGTH, num_kv_heads, cfg.resolved_head_dim)


def test_tape_caches_per_query_head_keys_and_key_value_head_values() -> None:
    """TAPE reads each query head's own position tensor at the qk site, so its cached keys are
    per query head; its values keep the K key/value heads."""
    cfg = tiny_config("tape", num_heads=4, num_kv_heads=1)
    slots = decode.init_cache(cfg, 2, LENGTH)["block_0"]["attention"]["key_cache"]
    assert slots["key"].shape[2] == 4
    assert slots["value"].shape[2] == 1


# ----------------------------------------------------------------------------- pure pieces


def test_decode_mask_matches_reference(rng: np.random.Generator) -> None:
    cached_BS = rng.integers(0, 3, (2, 9)).astype(np.int32)
    index, length = 4, 3
    new_BT = cached_BS[:, index : index + length]
    mask_BTS = np.asarray(causal_mask_BTS(jnp.asarray(new_BT), cached_BS, jnp.int32(index)))
    expected = np.zeros((2, length, 9), bool)
    for b in range(2):
        for t in range(length):
            for s in range(9):
                expected[b, t, s] = s <= index + t and cached_BS[b, s] == new_BT[b, t]
    np.testing.assert_array_equal(mask_BTS, expected)


def test_fox_cached_prefix_sums_continue_across_calls(rng: np.random.Generator) -> None:
    segments_S = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])
    logf_BSN = -rng.random((1, 9, 2)).astype(np.float32)
    expected = np.zeros_like(logf_BSN)
    for s in range(9):
        start = s if s == 0 or segments_S[s] != segments_S[s - 1] else None
        expected[0, s] = logf_BSN[0, s] + (0 if start is not None else expected[0, s - 1])
    segments_BS = jnp.asarray(segments_S[None], jnp.int32)
    c_BSN = np.zeros_like(logf_BSN)
    for start, end in [(0, 2), (2, 5), (5, 6), (6, 9)]:
        starts_BT = segment_starts_BT(segments_BS[:, start:end], segments_BS, start)
        previous = None if start == 0 else jnp.asarray(c_BSN[:, start - 1])
        c_BSN[:, start:end] = fox_cached_cumsum(
            jnp.asarray(logf_BSN[:, start:end]), starts_BT, previous
        )
    np.testing.assert_allclose(c_BSN, expected, rtol=1e-6, atol=1e-6)


def test_stickbreaking_excludes_own_key_at_the_cache_index() -> None:
    mask_BTS = jnp.ones((1, 2, 6), bool)
    allowed = np.asarray(stickbreaking_allowed_BTS(mask_BTS, False, jnp.int32(3)))
    expected = np.ones((1, 2, 6), bool)
    expected[0, 0, 3] = expected[0, 1, 4] = False
    np.testing.assert_array_equal(allowed, expected)


# ----------------------------------------------------------------------------- errors


def test_decode_without_a_cache_is_a_clear_error() -> None:
    model, params, _ = _model_and_params("rope", {})
    tokens_BT = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="decode=True needs a cache"):
        model.apply({"params": params}, tokens_BT, tokens_BT, decode=True, mutable=["cache"])


def test_learned_table_refuses_a_longer_cache() -> None:
    cfg = tiny_config("learned", position_options={"table_size": 8}, num_layers=1)
    with pytest.raises(ValueError, match="table_size=8"):
        decode.init_cache(cfg, 1, 9)


def test_randomized_positions_sampled_at_eval_cannot_decode() -> None:
    cfg = tiny_config("randomized", position_options={"sample_at_eval": True}, num_layers=1)
    with pytest.raises(NotImplementedError, match="randomized"):
        decode.init_cache(cfg, 1, 4)


def test_cache_batch_mismatch_and_overflow() -> None:
    model, params, cfg = _model_and_params("alibi", {})
    cache = decode.init_cache(cfg, 2, 3)
    tokens_BT = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="batch 2"):
        model.apply(
            {"params": params, "cache": cache}, tokens_BT, tokens_BT, decode=True, mutable=["cache"]
        )
    tokens_BT = jnp.zeros((2, 2), jnp.int32)
    logits_BTV, variables = model.apply(
        {"params": params, "cache": cache}, tokens_BT, tokens_BT, decode=True, mutable=["cache"]
    )
    assert np.all(np.isfinite(np.asarray(logits_BTV)))
    logits_BTV, _ = model.apply(
        {"params": params, "cache": variables["cache"]},
        tokens_BT,
        tokens_BT + 2,
        decode=True,
        mutable=["cache"],
    )
    assert np.all(np.isnan(np.asarray(logits_BTV))), "a write past the cache must not pass"


# ----------------------------------------------------------------------------- generation


def _greedy_by_reforward(
    model: Transformer, params: object, prompt_BT: np.ndarray, steps: int
) -> np.ndarray:
    tokens_BT = np.asarray(prompt_BT)
    for _ in range(steps):
        length = tokens_BT.shape[1]
        positions_BT = np.broadcast_to(np.arange(length), tokens_BT.shape)
        logits_BTV = model.apply({"params": params}, jnp.asarray(tokens_BT), positions_BT)
        next_B = np.argmax(np.asarray(logits_BTV[:, -1]), axis=-1)
        tokens_BT = np.concatenate([tokens_BT, next_B[:, None]], axis=1)
    return tokens_BT[:, prompt_BT.shape[1] :]


@pytest.mark.parametrize(
    "position",
    [
        pytest.param("fox", marks=pytest.mark.slow),
        pytest.param("cope", marks=pytest.mark.slow),
        pytest.param("tape", marks=pytest.mark.slow),
    ],
)  # about 15 s each; generate() itself: test_generate_with_cache_equals_the_window_reforward
def test_cached_greedy_generation_equals_reforward(position: str) -> None:
    options = {"key_shift": True} if position == "fox" else {}
    model, params, cfg = _model_and_params(position, options)
    prompt_BT = np.random.default_rng(3).integers(0, 13, (2, 3)).astype(np.int32)
    cached = np.asarray(decode.generate(cfg, params, jnp.asarray(prompt_BT), 5))
    np.testing.assert_array_equal(cached, _greedy_by_reforward(model, params, prompt_BT, 5))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_with_cache_equals_the_window_reforward(temperature: float) -> None:
    """Within the context the window path re-runs the whole sequence each step: it must give
    the cache's tokens with the same key chain. Past it, the window slides."""
    _, params, cfg = _model_and_params("cope+rope", {})
    prompt_BT = jnp.array([[1, 5, 7], [2, 3, 4]], jnp.int32)
    key = jax.random.key(4)
    cached = decode.generate(cfg, params, prompt_BT, 6, temperature=temperature, key=key)
    window = decode._generate_by_window(
        cfg, params, prompt_BT, 6, temperature=temperature, key=key, context=LENGTH
    )
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(window))
    sliding = decode.generate(cfg, params, prompt_BT, 6, temperature=temperature, key=key,
                              context=4)  # fmt: skip
    assert sliding.shape == (2, 6)
    np.testing.assert_array_equal(np.asarray(sliding[:, :2]), np.asarray(cached[:, :2]))
