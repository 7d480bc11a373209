"""TAPE as parameter-efficient fine-tuning of a RoPE model (Zhu et al. 2025, arXiv 2501.00712,
section 3.3).

RoPE is TAPE with L = R = 2 rotation embeddings, so a trained ``rope`` model becomes a ``tape``
model by keeping every parameter and adding TAPE's, with W2 = 0 so that the converted model
computes exactly what the original did. Fine-tuning then trains only the TAPE parameters:

    tape_cfg = tape_config_from_rope(rope_cfg)
    tape_params = retrofit_rope_params(rope_params, tape_cfg, jax.random.key(0))
    tx = optax.masked(optax.adamw(1e-4), tape_param_mask(tape_params))

(or ``optax.multi_transform`` with the mask mapped to labels). The frozen parameters should
also be kept out of the update, e.g. by chaining ``optax.masked(optax.set_to_zero(), ...)``
with the negated mask, since ``optax.masked`` passes the unmasked updates through.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.core import meta

from copejax.model import checks
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer

# Modules that hold TAPE's parameters: the per-layer attention site and the embed site, both
# named after the scheme (copejax.model.param_paths).
TAPE_MODULES = ("tape",)


def tape_config_from_rope(rope_cfg: ModelConfig, **tape_options: Any) -> ModelConfig:
    """The ``tape`` config (init="rope") equivalent to a ``rope`` config at conversion.

    The RoPE base and pair layout carry over; ``tape_options`` set the other TAPE options
    (hidden, contextualize, ...). Length scaling: "ntk" carries over as TAPE's base
    ``base * factor^(H / (H - 2))`` (the same frequencies); "linear" and "yarn" are refused,
    since TAPE's initial state has one base, no per-frequency scale and no attention
    temperature. Raises ValueError for a config that is not plain full-width ``rope`` (or
    ntk-scaled), or for options that break the RoPE initialisation.
    """
    if rope_cfg.position != "rope":
        raise ValueError(f"retrofit needs position='rope', got {rope_cfg.position!r}")
    rope = rope_cfg.scheme
    if rope.fraction != 1.0:
        raise ValueError(
            f"retrofit needs rope fraction=1.0 (every feature rotated), got {rope.fraction!r}"
        )
    if rope.p != 1.0:
        raise ValueError(
            f"retrofit needs rope p=1.0: p-RoPE's zero frequencies (p={rope.p!r}) are not "
            "TAPE's RoPE initialisation with one base"
        )
    base = rope.base
    if rope.scaling == "ntk":
        # NTK scaling is a change of base (rope.scaled_inv_freq): TAPE's RoPE initialisation
        # with base * s^(d / (d - 2)) has exactly the scaled frequencies.
        rot_dim = rope_cfg.resolved_head_dim
        base = rope.base * rope.factor ** (rot_dim / (rot_dim - 2))
    elif rope.scaling != "none":
        raise ValueError(
            f"retrofit cannot carry rope scaling={rope.scaling!r} (factor={rope.factor!r}) "
            "into TAPE's initial state: TAPE's RoPE initialisation has one base and no "
            "per-frequency scale or attention temperature, so the converted model would not "
            "compute what the rope model does; allowed: scaling='none' or 'ntk' (a change of "
            "base). Retrofit the unscaled rope model, or use scaling='ntk'"
        )
    for key in ("init", "block", "coords", "tensorial"):
        if key in tape_options:
            raise ValueError(
                f"retrofit fixes the TAPE option {key!r} (RoPE init, L = R = 2, tensorial); "
                f"got {key}={tape_options[key]!r}"
            )
    options = {"init": "rope", "base": base, "layout": rope.layout, **tape_options}
    return checks.validate(dataclasses.replace(rope_cfg, position="tape", position_options=options))


def _unbox(leaf: Any) -> Any:
    return leaf.value if isinstance(leaf, meta.AxisMetadata) else leaf


def retrofit_rope_params(rope_params: Any, tape_cfg: ModelConfig, rng: jax.Array) -> Any:
    """Every ``rope`` parameter copied into a freshly initialised ``tape`` model.

    Args:
      rope_params: the variables of a ``Transformer`` with position="rope" (boxed or not).
      tape_cfg: from :func:`tape_config_from_rope` (same sizes, position="tape").
      rng: initialises the new TAPE parameters (psi, W1; W2 is zero).

    Returns:
      The ``tape`` model's variables, boxed like a fresh init; identical outputs to the
      ``rope`` model until the TAPE parameters move.

    Raises:
      ValueError: a ``rope`` parameter with no counterpart of the same shape in the tape model.
    """
    tokens_BT = jnp.zeros((1, 2), jnp.int32)
    positions_BT = jnp.arange(2, dtype=jnp.int32)[None]
    tape_params = Transformer(tape_cfg).init(rng, tokens_BT, positions_BT)
    flat_tape = traverse_util.flatten_dict(dict(tape_params))
    for path, leaf in traverse_util.flatten_dict(dict(rope_params)).items():
        target = flat_tape.get(path)
        value = _unbox(leaf)
        if target is None or _unbox(target).shape != value.shape:
            raise ValueError(
                f"rope parameter {'/'.join(path)} of shape {value.shape} has no counterpart "
                "in the tape model; convert with the config from tape_config_from_rope"
            )
        flat_tape[path] = (
            target.replace_boxed(value) if isinstance(target, meta.AxisMetadata) else value
        )
    return traverse_util.unflatten_dict(flat_tape)


def _path_names(path: tuple[Any, ...]) -> list[str]:
    return [str(getattr(key, "key", getattr(key, "name", key))) for key in path]


def tape_param_mask(params: Any) -> Any:
    """A pytree of bools shaped like ``params``: True exactly on TAPE's own parameters.

    For ``optax.masked(tx, mask)`` (train only TAPE) or, mapped to labels,
    ``optax.multi_transform``.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(name in TAPE_MODULES for name in _path_names(path)), params
    )
