"""``experiments/bench_kernels_gpu.py``: the GPU measurement script, so that the one call a GPU
session makes does not fail on a typo. By default its page and its record of a refused CLI
arm (no JAX work); slow: ``--smoke`` end to end on the CPU (Pallas interpret mode), the layer
part in process and the whole script, with its command-line part, as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_kernels_cli, bench_kernels_gpu, bench_kernels_page, bench_kernels_plan

ROOT = Path(__file__).resolve().parents[3]


def test_page_states_date_device_ratios_and_refusals() -> None:
    row = {"scheme": "fox kernel", "path": "kernel", "time_s": 0.002, "xla_temp_bytes": 2**20}
    row["ratio_to_fastest_nope"] = 1.25
    dpa = {"scheme": "dpa", "path": "dot_product_attention", "time_s": 0.0016}
    layer = [{"B": 2, "N": 4, "H": 64, "T": 4096, "rows": [dpa, row]}]
    ok = {"status": "ok", "T": 2048, "batch": 8}
    long = {**ok, "T": 8192, "batch": 2}
    cli = [
        {**ok, "scheme": "rope", "attention_impl": "auto", "tokens_per_s": 1000.0},
        {**ok, "scheme": "fox", "attention_impl": "kernel", "tokens_per_s": 700.0},
        {**long, "scheme": "rope", "attention_impl": "auto", "tokens_per_s": 500.0},
        {**long, "scheme": "fox", "attention_impl": "kernel", "tokens_per_s": 300.0},
        bench_kernels_cli.cli_run("dape", "kernel", "paper", steps=1, timeout_s=1),
    ]
    result = {"date": "2026-11-27", "device": "NVIDIA H100", "command": "c", "wall_s": 400.0}
    page = bench_kernels_page.page({**result, "layer": layer, "cli": cli, "skipped": ["x"]})
    assert "Measured 2026-11-27 on NVIDIA H100" in page
    assert "| 2 | 4 | 64 | 4096 | fox kernel | kernel | 2.00 | 1.25x | 1 |" in page
    assert "| 2048 | 8 | fox | kernel | ok | 700 | 0.70x |" in page  # against RoPE's own size
    assert "| 8192 | 2 | fox | kernel | ok | 300 | 0.60x |" in page
    assert "refused: model.attention_impl='kernel' has no kernel for scheme 'dape'" in page
    assert "Skipped (time budget): x." in page


@pytest.mark.slow
@pytest.mark.usefixtures("jax_state_kept")
def test_smoke_layer_part_writes_a_dated_page(tmp_path: Path) -> None:
    bench_kernels_gpu.main(["--smoke", "--parts", "check,layer", "--out_dir", str(tmp_path)])
    result = json.loads((tmp_path / "bench_kernels_gpu.json").read_text())
    group, lever = result["layer"]
    rows = {row["scheme"]: row for row in group["rows"]}
    assert "error" not in group
    assert rows["fox kernel"]["status"] == "ok" and rows["fox kernel"]["path"] == "kernel"
    assert rows["fox naive"]["path"] == "naive"  # auto's rule for FoX there, beside it
    assert rows["dpa"]["ratio_to_fastest_nope"] > 0
    assert {row["scheme"] for row in lever["rows"]} == {"dpa", "fox blockwise 32"}
    (checked,) = result["check"]
    assert checked["scheme"] == "fox" and checked["ok"], checked
    # the warm part ran the check and compiled every arm: the timed groups compiled nothing
    assert result["warm"]["served"] and result["warm"]["done"] == result["warm"]["jobs"]
    assert all(g["cache"]["misses"] == 0 and g["cache"]["hits"] > 0 for g in result["layer"])
    page = (tmp_path / "bench_kernels_gpu.md").read_text()
    assert f"Measured {result['date']} on {result['device']}" in page
    assert "| 1 | 2 | 16 | 128 | fox kernel | kernel |" in page


@pytest.mark.slow
def test_smoke_whole_script_with_the_command_line_part(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "experiments.bench_kernels_gpu", "--smoke"]
    subprocess.run([*command, "--out_dir", str(tmp_path)], cwd=ROOT, check=True)
    result = json.loads((tmp_path / "bench_kernels_gpu.json").read_text())
    cli = {row["scheme"]: row for row in result["cli"]}
    assert cli["rope"]["status"] == "ok" and cli["rope"]["tokens_per_s"] > 0
    assert cli["dape"]["status"] == "refused" and "'dape'" in cli["dape"]["reason"]


def _group(shape: tuple[int, int, int], times: dict[str, float], rules: dict[str, str]) -> dict:
    """A measured layer group: arm label -> time; the arm's scheme and path from its label."""
    arms, rows = {}, []
    fastest = times["dpa"]
    for label, time_s in times.items():
        scheme, _, impl = label.partition(" ")
        arms[label] = {"scheme": scheme, "impl": impl or "auto", "options": {}}
        row = {"scheme": label, "time_s": time_s, "ratio_to_fastest_nope": time_s / fastest}
        rows.append(row)
    batch, heads, head_dim = shape
    return {
        "B": batch,
        "N": heads,
        "H": head_dim,
        "T": 4096,
        "arms": arms,
        "rules": rules,
        "rows": rows,
    }


def test_dispatch_entries_name_a_path_that_won_at_every_shape() -> None:
    """FoX's kernel wins at both shapes: an entry (its worst ratio). ALiBi's kernel wins at
    one shape only, stick-breaking's rule path wins: no entry for them. Where one shape was
    measured, a win needs ONE_SHAPE_MARGIN over the rules' path (ALiBi's 1.4 / 1.2)."""
    rules = {"fox": "naive", "alibi": "dot_product_attention", "stickbreaking": "naive"}
    small = {
        "dpa": 1.0,
        "fox kernel": 1.3,
        "fox naive": 6.0,
        "alibi kernel": 1.2,
        "alibi dot_product_attention": 1.4,
        "stickbreaking kernel": 3.0,
        "stickbreaking naive": 2.5,
    }
    large = {**small, "fox kernel": 1.4, "alibi kernel": 1.6}
    layer = [_group((2, 4, 64), small, rules), _group((4, 16, 128), large, rules)]
    result = {
        "date": "2026-11-27",
        "device": "d",
        "command": "c",
        "wall_s": 1.0,
        "layer": layer,
        "cli": [],
        "skipped": [],
    }
    source = "experiments/results/bench_kernels_gpu.md 2026-11-27"
    (entry,) = bench_kernels_page.dispatch_entries(result, source)
    assert (entry.backend, entry.dtype, entry.scheme, entry.keys) == (
        "gpu",
        "bfloat16",
        "fox",
        4096,
    )
    assert entry.impl == "kernel" and entry.ratio == pytest.approx(1.4)
    page = bench_kernels_page.page(result)
    assert '    Measurement("gpu", "bfloat16", "fox", 4096, "kernel", 1.4, SOURCE),' in page
    # One shape measured: a win over the rules' path under ONE_SHAPE_MARGIN is no entry.
    one = {**result, "layer": [_group((2, 4, 64), small, rules)]}
    assert [m.scheme for m in bench_kernels_page.dispatch_entries(one, source)] == ["fox"]
    wide = {**small, "alibi kernel": 1.4 / bench_kernels_page.ONE_SHAPE_MARGIN - 0.01}
    one = {**result, "layer": [_group((2, 4, 64), wide, rules)]}
    assert [m.scheme for m in bench_kernels_page.dispatch_entries(one, source)] == ["alibi", "fox"]
    # A kernel that computed something else on the device is no candidate.
    bad = {"scheme": "fox", "ok": False, "error": "LoweringError: x"}
    assert bench_kernels_page.dispatch_entries({**result, "check": [bad]}, source) == []
    page = bench_kernels_page.page({**result, "check": [bad]})
    assert "| fox | - | - | - | no: LoweringError: x |" in page
    # ... but a lever's own check (approx_log1p) withholds no entry of the scheme
    lever = {**bad, "approx_log1p": True}
    assert len(bench_kernels_page.dispatch_entries({**result, "check": [lever]}, source)) == 1


def test_kernel_check_relative_error() -> None:
    from experiments.kernel_check import relative_error

    assert relative_error([1.0, -2.0], [1.0, -2.5]) == pytest.approx(0.2)
    assert relative_error([0.0], [0.0]) == 0.0


def test_every_kernel_arm_runs_beside_the_path_auto_takes_for_its_scheme() -> None:
    tasks, _ = bench_kernels_plan.plan(smoke=False, parts=["layer", "cli"])
    groups = [what for kind, what in tasks if kind == "layer"]
    for shape, length, arms in groups:
        kernels = {scheme for _, scheme, opts in arms if opts == bench_kernels_plan.KERNEL}
        others = {scheme for _, scheme, opts in arms if opts != bench_kernels_plan.KERNEL}
        assert kernels - {"nope"} <= others, (shape, length)
    # At T = 4096, B x N = 8: ALiBi's bfloat16 bias (256 MiB) fits cuDNN's kernel; FoX, not
    # a position-only bias, takes the engine from 512 keys on.
    first = {label for label, _, _ in groups[0][2]}
    assert {"fox kernel", "fox blockwise", "alibi dot_product_attention"} <= first
    # The CLI's own layer (T = 2048, GPT-2 small's heads), so that auto can take a kernel at
    # the CLI's length: after the CLI arms and the lever, its schemes' kernels beside their
    # rules' paths.
    at = [i for i, (_, what) in enumerate(tasks) if what[:2] == bench_kernels_plan.CLI_LAYER]
    assert len(at) == 1 and at[0] > max(i for i, (kind, _) in enumerate(tasks) if kind == "cli")
    lever = [i for i, (_, what) in enumerate(tasks) if "fox blockwise 512" in str(what)]
    assert lever == [at[0] - 1]
    cli = [what for kind, what in tasks if kind == "cli"]  # both of issue 45's CLI targets
    assert cli[:4] == [(*arm, 2048, 8) for arm in bench_kernels_plan.CLI_ARMS]
    assert cli[4:] == [(*arm, 8192, 2) for arm in bench_kernels_plan.CLI_ARMS]
    assert bench_kernels_plan.task_label("cli", cli[5]) == "cli fox kernel T=8192 batch=2"
    labels = {label for label, _, _ in tasks[at[0]][1][2]}
    assert {"dpa", "fox kernel", "stickbreaking kernel", "cope kernel"} <= labels
    assert {"cope blockwise", "fox blockwise", "stickbreaking blockwise"} <= labels


def test_a_layer_group_past_its_time_costs_its_own_rows_only() -> None:
    """A group runs in a child stopped at its limit (CoPE's kernels compiled for over 5.5
    minutes on the H100): its arms become error rows, and the page shows why."""
    arms = (("dpa", "dpa", {}), ("cope kernel", "cope", {"attention_impl": "kernel"}))
    group = bench_kernels_gpu.isolated_group((1, 2, 16), 128, arms, 1, timeout_s=0.01)
    assert [row["scheme"] for row in group["rows"]] == ["dpa", "cope kernel"]
    assert all(row["status"] == "error" for row in group["rows"])
    assert "stopped after 0 s" in group["rows"][1]["error"]
    result = {"date": "d", "device": "x", "command": "c", "wall_s": 1.0, "cli": [], "skipped": []}
    page = bench_kernels_page.page({**result, "layer": [group]})
    assert "| cope kernel | - | error: stopped after 0 s (compilation included) |" in page


def test_the_warps_lever_sets_the_triton_programs_warps_while_tracing() -> None:
    """``kernel_warps`` arms trace their kernels with that many warps, and only them."""
    from copejax.ops.kernels.triton_params import compiler_params, warps_for_tracing

    assert (compiler_params(64).num_warps, compiler_params(128).num_warps) == (4, 8)
    with warps_for_tracing(8):
        assert compiler_params(64).num_warps == 8
        with warps_for_tracing(2):
            assert compiler_params(128).num_warps == 2
        assert compiler_params(64).num_warps == 8
    with warps_for_tracing(None):
        assert compiler_params(64).num_warps == 4
    arms = dict((label, opts) for label, _, opts in bench_kernels_plan.warps_arms())
    assert arms["cope kernel w8"] == {"attention_impl": "kernel", "kernel_warps": 8}
    assert "kernel_warps" not in arms["cope kernel"]
    assert arms["selective kernel w8"]["kernel_warps"] == 8
    # the within-tile sums' lever: stick-breaking's and CoPE's kernels with matmul sums
    assert arms["stickbreaking kernel matmul sums"]["kernel_scan"] is False
    assert "alibi kernel matmul sums" not in arms
    # the carry groups' lever: one group per key tile (the count is capped at the tiles)
    for scheme in ("stickbreaking", "cope"):
        assert arms[f"{scheme} kernel per-tile carries"]["kernel_carry_groups"] >= 2**20
    assert "fox kernel per-tile carries" not in arms
    # the full pairs' lever: nope's, ALiBi's and FoX's kernels with every pair masked
    assert arms["alibi kernel masked tiles"] == {
        "attention_impl": "kernel",
        "kernel_full_tiles": False,
    }
    assert "cope kernel masked tiles" not in arms
    # stick-breaking's log1p as lg2.approx, beside libdevice's
    assert arms["stickbreaking kernel approx log1p"]["kernel_approx_log1p"] is True
    assert [label for label in arms if "approx log1p" in label] == [
        "stickbreaking kernel approx log1p"
    ]
    from copejax.ops.kernels.padding import full_tiles_for_tracing, tiled_plan

    fields = {"window": None, "sink_tokens": 0, "groups": 1, "biases": ()}
    plan = lambda: tiled_plan(
        64, block_q=16, block_k=16, backend="triton", interpret=True, **fields
    )
    with full_tiles_for_tracing(False):
        assert not plan().full_tiles
        with full_tiles_for_tracing(None):
            assert not plan().full_tiles
    assert plan().full_tiles
    from copejax.ops.kernels.triton_params import gpu_scan, scan_for_tracing

    with scan_for_tracing(False):
        assert not gpu_scan()
        with scan_for_tracing(None):
            assert not gpu_scan()
    assert gpu_scan()


def test_checks_run_stick_breaking_and_cope_on_one_carry_group_too() -> None:
    """The GPU call checks stick-breaking and CoPE a second time with all their key tiles in
    one carry group (the in-place updates across key tiles); a failure there, named by its
    groups on the page, withholds the scheme's dispatch entry like any failed check."""
    tasks, _ = bench_kernels_plan.plan(smoke=False, parts=["check"])
    assert ("check", ("cope", 1)) in tasks and ("check", ("stickbreaking", 1)) in tasks
    assert bench_kernels_plan.task_label("check", ("cope", 1)) == "check cope 1"
    failed = {"scheme": "cope", "carry_groups": 1, "ok": False, "error": "ValueError: x"}
    passed = {"scheme": "fox", "logits_rel_error": 0.0, "grad_rel_error": 0.0, "bound": 0.05}
    result = {"date": "d", "device": "x", "command": "c", "wall_s": 1.0, "cli": [], "skipped": []}
    page = bench_kernels_page.page(
        {**result, "layer": [], "check": [failed, {**passed, "ok": True}]}
    )
    assert "| cope (1 carry group) | - | - | - | no: ValueError: x |" in page
    assert "| fox | 0.00e+00 |" in page


def test_checks_run_selective_without_grouped_heads_too() -> None:
    """Selective attention's backward has a second output layout without grouped heads (dk
    and dv in the inputs' dtype, the selecting head's dk summed inside): the GPU call checks
    it too, named by its key/value heads."""
    from experiments import kernel_check

    tasks, _ = bench_kernels_plan.plan(smoke=False, parts=["check"])
    what = ("selective", None, kernel_check.HEADS)
    assert ("check", what) in tasks
    assert bench_kernels_plan.task_label("check", what) == "check selective kv_heads=4"
    row = {"scheme": "selective", "kv_heads": kernel_check.HEADS, "ok": False, "error": "E: x"}
    row_line = bench_kernels_page._check_line(row)
    assert row_line == "| selective (4 key/value heads) | - | - | - | no: E: x |"


def test_checks_run_stick_breaking_with_the_approximate_log1p_too() -> None:
    """The GPU call checks stick-breaking's kernels with the ``approx_log1p`` lever (the
    numerics beside its arm's speed); that row, named by the lever, gates only the lever: a
    failure there withholds no dispatch entry of the scheme."""
    from experiments import kernel_check

    tasks, _ = bench_kernels_plan.plan(smoke=False, parts=["check"])
    what = ("stickbreaking", None, kernel_check.KV_HEADS, True)
    assert ("check", what) in tasks
    label = f"check stickbreaking kv_heads={kernel_check.KV_HEADS} approx_log1p"
    assert bench_kernels_plan.task_label("check", what) == label
    row = {"scheme": "stickbreaking", "approx_log1p": True, "ok": False, "error": "E: x"}
    assert bench_kernels_page._check_line(row) == (
        "| stickbreaking (log1p as lg2.approx) | - | - | - | no: E: x |"
    )
    record = kernel_check.check("stickbreaking", approx_log1p=True)  # interpret mode here
    assert record["approx_log1p"] is True and record["ok"], record
