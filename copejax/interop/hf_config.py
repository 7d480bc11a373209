"""Hugging Face Llama ``config.json`` <-> a copejax ``model`` block, both directions.

The Llama architecture (Touvron et al. 2023, arXiv 2302.13971; transformers' ``LlamaConfig``)
is copejax's ``block="llama"``: pre-RMSNorm, SwiGLU, no biases, grouped key/value heads
(``num_key_value_heads`` -> ``num_kv_heads``), RoPE in the rotate-half layout (``layout="half"``)
with HF's ``rope_scaling`` / ``rope_parameters`` mapped to copejax's RoPE options
(``copejax/positions/rope_frequencies.py``). Both spellings of the RoPE settings are read: the
``rope_theta`` + ``rope_scaling`` of transformers 4 checkpoints and the ``rope_parameters`` that
transformers 5 writes. Every key of ``config.json`` is either mapped, checked to hold the value
copejax computes with, or listed in ``IGNORED`` (token ids, caching, bookkeeping: no effect on
the logits); anything else is refused by name, so nothing is dropped silently.

SmolLM3 (``model_type="smollm3"``) is the same architecture with NoPE layers
(``no_rope_layers``: 1 rotates, 0 does not; Hugging Face 2025): all 1 is ``rope``, all 0 is
``nope`` and a mix is a ``layer_pattern`` of ``rope`` and ``nope`` layers. copejax writes NoPE
and rope/nope patterns in that form, since Llama's config cannot turn RoPE off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# Keys that do not change the forward pass of the logits.
IGNORED = (
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tokenizer_class",
    "model_type",
    "initializer_range",
)
# Keys that must hold the value copejax computes with: (key, allowed value, why).
FIXED = (
    ("hidden_act", "silu", "copejax's llama block is SwiGLU with SiLU"),
    ("attention_bias", False, "copejax's llama block has no q/k/v/o biases"),
    ("mlp_bias", False, "copejax's llama block has no MLP biases"),
    ("pretraining_tp", 1, "tensor-parallel slicing of the projections is not implemented"),
    ("attention_dropout", 0.0, "copejax has no attention-weight dropout"),
    ("partial_rotary_factor", 1.0, "Llama rotates every feature"),
)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# rope_parameters keys each HF rope_type reads (besides rope_type / type and rope_theta).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "short_factor",
        "long_factor",
    ),
}


MODEL_TYPES = ("llama", "smollm3")
_DEFAULT_THETA = {"llama": 10000.0, "smollm3": 2000000.0}  # transformers' defaults
_DEFAULT_TIED = {"llama": False, "smollm3": True}
# SmolLM3's keys: which layers rotate, and its sliding window (not converted).
_SMOLLM3_KEYS = (
    "no_rope_layers",
    "no_rope_layer_interval",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
)


def _rope_key(hf: Mapping[str, Any]) -> str:
    """The key that holds the checkpoint's RoPE settings, as its messages name it."""
    return "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"


def _rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings in transformers 5's form, from either spelling."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    if params and legacy:
        raise ValueError("config.json has both rope_parameters and rope_scaling; keep one")
    params = params or legacy
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        default = _DEFAULT_THETA.get(hf.get("model_type"), 10000.0)
        params["rope_theta"] = hf.get("rope_theta", default)
    return params


def _original_len(hf: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    # As transformers' standardize_rope_params: a top-level original_max_position_embeddings
    # (Phi-3) wins, then rope_parameters', then max_position_embeddings.
    if hf.get("original_max_position_embeddings") is not None:
        return int(hf["original_max_position_embeddings"])
    if params.get("original_max_position_embeddings") is not None:
        return int(params["original_max_position_embeddings"])
    return int(hf["max_position_embeddings"])


def _yarn_attention_factor(params: Mapping[str, Any], factor: float) -> float | None:
    """HF's attention factor from mscale / mscale_all_dim (DeepSeek); None: copejax's own
    0.1 ln s + 1, which is HF's value without them."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        get = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        return float(get(mscale) / get(mscale_all_dim))
    return None


def rope_options(hf: Mapping[str, Any]) -> dict[str, Any]:
    """copejax ``rope`` options reproducing the checkpoint's RoPE (HF ``ROPE_INIT_FUNCTIONS``).

    Raises:
      ValueError: an unknown ``rope_type`` or a RoPE key that type does not read.
    """
    params = _rope_parameters(hf)
    key = _rope_key(hf)
    written = hf.get(key) or {}
    field = "type" if "type" in written and "rope_type" not in written else "rope_type"
    rope_type = params.pop("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{key}.{field}={rope_type!r} has no copejax equivalent; allowed: {list(ROPE_TYPES)}"
        )
    options: dict[str, Any] = {"base": float(params.pop("rope_theta")), "layout": "half"}
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"rope partial_rotary_factor={params['partial_rotary_factor']!r}: Llama rotates "
            "every feature; allowed: 1.0"
        )
    params.pop("partial_rotary_factor", None)
    unread = sorted(set(params) - set(_ROPE_KEYS[rope_type]))
    if unread:
        raise ValueError(
            f"{key} keys {unread} are not read by rope_type={rope_type!r} (it reads "
            f"{list(_ROPE_KEYS[rope_type])}); refusing rather than dropping them"
        )
    if rope_type == "default":
        return options
    max_len = int(hf["max_position_embeddings"])
    factor = params.get("factor")
    if rope_type in ("linear", "dynamic"):
        options.update(scaling=rope_type, factor=float(factor))
        if rope_type == "dynamic":  # HF's dynamic L is the top-level max_position_embeddings
            options["original_max_len"] = max_len
        return options
    original = _original_len(hf, params)
    if factor is None:  # DeepSeek / Phi-3 derive it from the two lengths
        factor = max_len / original
    options.update(scaling=rope_type, factor=float(factor), original_max_len=original)
    if rope_type == "yarn":
        options.update(
            yarn_ramp="index",
            yarn_beta=float(params.get("beta_fast") or 32),
            yarn_alpha=float(params.get("beta_slow") or 1),
            yarn_truncate=bool(params.get("truncate", True)),
        )
        attention = _yarn_attention_factor(params, float(factor))
        if attention is not None:
            options["attention_factor"] = attention
    elif rope_type == "llama3":
        options.update(
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    else:  # longrope
        options.update(
            short_factor=tuple(float(v) for v in params["short_factor"]),
            long_factor=tuple(float(v) for v in params["long_factor"]),
        )
        if params.get("attention_factor") is not None:
            options["attention_factor"] = float(params["attention_factor"])
    return options


def model_block_from_hf(hf: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(copejax ``model`` block, vocabulary size) of a Llama ``config.json``.

    Raises:
      ValueError: naming the first key that copejax cannot reproduce.
    """
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r}: copejax.interop.convert reads Llama-architecture "
            "checkpoints; "
            f"allowed: {list(MODEL_TYPES)}"
        )
    for key, allowed, why in FIXED:
        if key in hf and hf[key] != allowed:
            raise ValueError(f"{key}={hf[key]!r} cannot be converted: {why}; allowed: {allowed!r}")
    heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or d_model // heads)
    block = {
        "block": "llama",
        "d_model": d_model,
        "num_heads": heads,
        "num_layers": int(hf["num_hidden_layers"]),
        "head_dim": head_dim,
        "mlp_dim": int(hf["intermediate_size"]),
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", _DEFAULT_TIED[model_type])),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "max_len": int(hf["max_position_embeddings"]),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "position": "rope",
        "position_options": rope_options(hf),
    }
    if model_type == "smollm3":
        block.update(_nope_layers(hf, block["num_layers"], block["position_options"]))
    mapped = {
        "hidden_size", "num_attention_heads", "num_hidden_layers", "head_dim",
        "intermediate_size", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps",
        "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
        "original_max_position_embeddings", "vocab_size",
    }  # fmt: skip
    known = mapped | set(IGNORED) | {key for key, _, _ in FIXED}
    if model_type == "smollm3":
        known |= set(_SMOLLM3_KEYS)
    unknown = sorted(set(hf) - known)
    if unknown:
        raise ValueError(
            f"config.json keys {unknown} have no copejax equivalent; refusing rather than "
            "dropping them"
        )
    return block, int(hf["vocab_size"])


def _nope_layers(hf: Mapping[str, Any], num_layers: int, rope: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's layers without RoPE as copejax's position / layer_pattern."""
    if hf.get("use_sliding_window"):
        raise ValueError(
            "use_sliding_window=true: SmolLM3's sliding-window layers are not converted; "
            "allowed: false"
        )
    flags = hf.get("no_rope_layers")
    if flags is None:  # transformers' default: every interval-th layer is NoPE
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(
            f"no_rope_layers={flags!r}: allowed: {num_layers} entries of 0 (NoPE) or 1 (RoPE)"
        )
    if all(flags):
        return {}
    if not any(flags):  # no layer reads the RoPE settings
        return {"position": "nope", "position_options": {}}
    return {"layer_pattern": ["rope" if f else "nope" for f in flags], "position_options": rope}


def _rope_parameters_to_hf(
    options: Mapping[str, Any], head_dim: int, max_len: int
) -> dict[str, Any]:
    """HF ``rope_parameters`` for copejax ``rope`` options; refuses what HF cannot express."""
    from copejax.positions.rope import RoPE

    rope = RoPE(**dict(options))
    if rope.layout != "half" or rope.fraction != 1.0 or rope.p != 1.0:
        raise ValueError(
            f"rope layout={rope.layout!r}, fraction={rope.fraction!r}, p={rope.p!r}: HF Llama "
            "rotates every feature in the rotate-half layout; allowed: layout='half', "
            "fraction=1.0, p=1.0"
        )
    if rope.current_len is not None:
        raise ValueError(
            f"rope current_len={rope.current_len!r}: HF reads the length of each call; "
            "allowed: None"
        )
    base = rope.base
    if rope.scaling == "ntk":  # a change of base, which plain RoPE expresses exactly
        return {
            "rope_type": "default",
            "rope_theta": base * rope.factor ** (head_dim / (head_dim - 2)),
        }
    out: dict[str, Any] = {"rope_type": rope.scaling, "rope_theta": base}
    if rope.scaling == "none":
        out["rope_type"] = "default"
        return out
    out["factor"] = rope.factor
    if rope.scaling in ("yarn", "llama3", "longrope"):
        out["original_max_position_embeddings"] = rope.original_max_len or max_len
    if rope.scaling == "yarn":
        if rope.yarn_ramp != "index":
            raise ValueError(
                "rope yarn_ramp='wavelength' (the paper's ramp) differs from HF's yarn, which "
                "ramps over the pair index; allowed: yarn_ramp='index'"
            )
        out.update(beta_fast=rope.yarn_beta, beta_slow=rope.yarn_alpha, truncate=rope.yarn_truncate)
    elif rope.scaling == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    elif rope.scaling == "longrope":
        out.update(short_factor=list(rope.short_factor), long_factor=list(rope.long_factor))
    if rope.attention_factor is not None and rope.scaling in ("yarn", "longrope"):
        out["attention_factor"] = rope.attention_factor
    return out


def hf_from_model_block(model: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """A Llama ``config.json`` (transformers 5 form) for a copejax ``model`` block.

    Raises:
      ValueError: naming what HF's Llama cannot express (another block, scheme, a window, ...).
    """
    from copejax.model.config import ModelConfig
    from copejax.positions.rope import RoPE

    cfg = ModelConfig.from_config(dict(model), vocab_size=vocab_size, default_max_len=0)
    if cfg.block != "llama":
        raise ValueError(f"block={cfg.block!r}: HF Llama is block='llama'")
    layers = [cfg.for_layer(i) for i in range(cfg.num_layers)]
    schemes = {layer.position for layer in layers}
    if not schemes <= {"rope", "nope"}:
        raise ValueError(
            f"position={cfg.position!r}, layers {sorted(schemes)}: HF's Llama computes RoPE "
            "(copejax 'rope' with any HF rope_type) and SmolLM3 RoPE or NoPE per layer; other "
            "schemes have no HF form"
        )
    rotating = {layer.scheme for layer in layers if layer.position == "rope"}
    if len(rotating) > 1:
        raise ValueError("the rope layers differ in their options; HF has one RoPE per model")
    defaults = ModelConfig(vocab_size=vocab_size)
    for key in ("window", "attention_sink", "logit_scaling"):
        if any(getattr(layer, key) != getattr(defaults, key) for layer in layers):
            raise ValueError(f"model.{key}: HF Llama has no such option")
    rope = next(iter(rotating)) if rotating else RoPE()
    options = {f.name: getattr(rope, f.name) for f in dataclasses.fields(rope)}
    max_len = cfg.max_len
    if rope.scaling == "dynamic":  # HF's dynamic NTK reads L from max_position_embeddings
        max_len = rope.original_max_len or cfg.max_len
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.resolved_mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.resolved_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "max_position_embeddings": max_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "rope_parameters": _rope_parameters_to_hf(options, cfg.resolved_head_dim, cfg.max_len),
        "dtype": "float32",
        # copejax keeps no special token ids (the tokenizer's); None, not the class defaults
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if schemes != {"rope"}:
        flags = [int(layer.position == "rope") for layer in layers]
        hf.update(
            architectures=["SmolLM3ForCausalLM"],
            model_type="smollm3",
            no_rope_layers=flags,
            use_sliding_window=False,
        )
    return hf
