"""Fine-tuning from pretrained weights (``train.init_from``), changing the position scheme.

``model_block_for`` builds the model block of a fine-tune from the pretrained one: the same
architecture, the scheme the user asks for. ``merge_params`` fills a freshly initialised model
with the pretrained weights: every parameter that both have is copied (same path and shape),
the new scheme's own parameters keep their initialisation, and the result lists what was
added. A pretrained parameter with no place in the new model is refused by name (nothing is
dropped silently), and so are architecture changes (sizes, block, norms, tying).

Scheme changes and how their new parameters start:

- rope -> rope with another ``scaling`` (PI, NTK, YaRN, Llama 3, ...): no new parameters.
- rope -> tape: TAPE's retrofit (Zhu et al. 2025, arXiv 2501.00712, section 3.3;
  ``copejax.training.tape_retrofit``): init="rope" with the pretrained base and layout and W2 = 0,
  so
  the model computes exactly what the rope model did at step 0. A rope scaling TAPE's initial
  state cannot carry is refused there.
- adding fox (``fox``, ``fox+rope``; Lin et al. 2025, arXiv 2503.02130): the forget gates are
  new; unless the user sets ``forget_bias_init``, it is ``FORGET_BIAS_FINETUNE`` so that every
  gate starts near 1 (sigmoid(5) = 0.993) and the pretrained attention is nearly unchanged at
  the start.
- adding cope (``cope+rope``; Golovneva et al. 2024, arXiv 2405.18719): its position tables
  and gate weights are new, initialised as the scheme initialises them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import traverse_util

from copejax.config import scheme_options
from copejax.model.config import ModelConfig
from copejax.training import pretrained

# FoX's forget-gate bias when fox is added to a pretrained model: gates near 1 at the start.
FORGET_BIAS_FINETUNE = 5.0
# ModelConfig fields that shape or compute the pretrained weights: a fine-tune keeps them.
ARCHITECTURE = (
    "block",
    "d_model",
    "num_heads",
    "num_layers",
    "resolved_head_dim",
    "resolved_mlp_dim",
    "resolved_kv_heads",
    "tie_embeddings",
    "norm_eps",
    "vocab_size",
)


def model_block_for(
    source: Mapping[str, Any], position: str | None = None, options: Mapping[str, Any] = ()
) -> dict[str, Any]:
    """The fine-tune's model block: ``source``'s architecture with scheme ``position``.

    Args:
      source: the pretrained model block (``model.json``'s ``model``).
      position: the new scheme; None keeps the pretrained one.
      options: the new scheme's options set by the user; the pretrained options the new
        scheme also declares carry over beneath them (rope's base, or all of them when the
        scheme stays); rope -> tape takes the retrofit's options.

    Raises:
      ValueError: an option the new scheme does not take, or a retrofit TAPE cannot do.
    """
    block = dict(source)
    old = block.get("position", "rope")
    new = position or old
    carried = dict(block.get("position_options") or {})
    options = dict(options)
    scheme_options.check(new, options)
    if old == "rope" and new == "tape":
        from copejax.training.tape_retrofit import tape_config_from_rope

        rope_cfg = ModelConfig.from_config(block, vocab_size=1, default_max_len=1)
        tape_cfg = tape_config_from_rope(rope_cfg, **options)
        block["position"], block["position_options"] = "tape", dict(tape_cfg.position_options)
        return block
    declared = scheme_options.scheme_defaults(new)
    merged = {k: v for k, v in carried.items() if k in declared}
    merged.update(options)
    if "fox" in new.split("+") and "fox" not in old.split("+"):
        merged.setdefault("forget_bias_init", FORGET_BIAS_FINETUNE)
    block["position"], block["position_options"] = new, merged
    return block


def _path(path: tuple[str, ...]) -> str:
    return "/".join(path)


def check_architecture(source: ModelConfig, target: ModelConfig) -> None:
    """Raises ValueError naming the first architecture field a fine-tune changed."""
    for key in ARCHITECTURE:
        before, after = getattr(source, key), getattr(target, key)
        if before != after and key == "vocab_size":
            raise ValueError(
                f"train.init_from: the pretrained model has a vocabulary of {before} ids, this "
                f"task {after}; fine-tune on a task that tokenizes with the checkpoint's "
                "tokenizer"
            )
        if before != after:
            name = key.removeprefix("resolved_")
            raise ValueError(
                f"train.init_from: the pretrained model has {name}={before!r}, this config "
                f"{name}={after!r}; a fine-tune keeps the architecture (configs/lm.py:"
                "init_from=<dir> copies the pretrained model block)"
            )


@dataclasses.dataclass(frozen=True)
class InitSource:
    """A checked ``train.init_from``: where the weights are and the model that computes them.

    Attributes:
      path: a converted checkpoint or a copejax workdir (``copejax.training.pretrained``).
      model_config: the pretrained model (its architecture is the fine-tune's).
    """

    path: Path
    model_config: ModelConfig


def check_source(init_from: str | os.PathLike, target: ModelConfig) -> InitSource:
    """Before any compute: ``init_from`` is readable and has ``target``'s architecture.

    Returns the checked source, which :func:`initial_params` then loads the weights of.
    """
    block, vocab_size = pretrained.read_model(init_from)
    source = ModelConfig.from_config(block, vocab_size=vocab_size, default_max_len=target.max_len)
    check_architecture(source, target)
    return InitSource(Path(init_from).absolute(), source)


def merge_params(fresh: Any, source: Any) -> tuple[Any, list[str], list[str]]:
    """The fresh parameters with every pretrained one copied in.

    Args:
      fresh: the new model's initial parameters (nested dict of arrays, unboxed).
      source: the pretrained parameters (nested dict of arrays).

    Returns:
      (parameters, copied paths, added paths: the new model's own, kept as initialised).

    Raises:
      ValueError: a pretrained parameter the new model lacks, or with another shape.
    """
    flat_new = traverse_util.flatten_dict(fresh)
    flat_old = traverse_util.flatten_dict(source)
    for path, value in flat_old.items():
        if path not in flat_new:
            raise ValueError(
                f"train.init_from: pretrained parameter {_path(path)} has no place in this "
                "model; a fine-tune may add a scheme's parameters but not drop any"
            )
        if tuple(np.shape(flat_new[path])) != tuple(np.shape(value)):
            raise ValueError(
                f"train.init_from: pretrained parameter {_path(path)} has shape "
                f"{np.shape(value)}, this model's {np.shape(flat_new[path])}"
            )
    merged = {
        path: np.asarray(flat_old[path], np.asarray(leaf).dtype) if path in flat_old else leaf
        for path, leaf in flat_new.items()
    }
    copied = sorted(_path(p) for p in flat_old)
    added = sorted(_path(p) for p in flat_new if p not in flat_old)
    return traverse_util.unflatten_dict(merged), copied, added


def initial_params(
    fresh: Any, target: ModelConfig, init_from: InitSource | str | os.PathLike
) -> tuple[Any, str]:
    """``merge_params`` of ``init_from``'s weights into ``fresh``, after the architecture check
    (done by :func:`check_source` when ``init_from`` is a path; an InitSource is checked).

    Returns the parameters and the lines to log (source, counts, every added parameter).
    """
    if not isinstance(init_from, InitSource):
        init_from = check_source(init_from, target)
    source = pretrained.load(init_from.path)
    source_cfg = init_from.model_config
    params, copied, added = merge_params(fresh, source.params)
    change = (
        f"{source_cfg.position} -> {target.position}"
        if source_cfg.scheme != target.scheme
        else f"{target.position} (unchanged)"
    )
    lines = [
        f"init_from {source.source}: scheme {change}; copied {len(copied)} parameters, "
        f"added {len(added)}" + (":" if added else "")
    ]
    lines += [f"  added {path}" for path in added]
    return params, "\n".join(lines)
