"""Length scaling of attention logits, as a per-query scale of q: SSMax (Nakanishi 2025,
arXiv 2501.19399) and Llama 4's attention temperature tuning (Meta 2025, reference code).

Both multiply each query by a factor that grows with its position, so that attention does
not flatten as more keys compete in the softmax denominator ("attention fading"):

- ``"ssmax"``: Scalable-Softmax replaces ``softmax(z)`` over n inputs by
  ``softmax((s log n) z)`` (the paper's eq. for SSMax, with a learnable scalar s per head and
  layer). In causal attention query t sees ``n_t`` keys, here the keys of its own segment up to
  and including itself (:func:`keys_seen_BT`). The paper computes it as ``(s log n) q``; s
  starts at 0.43, the value of the paper's Figure 1 (``model.ssmax_scale``), and is learned
  unless ``model.ssmax_learned`` is False.
- ``"llama4"``: Llama 4's temperature tuning, from ``models/llama4/model.py`` of
  meta-llama/llama-models (``Attention.forward``, used in its NoPE layers), restated in
  Hugging Face's ``Llama4TextAttention``: ``q <- q * (log(floor((pos + 1) / floor_scale) + 1)
  * attn_scale + 1)`` with ``floor_scale = 8192`` and ``attn_scale = 0.1``
  (``model.llama4_floor_scale``, ``model.llama4_attn_scale``); ``pos`` is the query's
  position. The factor is 1 up to position ``floor_scale - 2`` and grows with log(pos) beyond.

Both scale q after the qk site (after RoPE, as Llama 4 scales its queries), so every path gets
them (naive, blockwise engine, ``jax.nn.dot_product_attention``, decoding), and every term that
reads q sees the scaled query (CoPE's gates and position term, Shaw's and XL's q . r). An
additive bias that does not read q (ALiBi, T5, Kerple, FIRE, FoX's forget bias) and the
attention sink are not scaled: the paper's SSMax scales the whole softmax input of attention
without biases, ``(s log n) q K^T / sqrt(d)``, and states no choice for a bias; Llama 4 has none.

Shape letters: B batch, T queries, S keys, N heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops import segments

LOGIT_SCALINGS = ("none", "ssmax", "llama4")
SSMAX_SCALE_INIT = 0.43  # the paper's Figure 1
LLAMA4_FLOOR_SCALE = 8192.0
LLAMA4_ATTN_SCALE = 0.1


def keys_seen_BT(
    q_segment_ids_BT: jax.Array, k_segment_ids_BS: jax.Array, offset: jax.Array | int = 0
) -> jax.Array:
    """n: how many keys query t (key ``offset + t``) sees, its own included: the keys from the
    start of its segment (a run of equal ids among the keys) up to itself; int32 (B, T).

    O(S) memory: the start of each key's segment is a running maximum of segment-start indices.
    """
    length_k = k_segment_ids_BS.shape[1]
    starts_BS = segments.segment_starts_BT(k_segment_ids_BS)
    index_S = jnp.arange(length_k, dtype=jnp.int32)
    start_BS = jax.lax.cummax(jnp.where(starts_BS, index_S, 0), axis=1)
    key_T = jnp.asarray(offset, jnp.int32) + jnp.arange(q_segment_ids_BT.shape[1], dtype=jnp.int32)
    start_BT = jnp.take(start_BS, jnp.minimum(key_T, length_k - 1), axis=1)
    return key_T[None] - start_BT + 1


def ssmax_scale_BTN(keys_seen_BT: jax.Array, s_N: jax.Array) -> jax.Array:
    """SSMax's ``s log n`` per query and head, float32 (B, T, N)."""
    log_n_BT = jnp.log(keys_seen_BT.astype(jnp.float32))
    return log_n_BT[..., None] * s_N.astype(jnp.float32)


def llama4_scale_BT(
    positions_BT: jax.Array,
    floor_scale: float = LLAMA4_FLOOR_SCALE,
    attn_scale: float = LLAMA4_ATTN_SCALE,
) -> jax.Array:
    """Llama 4's ``log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1``, float32 (B, T)."""
    pos_BT = positions_BT.astype(jnp.float32)
    return jnp.log(jnp.floor((pos_BT + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0


def scale_queries(q_BTNH: jax.Array, scale_BTN: jax.Array) -> jax.Array:
    """q times a per-query (and per-head) factor, in float32, back in q's dtype."""
    scale_BTN = jnp.broadcast_to(scale_BTN, q_BTNH.shape[:3])
    return (q_BTNH.astype(jnp.float32) * scale_BTN[..., None]).astype(q_BTNH.dtype)
