"""Which attention path one call takes, the ``jax.nn.dot_product_attention`` path and the
fused kernels' path.

``choose_impl`` reads ``model.attention_impl`` ("auto": a measured fastest path
(:mod:`copejax.model.measured_paths`), else ``rule_impl``'s naive path, blockwise engine of
:mod:`copejax.ops.engine`, or cuDNN's fused kernel on a GPU in bfloat16);
``ring_cache_applies`` says whether a window layer decodes from a ring buffer
(:class:`copejax.ops.kv_cache.RingCache`); ``dot_product_attention`` runs the schemes it can
express, ``kernel_attention`` those the fused Pallas kernels cover (:mod:`copejax.ops.kernels`,
:mod:`copejax.model.kernel_terms`). :class:`copejax.model.attention.Attention` calls them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.model.checks import kernel_config_refusal
from copejax.model.config import ModelConfig
from copejax.model.kernel_path import PATH, path_attention
from copejax.model.kernel_terms import (
    kernel_terms,
    part_term,
    relative_term,
    selective_term,
)
from copejax.model.kernel_xl import XL, xl_widened_qk
from copejax.model.measured_paths import measured_impl
from copejax.ops import engine_blocks
from copejax.ops.kernels.attention import MIN_BLOCK, fused_attention
from copejax.ops.kernels.tpu_params import kernel_backend
from copejax.positions.base import AttentionContext, AttentionSite, PositionScheme

# "auto" goes blockwise from this many keys on (self-attention: T = S; decoding: cache slots).
# Side-by-side probes on a 2-core CPU had the engine at or below the naive path from T = 256
# for nope, CoPE and FoX (causal block skipping halves the work); 512 keeps short task
# sequences on the simpler path.
AUTO_BLOCKWISE_FROM = 512
# On a GPU, "auto" keeps the naive path of a position-only scheme (the ones cuDNN's kernel
# can express) while its float32 (B, N, T, S) logits take at most this many bytes, and cuDNN's
# kernel with a position bias while the bias does: on an H200 (experiments/results/
# bench_gpu.md) the engine's block walk was 6.5x the naive nope layer at T = 4096 (B x N = 8,
# 512 MiB of logits), while at T = 16384 (8 GiB) the naive and biased fused paths pass the
# benchmark's 10 GiB buffer cap. Contextual schemes keep the length rule: their naive paths
# hold several (T, S) arrays each (CoPE 8 GiB, DAPE 11 GiB, PaTH 76 GiB at T = 4096 there).
GPU_NAIVE_MAX_BYTES = 2**30
# The fused kernels' tile length (queries and keys) when model.attention_block is None.
KERNEL_BLOCK = 64


def choose_impl(
    cfg: ModelConfig,
    length_k: int,
    sowing: bool,
    backend: str | None = None,
    pairs: int | None = None,
    *,
    decoding: bool = False,
) -> str:
    """The attention path of one call from ``model.attention_impl``.

    "auto": the naive path while intermediates (attention maps, gates) are being sown; the
    fastest path a benchmark measured for this backend, dtype and scheme at this length
    (:mod:`copejax.model.measured_paths`), where that path can run the call (the fused
    kernels: not for decoding, nor for a configuration they refuse); otherwise
    :func:`rule_impl`. ``decoding``: the call reads a KV cache.
    """
    impl = cfg.attention_impl
    if impl != "auto":
        return impl
    if sowing:
        return "naive"
    backend = jax.default_backend() if backend is None else backend
    found = measured_impl(backend, cfg.dtype, cfg.position, length_k)
    if found is not None and _can_take(cfg, found.impl, backend, decoding):
        return found.impl
    return rule_impl(cfg, length_k, backend, pairs)


def _can_take(cfg: ModelConfig, impl: str, backend: str, decoding: bool) -> bool:
    """Whether a measured path can run this call of ``cfg``'s layer (the kernels keep O(T)
    memory for every scheme they run, so the call's length does not matter)."""
    if impl == "dot_product_attention":
        return cfg.dot_product_attention_allowed()
    if impl != "kernel":
        return True
    if decoding or kernel_config_refusal(cfg) is not None:
        return False
    head_dim = cfg.resolved_head_dim
    return backend != "gpu" or (head_dim >= MIN_BLOCK and not head_dim & (head_dim - 1))


def rule_impl(cfg: ModelConfig, length_k: int, backend: str, pairs: int | None = None) -> str:
    """``auto``'s rules where no measurement of the call's scheme applies. On a GPU, with
    ``pairs`` = B N T S of the call, for the schemes cuDNN's kernel can express
    (``ModelConfig.dot_product_attention_allowed``): in bfloat16,
    ``jax.nn.dot_product_attention`` (cuDNN), for a scheme with a position bias only while
    that (B, N, T, S) bias takes at most ``GPU_NAIVE_MAX_BYTES``; otherwise the naive path
    while its float32 logits take at most ``GPU_NAIVE_MAX_BYTES``, and the blockwise engine
    beyond. Other schemes, other backends, or ``pairs`` unknown: the naive path below
    ``AUTO_BLOCKWISE_FROM`` keys, or the scheme's ``auto_blockwise_from`` (faster there on
    CPU, measured by ``experiments/bench.py``), and the blockwise engine from it on,
    decoding steps included (a step then reads the cache block by block)."""
    position_only = backend == "gpu" and cfg.dot_product_attention_allowed()
    if position_only and cfg.dtype == "bfloat16":
        no_bias = "bias" not in cfg.scheme.sites
        if no_bias or pairs is None or 2 * pairs <= GPU_NAIVE_MAX_BYTES:
            return "dot_product_attention"
    if position_only and pairs is not None:
        return "naive" if 4 * pairs <= GPU_NAIVE_MAX_BYTES else "blockwise"
    return "naive" if length_k < auto_blockwise_start(cfg.scheme) else "blockwise"


def auto_blockwise_start(scheme: PositionScheme | type[PositionScheme]) -> int:
    """From how many keys ``auto`` takes the blockwise engine on a CPU: the scheme's
    ``auto_blockwise_from``, or ``AUTO_BLOCKWISE_FROM``."""
    return scheme.auto_blockwise_from or AUTO_BLOCKWISE_FROM


def ring_cache_applies(cfg: ModelConfig) -> bool:
    """Whether the decode cache of ``cfg``'s layer is a ring buffer of ``window`` slots plus
    the sink slots (:class:`copejax.ops.kv_cache.RingCache`, read by
    :func:`copejax.model.ring_decode.decode_ring`): every window layer unless
    ``model.window_decode_cache`` is "full" (the full cache with the window mask). Every
    scheme's per-key decode state lives in the ring's slots (FoX's prefix sums, CoPE's gate
    keys, TAPE's position tensors, PaTH's rewritten keys, selective attention's penalties;
    stick-breaking reads the slots in key order); a scheme that cannot decode from a ring is
    refused with the reason (``copejax.model.ring_decode.check_ring``)."""
    return cfg.window is not None and cfg.window_decode_cache == "ring"


def dot_product_attention(
    site: AttentionSite,
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    v_BSNH: jax.Array,
    ctx: AttentionContext,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` with the scheme's position-only bias (ALiBi, T5,
    Kerple, FIRE), evaluated once over the whole (T, S) grid from the same block terms the
    engine uses; cuDNN on GPU for 16-bit inputs, XLA's implementation elsewhere."""
    bias_BNTS = None
    terms = site.block_terms(q_BTNH, k_BSNH, v_BSNH, ctx)
    if terms:
        pair = engine_blocks.PairBlock(
            q_BQNH=q_BTNH,
            k_BKNH=k_BSNH,
            q_positions_BQ=ctx.q_positions_BT,
            k_positions_BK=ctx.k_positions_BS,
            allowed_BQK=ctx.mask_BTS,
            logits_BNQK=None,
            q_arrays={},
            k_arrays={},
            q_start=jnp.asarray(ctx.cache_index),
            k_start=jnp.asarray(0),
        )
        bias_BNTS = sum(term.bias(term.params, pair, None, None)[0] for term in terms)
    fused = jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16)
    if fused and bias_BNTS is not None:  # cuDNN takes the inputs' dtype; XLA adds float32
        bias_BNTS = bias_BNTS.astype(q_BTNH.dtype)
    # One document per row: the kernel's own causal mask (and window), no (B, 1, T, S) mask
    # array, which cuDNN reads as a bias from memory (1 GiB at B = 2, T = 16384).
    plain = ctx.is_plain_causal()
    return jax.nn.dot_product_attention(
        q_BTNH,
        k_BSNH,
        v_BSNH,
        bias=bias_BNTS,
        mask=None if plain else ctx.mask_BTS[:, None, :, :],
        is_causal=plain,
        local_window_size=(ctx.window - 1, 0) if plain and ctx.window is not None else None,
        implementation="cudnn" if fused else None,
    )


def kernel_attention(
    cfg: ModelConfig,
    site: AttentionSite,
    qkv: tuple[jax.Array, jax.Array, jax.Array],
    kv_BSNH: tuple[jax.Array, jax.Array],
    ctx: AttentionContext,
    *,
    sink_N: jax.Array | None = None,
) -> jax.Array:
    """The fused kernels (``model.attention_impl="kernel"``): causal self-attention with the
    scheme's terms computed in the kernels (:mod:`copejax.model.kernel_terms`).

    Args:
      qkv: (q_BTNH, k_BSGH, v_BSGH): queries and the keys and values of the G key/value
        heads, as the qk site returned them (the kernels read head ``n // (N / G)``).
      kv_BSNH: the keys and values repeated to N heads, what ``block_terms`` reads.
      sink_N: GPT-OSS's attention sink logit per head (``model.attention_sink``), or None.

    Returns:
      y_BTNH. Refuses, naming what it cannot run: decoding (a KV cache), an explicit mask.
    """
    q_BTNH, k_BSGH, v_BSGH = qkv
    if ctx.decode:
        raise ValueError(
            "model.attention_impl='kernel' runs self-attention over a whole sequence; "
            "decoding reads a KV cache: use attention_impl='auto' or 'blockwise' to decode"
        )
    if ctx.explicit_mask_BTS is not None:
        raise ValueError(
            "model.attention_impl='kernel' reads segment ids; an explicit mask is for "
            "naive-path unit tests (use attention_impl='naive')"
        )
    backend = kernel_backend()
    block_terms = site.block_terms(q_BTNH, kv_BSNH[0], kv_BSNH[1], ctx)
    terms, cope = kernel_terms(cfg.scheme, block_terms, cfg.dims)
    xl = part_term(cfg.scheme, block_terms, XL)
    if xl is not None:  # its position term rides in the content matmul
        positions = {"q_positions_BT": ctx.q_positions_BT, "k_positions_BS": ctx.k_positions_BS}
        q_BTNH, k_BSGH = xl_widened_qk(*xl, q_BTNH, k_BSGH, **positions)
    q_ids_BT, _ = ctx.ids()
    block = cfg.attention_block or KERNEL_BLOCK
    normalizer = site.block_normalizer(ctx) or engine_blocks.SOFTMAX
    shared = {
        "q_positions_BT": ctx.q_positions_BT,
        "k_positions_BT": ctx.k_positions_BS,
        "segment_ids_BT": q_ids_BT,
        "terms": terms,
        "window": ctx.window,
        "sink_N": sink_N,
    }
    path = part_term(cfg.scheme, block_terms, PATH)
    if path is not None:  # the kernels between key chunks, XLA within them
        return path_attention(
            path[1], q_BTNH, k_BSGH, v_BSGH, block=block, backend=backend, **shared
        )
    return fused_attention(
        q_BTNH,
        k_BSGH,
        v_BSGH,
        sink_tokens=ctx.sink_tokens,
        k_rank_BT=ctx.key_ranks() if ctx.window is not None and ctx.sink_tokens else None,
        block_q=block,
        block_k=block,
        normalizer=normalizer.kind,
        include_self=normalizer.include_self,
        backend=backend,
        cope=cope,
        selective=selective_term(cfg.scheme),
        relative=relative_term(cfg.scheme, block_terms),
        **shared,
    )
