"""Parameter paths saved by earlier versions of copejax, renamed on restore.

Before 0.2.0 the position sites' modules took the names of the attributes Linen attached them
to; since then each is named after its scheme (``PositionScheme.name``), a combination after
the combination, its parts inside after theirs. Old -> new, for a config's scheme ``s``, a
combination ``a+b`` of parts ``a`` and ``b``, and layer ``l``:

- ``position_embed`` -> ``s`` (``learned``, ``tape``, ``a+b``): the embed site;
- ``position_embed/embeds_<j>`` -> ``a+b/a``: the j-th part with an embed site;
- ``position_embed/encoding_embed`` -> ``randomized/learned``: randomized's encoding;
- ``shared_positions`` -> ``s`` (``t5``, ``cope`` with ``share_layers``): shared by all layers;
- ``shared_positions_<i>`` -> ``a``: part i of a combination, shared by all layers;
- ``block_<l>/attention/own_site`` -> ``block_<l>/attention/s`` (``a+b``; randomized's site is
  its encoding's, ``rope``);
- ``block_<l>/attention/own_site/sites__<j>`` -> ``block_<l>/attention/a+b/a``: the j-th part
  with an attention site.

:func:`renames` lists these for one model config (which part is ``sites__1`` depends on its
scheme). Every place that restores parameters calls in here: resuming a run
(``copejax.runtime.checkpoint`` through :func:`checkpoint_upgrade`, optimizer state included),
a run's weights read back (``copejax.training.trained_run``: evaluation, sampling, plots, and
``train.init_from`` of a workdir) and converted checkpoints (``copejax.training.pretrained``).
Trees already in the new layout pass unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from copejax.model.config import ModelConfig
from copejax.positions.composite import Composite
from copejax.positions.randomized import Randomized

Path = tuple[str, ...]
# A key every Transformer parameter tree holds at its root (and no other tree does): where
# :func:`rename` starts matching paths.
PARAMS_ROOT_KEY = "token_embed"


def renames(cfg: ModelConfig) -> dict[Path, Path]:
    """Old module path -> new module path, from the parameters' root, for ``cfg``'s sites.

    Only modules whose name changed are listed; a parent is listed before its children.
    """
    dims, scheme = cfg.dims, cfg.scheme
    out: dict[Path, Path] = {}
    embed = scheme.embed_module(dims)
    if embed is not None:
        out[("position_embed",)] = (embed.name,)
        if isinstance(scheme, Composite):
            embeds = [m for p in scheme.parts if (m := p.embed_module(dims)) is not None]
            parts = [p for p in scheme.parts if p.embed_module(dims) is not None]
            for j, (part, module) in enumerate(zip(parts, embeds, strict=True)):
                old, new = ("position_embed", f"embeds_{j}"), (embed.name, module.name)
                out[old] = new
                out.update(_randomized_encoding(part, dims, old, new))
        else:
            out.update(_randomized_encoding(scheme, dims, ("position_embed",), (embed.name,)))
    shared = None if cfg.resolved_pattern() else scheme.shared_attention_module(dims)
    if isinstance(shared, tuple):
        out.update({(f"shared_positions_{i}",): (m.name,) for i, m in enumerate(shared) if m})
    elif shared is not None:
        out[("shared_positions",)] = (shared.name,)
    for index in range(cfg.num_layers):
        layer = cfg.for_layer(index)
        own = layer.scheme.layer_attention_module(layer.dims, shared)
        if own is None:
            continue
        base = (f"block_{index}", "attention")
        out[(*base, "own_site")] = (*base, own.name)
        if isinstance(layer.scheme, Composite):
            parts_shared = shared or (None,) * len(layer.scheme.parts)
            present = []  # (module, whether this layer owns it), as _CompositeAttention lists
            for part, part_shared in zip(layer.scheme.parts, parts_shared, strict=True):
                part_own = part.layer_attention_module(layer.dims, part_shared)
                if part_own is not None or part_shared is not None:
                    present.append((part_own or part_shared, part_own is not None))
            for j, (module, owned) in enumerate(present):
                if owned:
                    old = (*base, "own_site", f"sites__{j}")
                    out[old] = (*base, own.name, module.name)
    return out


def _randomized_encoding(scheme: Any, dims: Any, old: Path, new: Path) -> dict[Path, Path]:
    """Randomized positions' inner encoding embed (a learned table has parameters)."""
    if not isinstance(scheme, Randomized):
        return {}
    encoding = scheme.encoding_scheme(dims)
    inner = encoding.embed_module(dims) if encoding is not None else None
    return {} if inner is None else {(*old, "encoding_embed"): (*new, inner.name)}


def rename(tree: Any, paths: Mapping[Path, Path]) -> Any:
    """``tree`` with every module at an old path of ``paths`` moved to its new path.

    ``tree`` is any pytree (a train state, a restored dict, parameters alone); each mapping in
    it holding ``PARAMS_ROOT_KEY`` is a parameter tree (the parameters, the optimizer's
    moments), where ``paths`` apply from that mapping. Renames keep the depth (only module
    names change), so a key is renamed where its path, read in the old names, is listed.
    """
    last_keys = {old: new[-1] for old, new in paths.items()}

    def params_tree(node: Mapping, path: Path) -> Any:
        items = {}
        for key, value in node.items():
            here = (*path, str(key))
            child = params_tree(value, here) if isinstance(value, Mapping) else value
            items[last_keys.get(here, key)] = child
        return type(node)(items)

    def anywhere(node: Any) -> Any:
        if isinstance(node, Mapping):
            if PARAMS_ROOT_KEY in node:
                return params_tree(node, ())
            return type(node)({key: anywhere(value) for key, value in node.items()})
        return jax.tree_util.tree_map(
            lambda sub: anywhere(sub) if isinstance(sub, Mapping) else sub,
            node,
            is_leaf=lambda x: isinstance(x, Mapping),
        )

    return anywhere(tree)


def inverse(paths: Mapping[Path, Path]) -> dict[Path, Path]:
    """New path -> old path: to read an old tree into the current layout's abstract state."""
    return {new: old for old, new in paths.items()}


def holds_old_paths(tree: Any, paths: Mapping[Path, Path]) -> bool:
    """Whether any leaf of ``tree`` lies under an old path of ``paths`` (anywhere in it)."""
    by_first: dict[str, list[Path]] = {}
    for old in paths:
        by_first.setdefault(old[0], []).append(old)
    for key_path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = tuple(_key_name(k) for k in key_path)
        for start, name in enumerate(names):
            if any(names[start : start + len(o)] == o for o in by_first.get(name, ())):
                return True
    return False


def _key_name(key: Any) -> str:
    """A pytree path entry's name (dict key, dataclass field or sequence index)."""
    return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def upgrade(tree: Any, cfg: ModelConfig) -> Any:
    """``tree`` (parameters, or a state holding them) in the current layout of ``cfg``."""
    return rename(tree, renames(cfg))


def checkpoint_upgrade(cfg: ModelConfig) -> Callable[[Any, Any], tuple[Any, Callable]]:
    """What ``copejax.runtime.checkpoint.Checkpointer.restore`` calls as ``upgrade``.

    The returned function takes (the saved state's metadata tree, the abstract state to
    restore into) and returns (the abstract state in the saved layout, the function that puts
    the restored state into the current layout): the identity for a checkpoint written with
    the current names.
    """
    paths = renames(cfg)

    def plan(saved: Any, abstract: Any) -> tuple[Any, Callable[[Any], Any]]:
        if not holds_old_paths(saved, paths):
            return abstract, lambda state: state
        return rename(abstract, inverse(paths)), lambda state: rename(state, paths)

    return plan
