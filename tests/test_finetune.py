"""Fine-tuning from pretrained weights with a change of position scheme (copejax.training.finetune).

A small random rope model stands for the pretrained weights (saved as a converted checkpoint);
rope -> tape gives identical logits at step 0 (TAPE's retrofit, arXiv 2501.00712 section 3.3),
rope -> fox+rope starts with forget gates near 1, rope -> cope+rope adds CoPE's tables, and the
log lists every added parameter; dropping a parameter or changing the architecture is refused.
One end-to-end run (slow) goes through ``configs/lm.py:init_from=...`` and
``copejax.training.train``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from copejax.config.base import load_config
from copejax.model import checks
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from copejax.training import finetune, pretrained, train
from copejax.training.trained_run import load_run

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 259  # the lm task's byte vocabulary (configs/lm.py)
SOURCE = {
    "d_model": 32,
    "num_heads": 2,
    "num_layers": 2,
    "max_len": 64,
    "tie_embeddings": False,
    "norm_eps": 1e-5,
    "position": "rope",
    "position_options": {"base": 500.0},
}


def _init(cfg: ModelConfig, seed: int) -> Any:
    tokens_BT = jnp.zeros((1, 4), jnp.int32)
    positions_BT = jnp.arange(4, dtype=jnp.int32)[None]
    variables = Transformer(cfg).init(jax.random.key(seed), tokens_BT, positions_BT)
    return jax.tree.map(np.asarray, nn_unbox(variables["params"]))


def nn_unbox(tree: Any) -> Any:
    import flax.linen as nn

    return nn.meta.unbox(tree)


def _cfg(block: dict[str, Any]) -> ModelConfig:
    return checks.validate(ModelConfig.from_config(block, vocab_size=VOCAB, default_max_len=64))


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    params = _init(_cfg(SOURCE), seed=1)
    root = tmp_path_factory.mktemp("pretrained") / "rope"
    return pretrained.save(root, SOURCE, VOCAB, params, "test")


def _logits(cfg: ModelConfig, params: Any, length: int = 40) -> np.ndarray:
    tokens_BT = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, length)), jnp.int32)
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (2, length))
    return np.asarray(Transformer(cfg).apply({"params": params}, tokens_BT, positions_BT))


def _finetune(source_dir: Path, position: str, **options: Any) -> tuple[ModelConfig, Any, str]:
    block = finetune.model_block_for(pretrained.read_model(source_dir)[0], position, options)
    cfg = _cfg(block)
    params, log = finetune.initial_params(_init(cfg, seed=2), cfg, source_dir)
    return cfg, params, log


def test_tape_retrofit_equals_rope_at_step_zero(source_dir: Path) -> None:
    source = pretrained.load(source_dir)
    expected = _logits(_cfg(SOURCE), source.params)
    cfg, params, log = _finetune(source_dir, "tape")
    assert cfg.position == "tape" and dict(cfg.position_options)["base"] == 500.0
    assert "rope -> tape" in log and "added block_0/attention/tape/" in log
    np.testing.assert_allclose(_logits(cfg, params), expected, atol=2e-5, rtol=0)
    # the copied parameters are the pretrained ones, bit for bit
    flat = traverse_util.flatten_dict(params)
    for path, value in source.flat_params().items():
        assert np.array_equal(flat[path], value), path


def test_rope_rescaling_copies_everything(source_dir: Path) -> None:
    cfg, params, log = _finetune(source_dir, "rope", scaling="linear", factor=4.0)
    assert dict(cfg.position_options) == {"base": 500.0, "factor": 4.0, "scaling": "linear"}
    assert "added 0" in log
    expected = pretrained.load(source_dir).flat_params()
    assert traverse_util.flatten_dict(params).keys() == expected.keys()


def test_fox_starts_with_gates_near_one(source_dir: Path) -> None:
    cfg, params, log = _finetune(source_dir, "fox+rope")
    options = dict(cfg.position_options)
    assert options["forget_bias_init"] == finetune.FORGET_BIAS_FINETUNE and options["base"] == 500
    added = [line for line in log.splitlines() if line.startswith("  added")]
    assert added and all("/attention/fox+rope/fox/" in line for line in added)
    biases = [v for p, v in traverse_util.flatten_dict(params).items() if p[-1] == "forget_b"]
    assert biases and all(np.all(jax.nn.sigmoid(b) > 0.99) for b in biases)
    # an explicit choice wins
    cfg, _, _ = _finetune(source_dir, "fox+rope", forget_bias_init=1.0)
    assert dict(cfg.position_options)["forget_bias_init"] == 1.0


def test_cope_adds_its_tables(source_dir: Path) -> None:
    _, params, log = _finetune(source_dir, "cope+rope", p_max=16)
    assert "rope -> cope+rope" in log and "added" in log
    assert any(
        "attention/cope+rope/cope/" in "/".join(p) for p in traverse_util.flatten_dict(params)
    )


def test_refusals(source_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no place in this model"):  # rope -> tape -> rope
        cfg, params, _ = _finetune(source_dir, "tape")
        tape_dir = pretrained.save(tmp_path / "tape", finetune_block(cfg), VOCAB, params, "t")
        rope_cfg = _cfg(SOURCE)
        finetune.initial_params(_init(rope_cfg, 0), rope_cfg, tape_dir)
    wider = _cfg({**SOURCE, "d_model": 64})
    with pytest.raises(ValueError, match="d_model=32"):
        finetune.initial_params(_init(wider, 0), wider, source_dir)
    other_vocab = ModelConfig.from_config(SOURCE, vocab_size=100, default_max_len=64)
    with pytest.raises(ValueError, match="vocabulary of 259 ids, this task 100"):
        finetune.check_source(source_dir, other_vocab)
    yarn = {**SOURCE, "position_options": {"scaling": "yarn", "factor": 2.0}}
    with pytest.raises(ValueError, match="retrofit cannot carry rope scaling='yarn'"):
        finetune.model_block_for(yarn, "tape")
    with pytest.raises(ValueError, match="no option 'p_maxx'"):
        finetune.model_block_for(SOURCE, "cope", {"p_maxx": 3})


def finetune_block(cfg: ModelConfig) -> dict[str, Any]:
    return pretrained.block_of(cfg)


@pytest.mark.slow  # about 25 s on 2 shared cores: compiles a TAPE train and eval step
def test_main_fine_tunes_with_a_new_scheme(
    source_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/lm.py:init_from=<dir>,position=tape through copejax.training.train: the first step's
    learning rate is 0 (warmup), so the saved step-1 weights are the pretrained ones."""
    config = load_config(
        ROOT / "configs" / "lm.py", f"smoke,init_from={source_dir},position=tape,hidden=4"
    )
    config.train.update(steps=1, eval_every=0, log_every=1, checkpoint_every=1)
    config.eval.max_examples = 16
    assert config.model.position == "tape" and config.model.d_model == 32
    assert config.train.init_from == str(source_dir)
    train.run(config, tmp_path / "run")
    out = capsys.readouterr().out
    assert "init_from" in out and "rope -> tape" in out and "added block_1/attention/tape/" in out
    run = load_run(tmp_path / "run")
    flat = traverse_util.flatten_dict(run.params)
    for path, value in pretrained.load(source_dir).flat_params().items():
        assert np.array_equal(flat[path], value), path
