"""Pretrained weights on disk: a converted checkpoint, or a copejax training run's workdir.

A converted checkpoint (written by ``python -m copejax.interop.convert``) is a directory with

    model.json   {"model": <a copejax model block>, "vocab_size": V, "source": <where from>}
    params/      the parameters, an orbax checkpoint (``ocp.StandardCheckpointer``)

``model.json``'s ``model`` block is the config that reproduces the model: put it in a
config's ``model`` (``configs/lm.py:init_from=<dir>`` does) and set ``train.init_from`` to the
directory to fine-tune from it. :func:`load` also reads a copejax workdir (its latest
checkpoint), so a run's own weights are a starting point too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from copejax.model import param_paths
from copejax.model.config import ModelConfig
from copejax.runtime import workdir

MODEL_FILE = "model.json"
PARAMS_DIR = "params"


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """Weights and the model block that computes with them.

    Attributes:
      model: the copejax ``model`` config block (plain JSON data).
      vocab_size: V.
      params: nested dict of numpy arrays (unboxed), as ``Transformer.init(...)["params"]``.
      source: where they came from (a path and what it was), for the logs.
    """

    model: dict[str, Any]
    vocab_size: int
    params: Any
    source: str

    def flat_params(self) -> dict[tuple[str, ...], np.ndarray]:
        return traverse_util.flatten_dict(self.params)


def block_of(cfg: ModelConfig) -> dict[str, Any]:
    """The ``model`` config block of a resolved ModelConfig (plain JSON data)."""
    block = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    block.pop("vocab_size")
    block["position_options"] = {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in cfg.position_options
    }
    block["layer_pattern"] = list(cfg.layer_pattern)
    return block


def save(
    out_dir: str | os.PathLike,
    model: dict[str, Any],
    vocab_size: int,
    params: Any,
    source: str,
) -> Path:
    """Writes ``model.json`` and ``params/`` into ``out_dir`` (which must not hold them yet).

    Raises:
      ValueError: ``out_dir`` already holds a converted checkpoint.
    """
    root = Path(out_dir).absolute()
    if (root / MODEL_FILE).exists() or (root / PARAMS_DIR).exists():
        raise ValueError(f"{root} already holds a converted checkpoint; choose another --out")
    root.mkdir(parents=True, exist_ok=True)
    arrays = jax.tree.map(np.asarray, params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / PARAMS_DIR, arrays)
    checkpointer.wait_until_finished()
    checkpointer.close()
    record = {"model": model, "vocab_size": int(vocab_size), "source": source}
    workdir.write_json_atomic(root / MODEL_FILE, record)
    return root


def is_converted(path: str | os.PathLike) -> bool:
    return (Path(path) / MODEL_FILE).exists()


def read_model(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(model block, V) of a converted checkpoint or workdir, without reading the weights.

    Raises:
      ValueError: ``path`` is neither (named).
    """
    root = Path(path).absolute()
    if is_converted(root):
        record = json.loads((root / MODEL_FILE).read_text(encoding="utf-8"))
        return record["model"], int(record["vocab_size"])
    saved = workdir.read_config(root)
    if saved is None:
        raise ValueError(_neither(root))
    import ml_collections

    from copejax.training.trained_run import run_model

    cfg = run_model(ml_collections.ConfigDict(saved))[1]
    return block_of(cfg), cfg.vocab_size


def _neither(root: Path) -> str:
    return (
        f"{root} holds neither {MODEL_FILE} (a checkpoint converted by python -m "
        f"copejax.interop.convert) nor {workdir.CONFIG_FILE} (a copejax workdir)"
    )


def load(path: str | os.PathLike) -> Pretrained:
    """A converted checkpoint or a copejax workdir's latest checkpoint, with today's parameter
    paths (``copejax.model.param_paths``) when it was written before 0.2.0.

    Raises:
      ValueError: ``path`` is neither (named).
    """
    root = Path(path).absolute()
    if is_converted(root):
        record = json.loads((root / MODEL_FILE).read_text(encoding="utf-8"))
        checkpointer = ocp.StandardCheckpointer()
        try:
            params = checkpointer.restore(root / PARAMS_DIR)
        finally:
            checkpointer.close()
        params = jax.tree.map(np.asarray, params)
        vocab_size = int(record["vocab_size"])
        # Converted before 0.2.0: today's parameter paths (the names do not read max_len).
        cfg = ModelConfig.from_config(record["model"], vocab_size=vocab_size, default_max_len=1)
        params = param_paths.upgrade(params, cfg)
        return Pretrained(record["model"], vocab_size, params, f"{root} (converted)")
    if workdir.read_config(root) is not None:
        from copejax.training.trained_run import load_run

        run = load_run(root)
        model = block_of(run.model_config)
        params = jax.tree.map(np.asarray, run.params)
        source = f"{root} (copejax run, step {run.step})"
        return Pretrained(model, run.model_config.vocab_size, params, source)
    raise ValueError(_neither(root))
