"""Hugging Face Llama tensors <-> copejax parameters, both directions, exactly.

HF's ``nn.Linear`` stores (out, in) matrices; copejax's projections are (in, ...) kernels with
the head axes split out (``copejax.model.attention.Projection``); each projection's parameter is
its ``kernel``:

| HF tensor (shape) | copejax parameter (shape) |
|---|---|
| ``model.embed_tokens.weight`` (V, D) | ``token_embed/embedding`` (V, D) |
| ``model.layers.i.self_attn.q_proj.weight`` (N H, D) | ``block_i/attention/query`` (D, N, H) |
| ``...k_proj`` / ``...v_proj`` (K H, D) | ``.../key`` / ``.../value`` (D, K, H) |
| ``...o_proj.weight`` (D, N H) | ``.../out`` (N, H, D) |
| ``...mlp.gate_proj`` / ``...mlp.up_proj`` (F, D) | ``block_i/mlp/wi_gate`` / ``./wi_up`` (D, F) |
| ``model.layers.i.mlp.down_proj.weight`` (D, F) | ``block_i/mlp/wo`` (F, D) |
| ``model.layers.i.input_layernorm.weight`` (D,) | ``block_i/attention_norm/scale`` (D,) |
| ``model.layers.i.post_attention_layernorm.weight`` (D,) | ``block_i/mlp_norm/scale`` (D,) |
| ``model.norm.weight`` (D,) | ``final_norm/scale`` (D,) |
| ``lm_head.weight`` (V, D), untied only | ``lm_head`` (D, V) |

Only transposes and reshapes: float32 tensors go through unchanged, bit for bit. A tensor that
has no place here (a bias, an unknown name) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from copejax.model.config import ModelConfig

# (HF suffix inside a layer, copejax path inside block_i, kind) where kind says how to map.
_LAYER = (
    ("self_attn.q_proj.weight", ("attention", "query", "kernel"), "q"),
    ("self_attn.k_proj.weight", ("attention", "key", "kernel"), "kv"),
    ("self_attn.v_proj.weight", ("attention", "value", "kernel"), "kv"),
    ("self_attn.o_proj.weight", ("attention", "out", "kernel"), "o"),
    ("mlp.gate_proj.weight", ("mlp", "wi_gate", "kernel"), "t"),
    ("mlp.up_proj.weight", ("mlp", "wi_up", "kernel"), "t"),
    ("mlp.down_proj.weight", ("mlp", "wo", "kernel"), "t"),
    ("input_layernorm.weight", ("attention_norm", "scale"), "id"),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), "id"),
)
Path = tuple[str, ...]


def _names(cfg: ModelConfig) -> list[tuple[str, Path, str]]:
    """(HF name, copejax path, kind) of every tensor of ``cfg``'s Llama."""
    names = [("model.embed_tokens.weight", ("token_embed", "embedding"), "id")]
    for i in range(cfg.num_layers):
        for suffix, path, kind in _LAYER:
            names.append((f"model.layers.{i}.{suffix}", (f"block_{i}", *path), kind))
    names.append(("model.norm.weight", ("final_norm", "scale"), "id"))
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", ("lm_head", "kernel"), "t"))
    return names


def _to_copejax(weight: np.ndarray, kind: str, cfg: ModelConfig) -> np.ndarray:
    head_dim = cfg.resolved_head_dim
    if kind == "q":
        return weight.T.reshape(cfg.d_model, cfg.num_heads, head_dim)
    if kind == "kv":
        return weight.T.reshape(cfg.d_model, cfg.resolved_kv_heads, head_dim)
    if kind == "o":
        return weight.T.reshape(cfg.num_heads, head_dim, cfg.d_model)
    return weight.T if kind == "t" else weight


def _to_hf(param: np.ndarray, kind: str) -> np.ndarray:
    if kind in ("q", "kv"):  # (D, N, H) -> (N H, D)
        return param.reshape(param.shape[0], -1).T
    if kind == "o":  # (N, H, D) -> (D, N H)
        return param.reshape(-1, param.shape[-1]).T
    return param.T if kind == "t" else param


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[Path, np.ndarray]:
    """copejax parameters (flat, path -> array) from HF tensors (name -> array).

    A tied checkpoint may or may not store ``lm_head.weight``; when it does, it must equal the
    embedding (else the checkpoint is not tied and is refused).

    Raises:
      ValueError: a missing tensor, one with an unexpected shape, or one copejax has no place
        for (named).
    """
    left = dict(tensors)
    if cfg.tie_embeddings and "lm_head.weight" in left:
        head = left.pop("lm_head.weight")
        if not np.array_equal(head, left.get("model.embed_tokens.weight")):
            raise ValueError(
                "tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings=false in config.json"
            )
    params: dict[Path, np.ndarray] = {}
    for name, path, kind in _names(cfg):
        if name not in left:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        value = _to_copejax(np.asarray(left.pop(name)), kind, cfg)
        params[path] = value
    if left:
        raise ValueError(
            f"tensors {sorted(left)[:8]} have no place in copejax's llama block (no biases); "
            "refusing rather than dropping them"
        )
    return params


def params_to_hf(params: Mapping[Path, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors (name -> array) from copejax parameters (flat, path -> array).

    Raises:
      ValueError: a copejax parameter HF's Llama has no tensor for (e.g. a scheme's own
        parameters), named.
    """
    left = dict(params)
    tensors: dict[str, np.ndarray] = {}
    for name, path, kind in _names(cfg):
        if path not in left:
            raise ValueError(f"the copejax parameters have no {'/'.join(path)}")
        tensors[name] = np.ascontiguousarray(_to_hf(np.asarray(left.pop(path)), kind))
    if left:
        raise ValueError(
            f"parameters {['/'.join(p) for p in sorted(left)][:8]} have no HF Llama tensor"
        )
    return tensors
