"""Incremental decoding with the KV cache (``copejax.ops.kv_cache``): a prefill, then one token a
step.

Every position scheme decodes exactly (the contextual ones through their cached per-key
state, ``AttentionSite.cache_state``): the logits of prefill + steps equal those of one full
forward pass over the whole sequence (``tests/test_decode.py``). Sliding-window layers keep
a ring buffer of their window instead (``copejax.model.ring_decode``); a model of ring layers only
decodes past ``max_len``.

    cache = init_cache(cfg, batch=1, max_len=64)
    logits_BTV, vars = model.apply({"params": p, "cache": cache}, tokens_BT, positions_BT,
                                   decode=True, mutable=["cache"])

or, greedy or sampled continuation of a prompt: ``generate(cfg, params, prompt_BT, steps)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from copejax.model import ring_decode
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Any:
    """An empty cache (all zeros, write index 0) for ``batch`` sequences of ``max_len`` tokens.

    Raises ValueError (NotImplementedError) when the position scheme cannot decode that far
    (e.g. a learned table shorter than ``max_len``), or when a window layer cannot decode from
    a ring buffer (``copejax.model.ring_decode.check_ring``: the error names the reason).
    """
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch and max_len must be >= 1, got {batch}, {max_len}")
    for layer_cfg in {cfg.for_layer(i) for i in range(cfg.num_layers)} | {cfg}:
        layer_cfg.scheme.check_decode(layer_cfg.dims, max_len)
        ring_decode.check_ring(layer_cfg)
    tokens_BS = jnp.zeros((batch, max_len), jnp.int32)
    positions_BS = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
    model = Transformer(cfg)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), tokens_BS, positions_BS, decode=True)
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def generate(
    cfg: ModelConfig,
    params: Any,
    prompt_BT: jax.Array,
    steps: int,
    *,
    temperature: float = 0.0,
    key: jax.Array | None = None,
    max_len: int | None = None,
    context: int | None = None,
) -> jax.Array:
    """Continues each prompt by ``steps`` tokens, with the KV cache.

    Args:
      cfg: the model configuration.
      params: the model's "params" collection.
      prompt_BT: int prompts (B, T), T >= 1, at positions 0 .. T - 1.
      steps: number of new tokens.
      temperature: 0 for greedy (argmax), else sampling from softmax(logits / temperature).
      key: the sampling key (needed when temperature > 0); step i samples with the i-th key
        of the chain ``key, step_key = jax.random.split(key)``.
      max_len: cache slots; default T + steps - 1 (the last token is never fed back).
      context: the longest sequence the model may see (None: no limit). When T + steps - 1
        exceeds it, the cache is not used: every new token re-runs the model on the last
        ``context`` tokens at positions 0 .. context - 1 (a sliding window re-encoded each
        step, padded on the right to one compiled shape). Within it, the cache decodes; both
        give the same tokens with the same key chain.

    Returns:
      new tokens, int32 (B, steps).
    """
    if temperature < 0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("generate: temperature > 0 needs a key")
    if steps < 1:
        raise ValueError(f"generate: steps must be >= 1, got {steps}")
    if context is not None and context < 1:
        raise ValueError(f"generate: context must be >= 1 or None, got {context}")
    batch, length = prompt_BT.shape
    needed = length + steps - 1
    key = jax.random.key(0) if key is None else key
    prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
    if context is not None and needed > context:
        return _generate_by_window(
            cfg, params, prompt_BT, steps, temperature=temperature, key=key, context=context
        )
    max_len = needed if max_len is None else max_len
    if max_len < needed:
        raise ValueError(f"generate: max_len={max_len} is too short; allowed: >= {needed}")
    model = Transformer(cfg)

    @jax.jit
    def run(prompt_BT: jax.Array, key: jax.Array) -> jax.Array:
        cache = init_cache(cfg, batch, max_len)
        positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        logits_BTV, variables = model.apply(
            {"params": params, "cache": cache},
            prompt_BT,
            positions_BT,
            decode=True,
            mutable=["cache"],
        )
        key, step_key = jax.random.split(key)
        first_B = _pick(logits_BTV[:, -1], step_key, temperature)

        def step(carry: tuple, position: jax.Array) -> tuple[tuple, jax.Array]:
            cache, token_B, key = carry
            positions_B1 = jnp.broadcast_to(position, (batch, 1))
            logits_B1V, variables = model.apply(
                {"params": params, "cache": cache},
                token_B[:, None],
                positions_B1,
                decode=True,
                mutable=["cache"],
            )
            key, step_key = jax.random.split(key)
            new_B = _pick(logits_B1V[:, 0], step_key, temperature)
            return (variables["cache"], new_B, key), new_B

        carry = (variables["cache"], first_B, key)
        _, rest_LB = jax.lax.scan(step, carry, length + jnp.arange(steps - 1, dtype=jnp.int32))
        return jnp.concatenate([first_B[:, None], rest_LB.T], axis=1)

    return run(prompt_BT, key)


def _pick(logits_BV: jax.Array, step_key: jax.Array, temperature: float) -> jax.Array:
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(step_key, logits_BV / temperature).astype(jnp.int32)


def _generate_by_window(
    cfg: ModelConfig,
    params: Any,
    prompt_BT: jax.Array,
    steps: int,
    *,
    temperature: float,
    key: jax.Array,
    context: int,
) -> jax.Array:
    """``generate`` past ``context``: each token from a full forward over the last
    ``context`` tokens (C = context)."""
    model = Transformer(cfg)
    batch = prompt_BT.shape[0]

    @jax.jit
    def next_token(ids_BC: jax.Array, used: jax.Array, step_key: jax.Array) -> jax.Array:
        positions_BC = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context))
        segments_BC = (positions_BC < used).astype(jnp.int32)
        logits_BCV = model.apply({"params": params}, ids_BC, positions_BC, segments_BC)
        return _pick(logits_BCV[:, used - 1], step_key, temperature)

    ids_BL, new = prompt_BT, []
    for _ in range(steps):
        window_BW = ids_BL[:, -context:]
        used = window_BW.shape[1]
        padded_BC = jnp.pad(window_BW, ((0, 0), (0, context - used)))
        key, step_key = jax.random.split(key)
        token_B = next_token(padded_BC, jnp.int32(used), step_key)
        ids_BL = jnp.concatenate([ids_BL, token_B[:, None]], axis=1)
        new.append(token_B)
    return jnp.stack(new, axis=1)
