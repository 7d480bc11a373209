"""``experiments/kernel_tpu.py``: which schemes it compiles and how its page reads (its runs
need libtpu in ``.venv-ptx``; their results are in ``experiments/results/kernel_tpu.md``)."""

from __future__ import annotations

import json

from experiments import kernel_tpu


def test_compiles_the_schemes_the_kernels_cover() -> None:
    """Every scheme the kernels run (the TPU's run them all), composites included, and none
    they refuse (DAPE: no kernel)."""
    covered = kernel_tpu.covered_schemes()
    for name in ("nope", "cope", "stickbreaking", "selective", "path", "relative", "path+fox"):
        assert name in covered
    assert "relative_capped" in covered and "fox+t5" in covered
    assert "dape" not in covered


def _compile_row(generation: str, scheme: str, dtype: str, status: str = "ok") -> dict:
    row = {"generation": generation, "scheme": scheme, "dtype": dtype, "status": status}
    return row if status == "ok" else {**row, "error": "MosaicError: INTERNAL: no gather"}


def _memory_row(scheme: str, temp: int, shape: tuple = (2, 4, 64)) -> dict:
    row = {"generation": "v5p", "scheme": scheme, "shape": list(shape), "T": 16384}
    return {**row, "status": "ok", "temp_bytes": temp, "largest_bytes": 2**20, "quadratic": []}


def test_page_lists_each_compile_and_the_memory_ratios(tmp_path) -> None:
    result = {
        "date": "2026-11-27",
        "jax": "0.11.2",
        "libtpu": "0.0.48.1",
        "command": "cmd",
        "length": 640,
        "block": 64,
        "compile": [
            _compile_row("v4", "nope", "bfloat16"),
            _compile_row("v5e", "nope", "bfloat16"),
            _compile_row("v4", "cope", "bfloat16", "error"),
            _compile_row("v5e", "cope", "bfloat16"),
        ],
        "memory": [
            _memory_row("nope", 100 * 2**20),
            _memory_row("cope", 250 * 2**20),
            {**_memory_row("stickbreaking", 0), "status": "error", "error": "RESOURCE_EXHAUSTED"},
        ],
    }
    (tmp_path / "r.json").write_text(json.dumps(result))
    kernel_tpu.main(["--render", str(tmp_path / "r.json"), "--out_dir", str(tmp_path)])
    text = (tmp_path / "kernel_tpu.md").read_text()
    assert "| scheme | v4 bfloat16 | v5e bfloat16 |" in text
    assert "| nope | ok | ok |" in text
    assert "| cope | error | ok |" in text
    assert "3 of 4 compiled. Failures:" in text
    assert "- cope, v4, bfloat16: MosaicError: INTERNAL: no gather" in text
    assert "| 2 | 4 | 64 | cope | 250 | 2.50x | 1 | none |" in text
    assert "| 2 | 4 | 64 | stickbreaking | RESOURCE_EXHAUSTED |" in text
