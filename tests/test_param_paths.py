"""Position sites' parameters live under their schemes' names, and runs saved under the old
paths (before 0.2.0) still load (``copejax.model.param_paths``).

``tests/old_param_paths.json`` holds the position-site parameters (path -> shape) that the
code before the rename (commit 1e0ea68) created for each listed config: written once by that
code, never regenerated. A config whose old paths :func:`param_paths.renames` misses, or maps
to the wrong module, fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

from copejax.model import param_paths
from copejax.model.transformer import Transformer
from copejax.positions import registry
from copejax.runtime import workdir
from copejax.runtime.checkpoint import Checkpointer, CheckpointMismatchError
from copejax.runtime.metrics import read_jsonl
from copejax.training import pretrained, train
from copejax.training.plan import validate
from copejax.training.trained_run import load_run
from tests.conftest import tiny_config, tokens_and_positions
from tests.train import tiny_task

OLD_PATHS = json.loads((Path(__file__).parent / "old_param_paths.json").read_text())
OLD_NAMES = ("own_site", "shared_positions", "position_embed")
TIMING = ("train/steps_per_sec", "train/tokens_per_sec")


def _case_id(case: dict[str, Any]) -> str:
    return case["position"] + ("-" + json.dumps(case["overrides"]) if case["overrides"] else "")


def _params(cfg: Any) -> Any:
    """The model's parameters as shapes (unboxed), without computing them."""
    tokens_BT, positions_BT = tokens_and_positions()
    rngs = {"params": jax.random.key(0), "positions": jax.random.key(1)}
    model = Transformer(cfg)
    abstract = jax.eval_shape(lambda: model.init(rngs, tokens_BT, positions_BT))
    return nn.unbox(abstract["params"])


def _init(cfg: Any, seed: int = 0) -> Any:
    """Random float32 arrays in the shapes of the model's parameters (no compilation)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), _params(cfg))


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    flat = traverse_util.flatten_dict(tree, sep="/")
    return {path: tuple(leaf.shape) for path, leaf in flat.items()}


@pytest.mark.parametrize("case", OLD_PATHS, ids=_case_id)
def test_old_paths_are_exactly_the_old_codes(case: dict[str, Any]) -> None:
    """Renamed back, today's parameters are what the old code created, site for site; the
    upgrade then gives today's tree again."""
    cfg = tiny_config(case["position"], **case["overrides"])
    new = _params(cfg)
    paths = param_paths.renames(cfg)
    old = param_paths.rename(new, param_paths.inverse(paths))
    old_shapes = _shapes(old)
    old_sites = {p: s for p, s in old_shapes.items() if any(n in p for n in OLD_NAMES)}
    assert old_sites == {p: tuple(s) for p, s in case["params"].items()}
    others = {p: s for p, s in old_shapes.items() if p not in old_sites}
    assert others.items() <= _shapes(new).items()
    assert _shapes(param_paths.upgrade(old, cfg)) == _shapes(new)
    assert not any(n in p for p in _shapes(new) for n in OLD_NAMES)
    assert param_paths.holds_old_paths(old, paths) == bool(old_sites)
    assert not param_paths.holds_old_paths(new, paths)


@pytest.mark.parametrize("scheme", registry.names())
def test_site_modules_are_named_after_their_scheme(scheme: str) -> None:
    """Built anywhere, a scheme's site modules carry its name; in the model its parameters
    are under that name, in each layer's attention or at the root (embed and shared sites)."""
    cfg = tiny_config(scheme)
    built = [cfg.scheme.embed_module(cfg.dims), cfg.scheme.attention_module(cfg.dims)]
    assert {m.name for m in built if m is not None} <= {scheme}
    paths = [p.split("/") for p in _shapes(_params(cfg))]
    layers = {f"block_{i}" for i in range(cfg.num_layers)}
    root = {p[0] for p in paths} - layers - {"token_embed", "final_norm", "lm_head"}
    attention = {p[2] for p in paths if p[1] == "attention"} - {"query", "key", "value", "out"}
    assert root | attention <= {scheme}


def test_a_combination_names_its_parts() -> None:
    cfg = tiny_config("t5+cope+relative")
    shapes = _shapes(_params(cfg))
    assert "t5/relative_bias" in shapes  # shared by the layers: at the root
    assert "block_1/attention/t5+cope+relative/cope/pos_emb" in shapes
    assert any(p.startswith("block_0/attention/t5+cope+relative/relative/") for p in shapes)
    with pytest.raises(ValueError, match=r"\['rope'\] appear more than once"):
        tiny_config("rope+alibi+rope")


def test_optimizer_state_is_renamed_with_the_parameters() -> None:
    cfg = tiny_config("learned+cope")
    params = _init(cfg)
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": 3}
    paths = param_paths.renames(cfg)
    old = param_paths.rename(state, param_paths.inverse(paths))
    mu = old["opt_state"][0].mu
    assert set(mu) == set(old["params"]) >= {"position_embed", "block_0", "token_embed"}
    assert "sites__0" in mu["block_1"]["attention"]["own_site"]
    back = param_paths.upgrade(old, cfg)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, back, state)


def test_a_checkpoint_saved_under_the_old_paths_restores_and_loads(tmp_path: Path) -> None:
    """Resuming (Checkpointer.restore with the upgrade, into the current layout's abstract
    state and shardings) and reading a run's weights (load_run) from an old-layout workdir."""
    config = tiny_task.tiny_config("t5+cope")
    cfg = validate(config).model_config
    params = _init(cfg)
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    paths = param_paths.renames(cfg)
    workdir.write_json_atomic(tmp_path / workdir.CONFIG_FILE, workdir.config_to_dict(config))
    ckpt = Checkpointer(tmp_path / "checkpoints", 2, asynchronous=False)
    try:
        ckpt.save(3, param_paths.rename(state, param_paths.inverse(paths)), None, {}, {})
        ckpt.wait()
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state
        )
        with pytest.raises(CheckpointMismatchError, match="shared_positions_0"):
            ckpt.restore(3, abstract, None)  # without the upgrade: a mismatch, named
        restored = ckpt.restore(3, abstract, None, param_paths.checkpoint_upgrade(cfg))
    finally:
        ckpt.close()
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    loaded = load_run(tmp_path).params  # evaluation, sampling, plots and init_from read so
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def _old_layout_saves(monkeypatch: pytest.MonkeyPatch, position: str) -> None:
    """Checkpointer.save writes the train state under the old parameter paths."""
    save = Checkpointer.save
    cfg = validate(tiny_task.tiny_config(position)).model_config
    back = param_paths.inverse(param_paths.renames(cfg))

    def save_old(self: Checkpointer, step: int, state: Any, *args: Any, **kwargs: Any) -> None:
        old = state.replace(
            params=param_paths.rename(state.params, back),
            opt_state=param_paths.rename(state.opt_state, back),
        )
        save(self, step, old, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", save_old)


@pytest.mark.slow
def test_a_run_saved_under_the_old_paths_resumes_and_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """t5+cope: a shared part at the root and a combination's second part in each layer."""
    position = "t5+cope"
    full, part = tmp_path / "full", tmp_path / "part"
    train.run(tiny_task.tiny_config(position), full)
    with monkeypatch.context() as patch:
        _old_layout_saves(patch, position)
        train.run(tiny_task.tiny_config(position), part, stop_after=3)
    saved = Checkpointer(part / "checkpoints", 5, asynchronous=False)
    metadata = saved.manager.item_metadata(3)["state"]
    saved.close()
    written = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(metadata)[0]
    ]
    old_paths = [p for p in written if "['shared_positions_0']" in p or "['sites__1']" in p]
    assert any(p.startswith("['params']") for p in old_paths)
    assert any(p.startswith("['opt_state']") for p in old_paths)  # Adam's moments too
    old_run = load_run(part, step=3)  # evaluation, sampling, plots and init_from read it so
    new_run = load_run(full, step=3)
    assert jax.tree.structure(old_run.params) == jax.tree.structure(new_run.params)
    jax.tree.map(np.testing.assert_array_equal, old_run.params, new_run.params)
    train.run(tiny_task.tiny_config(position), part)  # resumes from the old-layout checkpoint
    records = [
        [
            {k: v for k, v in r.items() if k not in TIMING}
            for r in read_jsonl(root / "metrics.jsonl")
        ]
        for root in (full, part)
    ]
    assert records[0] == records[1]


def test_a_checkpoint_converted_under_the_old_paths_loads(tmp_path: Path) -> None:
    cfg = tiny_config("learned+fox", vocab_size=259, max_len=64)
    params = _init(cfg)
    old = param_paths.rename(params, param_paths.inverse(param_paths.renames(cfg)))
    assert "position_embed" in old and "own_site" in old["block_0"]["attention"]
    block = pretrained.block_of(cfg)
    pretrained.save(tmp_path / "converted", block, cfg.vocab_size, old, "a test")
    loaded = pretrained.load(tmp_path / "converted")
    assert jax.tree.structure(loaded.params) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)
