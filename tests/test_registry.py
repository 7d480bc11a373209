"""The registry, the `+` composition and `python -m copejax.positions`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from copejax.positions import registry
from copejax.positions.__main__ import table
from copejax.positions.composite import Composite


def test_unknown_scheme_lists_the_known_names() -> None:
    with pytest.raises(ValueError) as info:
        registry.get("nonexistent")
    for name in registry.names():
        assert name in str(info.value)


def test_composite_routes_options_to_their_part() -> None:
    scheme = registry.make_scheme("nope+rope", {"base": 500.0})
    assert isinstance(scheme, Composite)
    assert scheme.name == "nope+rope"
    assert scheme.parts[1].base == 500.0
    assert scheme.sites == ("qk",)
    with pytest.raises(ValueError, match="declared by no part"):
        registry.make_scheme("nope+rope", {"nothing": 1})


def test_positions_table_lists_every_scheme() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "copejax.positions"], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == table()
    for name in registry.names():
        assert f"`{name}`" in out


def test_composite_shares_a_part_across_layers_while_others_stay_per_layer() -> None:
    """cope+rope with share_layers: one CoPE table for the model, rope has no parameters."""
    import jax

    from copejax.model.transformer import Transformer
    from tests.conftest import tiny_config, tokens_and_positions

    tokens_BT, positions_BT = tokens_and_positions()
    for options, tables in (({"share_layers": True}, 1), ({"share_layers": False}, 3)):
        model = Transformer(tiny_config("cope+rope", position_options=options, num_layers=3))
        params = model.init(jax.random.key(0), tokens_BT, positions_BT)["params"]
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        assert sum("pos_emb" in path for path in paths) == tables, paths


def test_readme_scheme_table_matches_the_registry() -> None:
    """The README's table is `python -m copejax.positions`'s output: regenerate it if not."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert table() in readme, "README scheme table is stale: paste `python -m copejax.positions`"
