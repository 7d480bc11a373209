"""``experiments/kernel_memory.py``: what it reads from a compiled module's HLO text and how
it rates each arm against cuDNN's nope (the compile itself needs jax[cuda13] 0.11.2,
``.venv-ptx``; its figures are in ``experiments/results/kernel_memory.md``)."""

from __future__ import annotations

from experiments.kernel_memory import (
    BASELINE,
    array_bytes,
    hlo_arrays,
    page,
    quadratic_arrays,
    with_ratios,
)

HLO = """HloModule jit_fwd_bwd
ENTRY %main (p0: bf16[2,4096,4,64], p1: s32[2,4096]) -> (f32[2,4096,4,64], pred[]) {
  %mask = pred[2,1,4096,4096]{3,2,1,0} compare(s32[2,1,4096,4096] %a, s32[2,1,4096,4096] %b)
  %t = f32[2,4,4096]{2,1,0} reduce(f32[2,4096,4,64] %x), dimensions={3}
  %band = f32[4096,127]{1,0} broadcast(f32[127] %v)
}
"""


def test_reads_every_array_type_once_with_its_bytes() -> None:
    arrays = hlo_arrays(HLO)
    assert ("bf16", (2, 4096, 4, 64)) in arrays
    assert ("pred", ()) in arrays
    assert sum(1 for a in arrays if a == ("s32", (2, 1, 4096, 4096))) == 1
    assert array_bytes(("bf16", (2, 4096, 4, 64))) == 2 * 4096 * 4 * 64 * 2
    assert array_bytes(("pred", ())) == 1


def test_a_ts_buffer_has_two_axes_of_at_least_t() -> None:
    found = quadratic_arrays(hlo_arrays(HLO), 4096)
    assert found == ["s32[2,1,4096,4096]", "pred[2,1,4096,4096]"]  # largest first
    assert quadratic_arrays(hlo_arrays(HLO), 8192) == []  # a band (T, 127) is not one


def _row(scheme: str, temp: int, quadratic: list[str] | None = None) -> dict:
    label = scheme if scheme == BASELINE else f"{scheme} kernel"
    return {
        "label": label,
        "scheme": scheme,
        "T": 16384,
        "shape": [2, 4, 64],
        "status": "ok",
        "temp_bytes": temp,
        "largest_bytes": temp // 2,
        "quadratic": quadratic or [],
    }


def test_rates_each_arm_against_its_groups_cudnn_nope() -> None:
    rows = [
        _row("fox", 110),
        _row(BASELINE, 100),
        _row("path", 500),
        _row("cope", 90, ["f32[2,4,16384,16384]"]),
        {**_row("t5", 0), "status": "error", "error": "XlaRuntimeError: boom"},
    ]
    rows = with_ratios(rows)
    assert rows[0]["ratio"] == 1.1 and rows[0]["met"]
    assert rows[2]["ratio"] == 5.0 and not rows[2]["met"]
    assert not rows[3]["met"]  # within 1.2x, but it holds a (T, S) buffer
    assert "ratio" not in rows[4]
    text = page(rows, {"date": "2026-11-27", "jax": "0.11.2", "command": "cmd"})
    assert "| 2 | 4 | 64 | 16384 | fox kernel | 0 | 1.10x | 0 | none | yes |" in text
    assert "| 2 | 4 | 64 | 16384 | path kernel | 0 | 5.00x | 0 | none | no |" in text
    assert "f32[2,4,16384,16384] | no |" in text
    assert "t5 kernel | error: XlaRuntimeError: boom" in text


def test_render_rewrites_the_page_from_its_json(tmp_path) -> None:
    import json

    from experiments import kernel_memory

    rows = [_row(BASELINE, 100), _row("fox", 110), _row("stickbreaking", 300)]
    meta = {"date": "2026-11-27", "jax": "0.11.2", "command": "cmd"}
    (tmp_path / "m.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    kernel_memory.main(["--render", str(tmp_path / "m.json"), "--out_dir", str(tmp_path)])
    text = (tmp_path / "kernel_memory.md").read_text()
    assert "at every measured shape: fox. Not within it: stickbreaking." in text


def test_merge_replaces_the_measured_rows_and_keeps_the_others() -> None:
    from experiments.kernel_memory import merged_rows

    kept = [_row(BASELINE, 100), _row("fox", 110), _row("path", 900)]
    measured = [_row(BASELINE, 100), _row("path", 400), {**_row("nope", 105), "T": 4096}]
    rows = merged_rows(kept, measured)
    assert [(r["scheme"], r["T"]) for r in rows] == [  # by shape, T, then the arms' order
        ("nope", 4096),
        (BASELINE, 16384),
        ("fox", 16384),
        ("path", 16384),
    ]
    assert rows[3]["temp_bytes"] == 400 and rows[2]["temp_bytes"] == 110
