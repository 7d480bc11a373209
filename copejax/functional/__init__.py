"""copejax's position schemes as functions of plain arrays: one call per use.

    params = functional.init("cope", key, num_heads=4, head_dim=16)
    y_BTNH = functional.attention(q_BTNH, k_BSKH, v_BSKH, scheme="cope", params=params)

- :func:`init` -> the scheme's parameters, a plain dict of arrays ({} for ALiBi, RoPE, ...);
- :func:`attention` -> causal attention with the scheme at every site it uses, on the path
  ``impl`` names ("naive", "blockwise" = the O(T) engine, "dot_product_attention", "kernel",
  "auto");
- :func:`init_cache` and :func:`decode` -> incremental decoding, the cache a pytree handed in
  and out (prefill + steps equal one :func:`attention` call);
- :func:`embed` and :func:`carry_after_mlp` -> the embed site (learned, sinusoidal,
  randomized, TAPE's initial tensor) and TAPE's carry update after the MLP.

The functions apply :class:`copejax.linen.PositionAttention`, which is the project's own
attention layer (:class:`copejax.model.attention.Attention`) without its projections, so the
results are the model's (``tests/test_functional.py`` checks every registered scheme). The
schemes' pure cores (biases, rotations, gates) are re-exported here from where they live
(:mod:`copejax.functional.cores`); the engine's block terms are :mod:`copejax.terms`.
"""

from copejax.functional.cores import (
    alibi_bias,
    alibi_slopes,
    cope_bias,
    fox_bias,
    fox_log_forget_gates,
    rope,
)
from copejax.functional.decoding import decode, init_cache
from copejax.functional.layer import attention, carry_after_mlp, embed, init, module

__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "attention",
    "carry_after_mlp",
    "cope_bias",
    "decode",
    "embed",
    "fox_bias",
    "fox_log_forget_gates",
    "init",
    "init_cache",
    "module",
    "rope",
]
