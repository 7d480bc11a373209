"""copejax.interop.convert against transformers: a tiny random Llama saved with ``save_pretrained``,
converted, and run by both (float32 logits within 1e-4) for every ``rope_scaling`` type
copejax maps, with grouped KV heads, tied and untied embeddings; HF -> copejax -> HF gives the
same tensors bit for bit; what cannot be converted is refused by name.

One random model is made per module (``hf_llama``); the variants rewrite its ``config.json``
(and, for tied embeddings, its tensors) in their own directories.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from copejax.interop import convert, hf_config  # noqa: E402
from copejax.model import checks  # noqa: E402
from copejax.model.config import ModelConfig  # noqa: E402
from copejax.model.transformer import Transformer  # noqa: E402
from copejax.training import pretrained  # noqa: E402

BASE = {
    "vocab_size": 61,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention: 2 query heads per key/value head
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.15,  # larger than 0.02 so that the logits are far from uniform
    "tie_word_embeddings": False,
}
LENGTH = 48  # past max_position_embeddings and every original length below

# name -> the rope settings of config.json, in transformers 5's rope_parameters form unless
# the name says "legacy" (rope_theta + rope_scaling, as transformers 4 checkpoints have).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
        }
    },
    "yarn_mscale": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 0.8,
            "mscale_all_dim": 0.5,
        }
    },
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "longrope": {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.0, 1.7, 3.1, 4.7],
        }
    },
    "legacy_linear": {"rope_theta": 2000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    # SmolLM3: Llama with NoPE layers (no_rope_layers: 1 rotates, 0 does not)
    "smollm3_mixed": {
        "model_type": "smollm3",
        "no_rope_layers": [1, 0],
        "rope_parameters": {"rope_type": "default", "rope_theta": 300.0},
    },
    "smollm3_nope": {
        "model_type": "smollm3",
        "no_rope_layers": [0, 0],
        "rope_parameters": {"rope_type": "default", "rope_theta": 300.0},
    },
}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One random Llama (GQA, untied) saved with save_pretrained."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**BASE)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random norm scales, so that a swapped norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
    root = tmp_path_factory.mktemp("hf") / "base"
    model.save_pretrained(root)
    return root


def _variant(base: Path, tmp_path: Path, rope: dict[str, Any], **changes: Any) -> Path:
    root = tmp_path / "variant"
    shutil.copytree(base, root)
    hf = json.loads((root / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        hf.pop(key, None)
    hf.update(rope, **changes)
    if hf.get("model_type") == "smollm3":
        hf["architectures"] = ["SmolLM3ForCausalLM"]
    (root / "config.json").write_text(json.dumps(hf))
    return root


def _tokens(length: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, length))


def _hf_logits(root: Path, tokens_BT: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens_BT)).logits.numpy()


def _copejax_logits(root: Path, tokens_BT: np.ndarray) -> np.ndarray:
    model, vocab_size, params = convert.read_hf(root)
    cfg = checks.validate(ModelConfig.from_config(model, vocab_size=vocab_size, default_max_len=0))
    positions_BT = np.broadcast_to(np.arange(tokens_BT.shape[1]), tokens_BT.shape)
    logits = Transformer(cfg).apply(
        {"params": params}, jnp.asarray(tokens_BT), jnp.asarray(positions_BT)
    )
    return np.asarray(logits)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_equal_transformers(hf_llama: Path, tmp_path: Path, name: str) -> None:
    root = _variant(hf_llama, tmp_path, VARIANTS[name])
    for length in (LENGTH, 6):  # longrope: long factors past L = 8, short ones below
        tokens_BT = _tokens(length)
        expected = _hf_logits(root, tokens_BT)
        assert np.abs(expected).max() > 1.0  # not a near-uniform model
        np.testing.assert_allclose(_copejax_logits(root, tokens_BT), expected, atol=1e-4, rtol=0)


def test_tied_embeddings(hf_llama: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    root = _variant(hf_llama, tmp_path, VARIANTS["default"], tie_word_embeddings=True)
    tensors = load_file(str(root / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    model, _, params = convert.read_hf(root)
    assert model["tie_embeddings"] and "lm_head" not in params
    tokens_BT = _tokens(LENGTH)
    expected = _hf_logits(root, tokens_BT)
    np.testing.assert_allclose(_copejax_logits(root, tokens_BT), expected, atol=1e-4, rtol=0)


def test_tape_retrofit_of_a_converted_llama_equals_transformers(
    hf_llama: Path, tmp_path: Path
) -> None:
    """HF -> copejax -> TAPE (copejax.training.finetune, W2 = 0): the logits at step 0 are HF's."""
    from copejax.training import finetune

    root = _variant(hf_llama, tmp_path, VARIANTS["default"])
    converted = convert.from_hf(root, tmp_path / "converted")
    block = finetune.model_block_for(pretrained.read_model(converted)[0], "tape")
    cfg = checks.validate(ModelConfig.from_config(block, vocab_size=61, default_max_len=0))
    tokens_BT = _tokens(LENGTH)
    positions_BT = jnp.broadcast_to(jnp.arange(LENGTH), tokens_BT.shape)
    fresh = Transformer(cfg).init(jax.random.key(0), jnp.asarray(tokens_BT), positions_BT)
    params, log = finetune.initial_params(nn.meta.unbox(fresh["params"]), cfg, converted)
    assert "rope -> tape" in log
    logits = Transformer(cfg).apply({"params": params}, jnp.asarray(tokens_BT), positions_BT)
    np.testing.assert_allclose(np.asarray(logits), _hf_logits(root, tokens_BT), atol=1e-4, rtol=0)


def test_config_mapping(hf_llama: Path) -> None:
    """The model block names every architecture choice of the checkpoint."""
    model, vocab_size, _ = convert.read_hf(hf_llama)
    assert vocab_size == 61
    assert model["num_kv_heads"] == 2 and model["norm_eps"] == 1e-5
    assert model["block"] == "llama" and model["mlp_dim"] == 40 and not model["tie_embeddings"]
    assert model["position"] == "rope" and model["position_options"]["layout"] == "half"


def test_nope_layers_map_to_schemes(hf_llama: Path, tmp_path: Path) -> None:
    mixed, _, _ = convert.read_hf(_variant(hf_llama, tmp_path / "a", VARIANTS["smollm3_mixed"]))
    assert mixed["layer_pattern"] == ["rope", "nope"] and mixed["position"] == "rope"
    nope, _, _ = convert.read_hf(_variant(hf_llama, tmp_path / "b", VARIANTS["smollm3_nope"]))
    assert nope["position"] == "nope" and "layer_pattern" not in nope


@pytest.mark.parametrize(
    "name", ["default", "yarn_mscale", "llama3", "longrope", "smollm3_mixed", "smollm3_nope"]
)
def test_round_trip_is_exact(hf_llama: Path, tmp_path: Path, name: str) -> None:
    from safetensors.numpy import load_file

    root = _variant(hf_llama, tmp_path, VARIANTS[name])
    converted = convert.from_hf(root, tmp_path / "converted")
    back = convert.to_hf(converted, tmp_path / "back")
    before = load_file(str(root / "model.safetensors"))
    after = load_file(str(back / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and np.array_equal(after[key], value), key
    # The exported config.json computes the same model (its rope included).
    tokens_BT = _tokens(LENGTH)
    np.testing.assert_allclose(
        _hf_logits(back, tokens_BT), _hf_logits(root, tokens_BT), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "proportional"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": 16}, "sliding_window"),
        ({"model_type": "qwen2"}, "qwen2"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "beta_fast": 3}}, "beta_fast"),
    ],
)
def test_refuses_by_name(changes: dict[str, Any], named: str) -> None:
    hf = {**BASE, "model_type": "llama", **changes}
    with pytest.raises(ValueError, match=named):
        hf_config.model_block_from_hf(hf)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}},
            "rope_parameters keys ['beta_fast'] are not read by rope_type='linear'",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0, "beta_fast": 3}},
            "rope_scaling keys ['beta_fast'] are not read by rope_type='linear'",
        ),
        (
            {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
            "rope_parameters.rope_type='proportional' has no copejax equivalent",
        ),
        (
            {"rope_theta": 1e4, "rope_scaling": {"type": "proportional"}},
            "rope_scaling.type='proportional' has no copejax equivalent",
        ),
    ],
)
def test_rope_refusals_name_the_key_the_config_uses(rope: dict[str, Any], message: str) -> None:
    """A config.json in transformers 5's form (rope_parameters) is told about rope_parameters,
    one in transformers 4's (rope_scaling) about rope_scaling, as each wrote its fields."""
    with pytest.raises(ValueError) as refused:
        hf_config.model_block_from_hf({**BASE, "model_type": "llama", **rope})
    assert message in str(refused.value)
    other = "rope_scaling" if "rope_parameters" in rope else "rope_parameters"
    assert other not in str(refused.value)


def test_refuses_extra_tensors(hf_llama: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    root = _variant(hf_llama, tmp_path, VARIANTS["default"])
    tensors = load_file(str(root / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        convert.read_hf(root)


def test_export_refuses_what_hf_cannot_express(tmp_path: Path) -> None:
    block = {"d_model": 16, "num_heads": 2, "num_layers": 2, "max_len": 16}
    params = {"unused": np.zeros(1, np.float32)}
    path = pretrained.save(tmp_path / "cope", {**block, "position": "cope"}, 11, params, "test")
    with pytest.raises(ValueError, match="position='cope'"):
        convert.to_hf(path, tmp_path / "cope_hf")
    for refused, named in (
        ({"position_options": {"scaling": "yarn", "factor": 2.0}}, "yarn_ramp"),
        ({"position_options": {"layout": "interleaved"}}, "layout='interleaved'"),
        ({"layer_pattern": ["rope", "fox"]}, "fox"),
        ({"window": 4}, "window"),
        ({"block": "gpt2"}, "block='gpt2'"),
    ):
        with pytest.raises(ValueError, match=named):
            hf_config.hf_from_model_block({**block, **refused}, 11)
