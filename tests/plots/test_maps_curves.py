"""plots.maps on a tiny random CoPE model and plots.curves on a fake metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import matplotlib.image
import numpy as np
import pytest

from copejax.model.transformer import Transformer
from copejax.plots import curves, maps
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def cope_model() -> tuple:
    cfg = tiny_config("cope", max_len=8)
    tokens = np.zeros((1, 8), np.int32)
    params = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens, tokens)["params"]
    return cfg, params


def test_sown_maps_are_per_layer_and_causal(cope_model: tuple) -> None:
    cfg, params = cope_model
    tokens = np.arange(1, 7, dtype=np.int32)
    sown = maps.sown_maps(cfg, params, tokens)
    for kind in ("attention", "gates", "positions", "position_attention"):
        layers = sown[maps.KINDS[kind]]
        assert len(layers) == cfg.num_layers
        assert all(a.shape == (cfg.num_heads, 6, 6) for a in layers)
        upper = ~np.tril(np.ones((6, 6), bool))
        assert np.all(layers[0][:, upper] == 0), kind
    for kind in ("attention", "position_attention"):
        np.testing.assert_allclose(sown[maps.KINDS[kind]][1].sum(-1), 1.0, rtol=1e-5)


def test_maps_png_has_the_expected_size(cope_model: tuple, tmp_path: Path) -> None:
    cfg, params = cope_model
    tokens = np.arange(1, 7, dtype=np.int32)
    path = tmp_path / "maps.png"
    maps.render(
        cfg, params, tokens, list("abcdef"), layer=1, head=1,
        kinds=["attention", "gates", "position_attention"], path=path, panel_inches=3, dpi=50,
    )  # fmt: skip
    assert matplotlib.image.imread(path).shape[:2] == (150, 450)
    with pytest.raises(ValueError, match="layer"):
        maps.render(cfg, params, tokens, list("abcdef"), layer=2, head=0, kinds=["gates"],
                    path=path)  # fmt: skip


def test_gates_of_a_scheme_without_them_are_refused(tmp_path: Path) -> None:
    cfg = tiny_config("rope", max_len=8)
    tokens = np.zeros((1, 4), np.int32)
    params = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens, tokens)["params"]
    with pytest.raises(ValueError, match="available kinds: \\['attention'\\]"):
        maps.render(cfg, params, tokens[0], list("abcd"), layer=0, head=0, kinds=["gates"],
                    path=tmp_path / "x.png")  # fmt: skip


def _fake_run(directory: Path, position: str, losses: list[float]) -> None:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model": {"position": position}}))
    lines = [{"step": 10 * (i + 1), "train/loss": v, "eval/valid/loss": v + 0.1}
             for i, v in enumerate(losses)]  # fmt: skip
    lines.append({"step": 20, "train/loss": 9.0})  # a resumed run repeats a step: last wins
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 40, "tr'  # torn last line
    (directory / "metrics.jsonl").write_text(text)


def test_curves_from_fake_metrics(tmp_path: Path) -> None:
    _fake_run(tmp_path / "a", "rope", [3.0, 2.5, 2.0])
    _fake_run(tmp_path / "b", "cope", [3.1, 2.2, 1.8])
    assert curves.run_label(tmp_path / "b") == "cope"
    records = curves.read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert curves.series(records, "train/loss") == ([10, 20, 30], [3.0, 9.0, 2.0])
    assert curves.series(records, "eval/valid/loss") == ([10, 20, 30], [3.1, 2.6, 2.1])
    runs = {curves.run_label(tmp_path / d): curves.read_jsonl(tmp_path / d / "metrics.jsonl")
            for d in ("a", "b")}  # fmt: skip
    path = tmp_path / "curves.png"
    curves.plot_curves(runs, ["train/loss", "eval/valid/loss"], path)
    assert matplotlib.image.imread(path).shape[:2] == (4 * 110, 11 * 110)
    with pytest.raises(ValueError, match="available"):
        curves.plot_curves(runs, ["eval/test/error"], path)


def test_curves_leave_a_gap_for_skipped_windows(tmp_path: Path) -> None:
    records = [{"step": 5, "train/loss": 1.0}, {"step": 10, "train/loss": None},
               {"step": 15, "train/loss": 0.5}]  # fmt: skip
    assert curves.series(records, "train/loss") == ([5, 15], [1.0, 0.5])
    curves.plot_curves({"rope": records}, ["train/loss"], tmp_path / "c.png")
    assert (tmp_path / "c.png").exists()
