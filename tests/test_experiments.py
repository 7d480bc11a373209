"""The study scripts of experiments/ at smoke scale: each trains for real, and its page, JSON
and plots hold the numbers of the runs' own metrics.jsonl (read here independently). Studies 4-6
train more models and are marked slow."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from experiments import (
    context_extension,
    cope_ablations,
    counting,
    flipflop,
    hybrids,
    length_generalization,
    length_generalization_peer,
    length_generalization_peer_weights,
    length_generalization_peer_worker,
    lm,
    selective_copy,
    sweep,
    sweep_page,
    tape_tasks,
)
from experiments import length_generalization_arms as lg_arms
from experiments import length_generalization_page as lg_page
from experiments import length_generalization_results as lg_results
from experiments import length_generalization_tables as lg_tables

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tmp_path_factory.mktemp("results"), tmp_path_factory.mktemp("runs")


def run_study(module, dirs: tuple[Path, Path]) -> tuple[str, dict]:
    out, workroot = dirs
    module.main(["--scale=smoke", f"--out={out}", f"--workroot={workroot}"])
    stem = f"{module.STUDY}_smoke"
    page = (out / f"{stem}.md").read_text()
    data = json.loads((out / f"{stem}.json").read_text())
    pngs = sorted(out.glob(f"{stem}_*.png"))
    assert pngs, f"no plot for {stem}"
    for png in pngs:
        assert png.read_bytes()[:8] == PNG
        assert f"({png.name})" in page  # every plot is shown on the page
    assert "python -m copejax.main --config=" in page
    assert f"python -m experiments.{module.STUDY} --scale=smoke" in page
    assert data["seeds"] == [0] and data["wall_time_s"] > 0
    return page, data


def last_eval_of(workdir: Path) -> dict[str, float]:
    """The last record with eval keys, read straight from the run's JSONL file."""
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x]
    return next(r for r in reversed(lines) if any(k.startswith("eval/") for k in r))


def workdir(dirs: tuple[Path, Path], study: str, label: str) -> Path:
    path = dirs[1] / study / "smoke" / f"{label}_seed0"
    assert (path / "config.json").exists()
    return path


def test_flipflop(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(flipflop, dirs)
    record = last_eval_of(workdir(dirs, "flipflop", "cope"))
    for split in ("test", "ood_sparse", "ood_dense"):
        got = data["results"]["cope"][split]
        assert got["per_seed"] == [record[f"eval/{split}/error"]]
        assert got["mean"] == pytest.approx(record[f"eval/{split}/error"]) and got["std"] == 0
    assert f"{100 * record['eval/test/error']:.2f} ± 0.00" in page
    assert "| cope |" in page and "4.9 (4.4)" in page  # the paper's OOD column


@pytest.mark.slow  # test_flipflop runs the shared study driver in the default suite
def test_selective_copy(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(selective_copy, dirs)
    record = last_eval_of(workdir(dirs, "selective_copy", "cope"))
    assert data["results"]["cope"]["ood_sparse/error"]["per_seed"] == [
        record["eval/ood_sparse/error"]
    ]
    assert f"{100 * record['eval/ood_dense/error']:.1f} ± 0.0" in page


@pytest.mark.slow  # test_flipflop runs the shared study driver in the default suite
def test_counting(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(counting, dirs)
    record = last_eval_of(workdir(dirs, "counting", "cope__1_var"))
    got = data["results"]["cope, 1 var"]
    for split in ("test", "ood_long", "ood_short"):
        assert got[f"{split}/error"]["per_seed"] == [record[f"eval/{split}/error"]]
    assert "| cope, 1 var |" in page
    long = last_eval_of(workdir(dirs, "counting", "cope__3_var__25_steps"))
    assert data["results"]["cope, 3 var, 25 steps"]["test/error"]["per_seed"] == [
        long["eval/test/error"]
    ]
    assert "| cope, 3 var, 25 steps |" in page and "| 1.2 |" in page  # Table 3 beside it
    assert f"`cope` {100 * long['eval/test/error']:.1f} % (seeds" in page
    assert "Every seed's value (seeds 0, in that order)" in page


@pytest.mark.slow  # three LM runs and four extrapolation lengths: over the fast budget
def test_lm_and_ablations(dirs: tuple[Path, Path]) -> None:
    _, data = run_study(lm, dirs)
    run = workdir(dirs, "lm", "cope")
    cached = json.loads((run / "extrapolation_sweep.json").read_text())
    assert sorted(int(r["length"]) for r in cached.values()) == [64, 128, 256, 512]
    for length, stats in data["perplexity"]["cope"].items():
        (ppl,) = stats["per_seed"]
        (entry,) = [r for r in cached.values() if r["length"] == int(length)]
        assert ppl == pytest.approx(math.exp(entry["loss"]), rel=1e-5)

    page, data = run_study(cope_ablations, dirs)
    # The plain cope arm is study 4's run, not trained again.
    assert not (dirs[1] / "cope_ablations" / "smoke" / "cope_seed0").exists()
    for label, study in (("cope", "lm"), ("val-gates", "cope_ablations")):
        loss = last_eval_of(workdir(dirs, study, label))["eval/valid/loss"]
        assert data["perplexity"][label]["per_seed"] == [pytest.approx(math.exp(loss))]
    assert "Use val-gates" in page and "22.4" in page


@pytest.mark.slow  # seven 4-layer LM runs and their extrapolation
def test_hybrids(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(hybrids, dirs)
    assert set(data["perplexity"]) == set(hybrids.ARMS)
    hybrid = workdir(dirs, "hybrids", "swa-rope___nope__3_1_")
    config = json.loads((hybrid / "config.json").read_text())
    assert (config["model"]["layout"], config["model"]["window"]) == ("swan", 16)
    cached = json.loads((hybrid / "extrapolation_sweep.json").read_text())
    for length, stats in data["perplexity"]["swa-rope + nope (3:1)"].items():
        (ppl,) = stats["per_seed"]
        (entry,) = [r for r in cached.values() if r["length"] == int(length)]
        assert ppl == pytest.approx(math.exp(entry["loss"]), rel=1e-5)
    sink = json.loads((workdir(dirs, "hybrids", "rope___sink") / "config.json").read_text())
    assert sink["model"]["attention_sink"] is True
    assert "The papers' claims beside these numbers" in page


@pytest.mark.slow  # a pretraining, HF export and import, seven fine-tunes and their evaluation
def test_context_extension(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(context_extension, dirs)
    pretrained = "pretrained rope (no fine-tune)"
    assert set(data["perplexity"]) == {pretrained, *context_extension.ARMS}
    root = dirs[1] / "context_extension" / "smoke"
    assert (root / "pretrained_hf" / "model.safetensors").exists()
    tape = json.loads((root / "TAPE_retrofit_seed0" / "config.json").read_text())
    assert tape["model"]["position"] == "tape"
    assert tape["train"]["init_from"] == str(root / "pretrained_converted")
    cached = json.loads((root / "TAPE_retrofit_seed0" / "extrapolation_T64.json").read_text())
    assert sorted(int(r["length"]) for r in cached.values()) == [64, 128, 256, 512]
    for length, stats in data["perplexity"]["TAPE retrofit"].items():
        (ppl,) = stats["per_seed"]
        (entry,) = [r for r in cached.values() if r["length"] == int(length)]
        assert ppl == pytest.approx(math.exp(entry["loss"]), rel=1e-5)
    assert "python -m copejax.interop.convert --to_hf=" in page and "10x less tokens" in page


@pytest.mark.slow  # two tasks, two compiles each
def test_tape_tasks(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(tape_tasks, dirs)
    record = last_eval_of(workdir(dirs, "tape_tasks", "addition_tape"))
    cells = {
        tuple(int(n) for n in k.removeprefix("eval/grid/accuracy/").split("x")): v
        for k, v in record.items()
        if k.startswith("eval/grid/accuracy/")
    }
    size = max(max(c) for c in cells)
    grid = np.full((size, size), np.nan)
    for (a, b), value in cells.items():
        grid[a - 1, b - 1] = value
    assert data["addition"]["tape"]["grid_average"] == [pytest.approx(np.nanmean(grid))]
    np.testing.assert_allclose(data["addition"]["tape"]["mean_grid"], grid)
    longer = [
        grid[a - 1, b - 1] for (a, b) in cells if max(a, b) > tape_tasks.TRAIN_DIGITS["smoke"]
    ]
    assert data["addition"]["tape"]["beyond_training_average"] == [
        pytest.approx(np.nanmean(longer))
    ]
    key_record = last_eval_of(workdir(dirs, "tape_tasks", "passkey_tape"))
    for length, values in data["passkey"]["tape"].items():
        assert values == [key_record[f"eval/len_{length}/accuracy"]]
    assert "32.82" in page


def test_beyond_training_averages_the_cells_with_a_longer_operand() -> None:
    grid = np.array([[1.0, 0.9, 0.5], [0.8, 0.7, np.nan], [0.2, 0.1, 0.0]])  # [len a, len b]
    # Trained to 2 digits: the cells (1, 3), (3, 1), (3, 2), (3, 3); (2, 3) was never seen.
    assert tape_tasks.beyond_training(grid, 2) == pytest.approx((0.5 + 0.2 + 0.1 + 0.0) / 4)
    assert tape_tasks.beyond_training(grid, 1) == pytest.approx(3.2 / 7)


def test_jobs_must_be_positive() -> None:
    assert sweep.parse_args(["--jobs=2"], "flipflop").jobs == 2
    with pytest.raises(SystemExit):
        sweep.parse_args(["--jobs=0"], "flipflop")


def test_mean_std_and_arm_command() -> None:
    mean, std = sweep.mean_std([0.1, 0.3, 0.2])
    assert mean == pytest.approx(0.2) and std == pytest.approx(np.sqrt(2 / 300))
    arm = sweep.Arm("x", "configs/lm.py", "cpu,position=cope,gates=values")
    assert arm.command(2, Path("/w")) == (
        "python -m copejax.main --config=configs/lm.py:cpu,position=cope,gates=values,seed=2"
        " --workdir=/w"
    )


def test_header_of_reread_runs_states_their_logged_training_time() -> None:
    """When runs were only re-read, the header's wall time is that of the invocation; the
    training cost is then summed from the logs: each window's steps over its steps/s."""
    log = [
        {"step": 100, "train/steps_per_sec": 2.0},
        {"step": 100, "eval/test/error": 0.5},
        {"step": 300, "train/steps_per_sec": 4.0},
    ]  # 50 s + 50 s
    result = sweep.Sweep("s", "cpu", [0, 1], {"a": [log, log[:1]]}, [], 3.0, {}, reused=2)
    assert sweep_page.logged_training_s(result) == pytest.approx(150.0)
    text = sweep_page.header("t", "cpu", result, "")
    assert "2 runs were already complete" in text and "all 2 runs add up to 2.5 min" in text


@pytest.mark.slow  # two spawned processes and a third run: about 30 s on 2 cores
def test_parallel_sweep_trains_each_run_once_as_alone(tmp_path: Path) -> None:
    """``--jobs 2`` trains the runs in two processes on one CPU each; the records equal a run
    trained alone (up to the thread count's float order), a second sweep only re-reads, and
    the page header says how the runs were trained."""
    arm = sweep.Arm("cope", counting.CONFIG, "smoke,position=cope,steps=4")
    result = sweep.run_sweep("counting", "smoke", [arm], [0, 1], tmp_path / "par", jobs=2)
    assert result.reused == 0 and result.jobs == 2
    assert "2 single-threaded training processes" in sweep_page.header("t", "smoke", result, "")
    alone = sweep.train_arm(arm, 0, tmp_path / "alone")
    par, ser = sweep.last_eval(result.records["cope"][0]), sweep.last_eval(alone)
    assert par.keys() == ser.keys()
    for key in par:
        assert par[key] == pytest.approx(ser[key], rel=1e-4, abs=1e-6), key
    again = sweep.run_sweep("counting", "smoke", [arm], [0, 1], tmp_path / "par", jobs=2)
    assert again.reused == 2 and again.records == result.records


def test_complete_run_is_read_without_restoring_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workdir holding the final step of the same config is read, not handed to
    ``train.run``; one whose config differs (beyond workdir.RESUMABLE) still is, so that
    ``train.run`` refuses it with the differing keys."""
    from copejax.config.base import load_config
    from copejax.runtime.workdir import config_to_dict
    from copejax.training import train

    arm = sweep.Arm("cope", counting.CONFIG, "smoke,position=cope,steps=4")
    config = load_config(sweep.ROOT / arm.config_file, arm.config_arg(0))
    records = [{"step": 2, "train/loss": 1.0}, {"step": 4, "eval/test/error": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    saved = config_to_dict(config)
    saved["train"]["eval_every"] += 1  # resumable: still the same run
    (tmp_path / "config.json").write_text(json.dumps(saved))
    called = []
    monkeypatch.setattr(train, "run", lambda config, workdir: called.append(workdir))
    assert sweep.train_arm(arm, 0, tmp_path) == records and called == []
    saved["train"]["learning_rate"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert sweep.train_arm(arm, 0, tmp_path) == records and called == [tmp_path]


def test_length_generalization_summary_and_step_time() -> None:
    """The study's page numbers from records written here: per-task accuracy over seeds and
    ms/step from the logged steps/s without the first (compiling) window."""

    def records(long: float, test: float, speeds: list[float]) -> list[dict[str, float]]:
        logs = [{"step": 5 * (i + 1), "train/steps_per_sec": v} for i, v in enumerate(speeds)]
        final = {"eval/long/accuracy": long, "eval/test/accuracy": test}
        final.update({"eval/test/accuracy/2": test, "eval/long/accuracy/50": long})
        return [*logs, {"step": 99, **final}]

    key = lg_arms.label("parity_check", "rope")
    result = sweep.Sweep(
        study=lg_arms.STUDY,
        scale="smoke",
        seeds=[0, 1],
        records={key: [records(0.5, 1.0, [1.0, 10.0, 20.0, 40.0]), records(0.7, 0.9, [2.0, 50.0])]},
        commands=[],
        wall_time_s=1.0,
        workdirs={},
    )
    summary = lg_results.summarize(result, ["parity_check"])
    cell = summary["rope"]["parity_check"]
    assert cell["long"]["per_seed"] == [0.5, 0.7]
    assert cell["long"]["mean"] == pytest.approx(0.6) and cell["long"]["std"] == pytest.approx(0.1)
    assert cell["step_ms"]["per_seed"] == [pytest.approx(50.0), pytest.approx(20.0)]
    repeat = {
        "parity_check": {
            "long": {"accuracy": 0.5, "accuracy/50": 0.5},
            "test": {"accuracy": 0.45, "accuracy/2": 0.45},
        },
        "bucket_sort": {"long": {"accuracy": 0.9}},
    }
    long_table = lg_tables.table(summary, ["parity_check"], "long", repeat)
    assert "| `rope` | 60.0 ± 10.0 |" in long_table
    assert long_table.endswith(f"| *{lg_arms.REPEAT_RULE}* | *50.0* |")
    assert f"| *{lg_arms.REPEAT_RULE}* | *45.0* |" in lg_tables.table(
        summary, ["parity_check"], "test", repeat
    )
    assert "| `rope` | 35.0 (20.0-50.0) |" in lg_tables.time_table(summary, ["parity_check"])
    assert "| `rope` | - |" in lg_tables.table(summary, ["bucket_sort"], "long", repeat)
    assert lg_results.repeat_curve(repeat["parity_check"]) == [(2, 0.45), (50, 0.5)]
    assert lg_results.length_curves(result, "parity_check") == {
        "rope": [[(2, 1.0), (50, 0.5)], [(2, 0.9), (50, 0.7)]]
    }
    fox = {"long": sweep.spread(0.4, 0.0, [0.4, 0.4])}
    two = {"rope": summary["rope"], "fox": {"parity_check": fox}}
    ranked = lg_tables.reading(two, ["parity_check"], {"parity_check": {"long": {"accuracy": 0.3}}})
    assert ranked == (
        "`parity_check`: best on the test lengths `rope` 60.0 %, then `fox` 40.0 % "
        "(ahead on every seed)."
    )
    # the rule is named only where some arm has every seed at or below it (rope's seeds
    # are 0.5 and 0.7, fox's 0.4 and 0.4)
    floor = lg_tables.reading(two, ["parity_check"], {"parity_check": {"long": {"accuracy": 0.45}}})
    assert floor == ranked + (
        f" On `parity_check` the {lg_arms.REPEAT_RULE} scores 45.0 %: every seed of `rope` is "
        "above it, every seed of `fox` at or below it."
    )
    straddled = lg_tables.reading(
        two, ["parity_check"], {"parity_check": {"long": {"accuracy": 0.6}}}
    )
    assert straddled == ranked + (
        f" On `parity_check` the {lg_arms.REPEAT_RULE} scores 60.0 %: every seed of `fox` at or "
        "below it."
    )
    tie = lg_tables.reading(
        {"rope": {"parity_check": fox}, "fox": {"parity_check": fox}},
        ["parity_check"],
        {"parity_check": {"long": {"accuracy": 0.3}}},
    )
    assert tie == "`parity_check`: 2 arms tie on the test lengths at 40.0 % (`rope`, `fox`)."


def test_length_generalization_regenerate_command_has_the_pages_flags() -> None:
    """The page's regenerate command repeats the flags that shaped it: a subset of tasks,
    the peer (with its threads), the init probe, the parametrisation probe (with a subset of
    its arms), the kept runs and a non-default seed count; none of them for a full default
    run (``--jobs`` only changes the wall time, so it is not repeated)."""
    Own = argparse.Namespace
    plain = Own(
        peer=False, peer_threads=0, init_probe=False, peer_probe=False, peer_probe_arms="",
        records="",
    )  # fmt: skip
    assert length_generalization.page_options(plain, lg_arms.SCALE_TASKS["cpu"], "cpu") == []
    everything = Own(
        peer=True, peer_threads=1, init_probe=True, peer_probe=True, peer_probe_arms="",
        records="experiments/records",
    )  # fmt: skip
    got = length_generalization.page_options(
        everything, ["reverse_string", "duplicate_string"], "cpu"
    )
    tasks = "--tasks=reverse_string,duplicate_string"
    records = "--records=experiments/records"
    assert got == [tasks, "--peer", "--peer-threads=1", "--init-probe", "--peer-probe", records]
    all_arms = ",".join(lg_arms.PEER_PROBE_ARMS)
    every_arm = argparse.Namespace(**{**vars(everything), "peer_probe_arms": all_arms})
    assert (
        length_generalization.page_options(every_arm, ["reverse_string", "duplicate_string"], "cpu")
        == got
    )
    some = argparse.Namespace(**{**vars(everything), "peer_probe_arms": "fox, rope"})
    subset = length_generalization.page_options(some, ["reverse_string", "duplicate_string"], "cpu")
    assert subset == [*got[:5], "--peer-probe-arms=rope,fox", records]  # the probe's order
    runs = sweep.Sweep(
        study=lg_arms.STUDY,
        scale="cpu",
        seeds=[0],
        records={},
        commands=["<run>"],
        wall_time_s=1.0,
        workdirs={},
    )
    default_seeds = sweep.parse_args(["--scale=cpu"], lg_arms.STUDY)
    block = sweep_page.commands_block(lg_arms.STUDY, default_seeds, runs, got)
    assert (
        "python -m experiments.length_generalization --scale=cpu "
        "--tasks=reverse_string,duplicate_string --peer --peer-threads=1 --init-probe "
        "--peer-probe --records=experiments/records\n"
    ) in block
    three_seeds = sweep.parse_args(["--seeds=3", "--jobs=2"], lg_arms.STUDY)
    block = sweep_page.commands_block(lg_arms.STUDY, three_seeds, runs, [])
    assert "python -m experiments.length_generalization --scale=cpu --seeds=3\n" in block


@pytest.mark.slow  # eight arms, one compile each (about a minute on 2 cores)
def test_length_generalization(dirs: tuple[Path, Path]) -> None:
    page, data = run_study(length_generalization, dirs)
    record = last_eval_of(workdir(dirs, "length_generalization", "reverse_string__cope"))
    got = data["results"]["cope"]["reverse_string"]["long"]
    assert got["per_seed"] == [record["eval/long/accuracy"]]
    assert f"{100 * record['eval/long/accuracy']:.1f} ± 0.0" in page
    assert set(data["results"]) == set(lg_arms.ARMS)
    assert "Not run yet: the x-transformers" in page
    per_seed = f"| reverse_string, cope | {100 * record['eval/long/accuracy']:.1f} |"
    assert per_seed in page
    assert data["peer"] == {}


def test_length_generalization_peer_per_seed_and_json() -> None:
    """The peer's every seed listed in seed order, and its JSON cells in copejax's shape."""
    runs = [
        {"test/accuracy": 0.9, "long/accuracy": 0.25, "step_ms": 10.0},
        {"test/accuracy": 1.0, "long/accuracy": 0.75, "step_ms": 30.0},
    ]
    peer = {"rope": {"parity_check": runs}}
    assert "| parity_check, rope | 25.0 / 75.0 | 90.0 / 100.0 |" in lg_tables.peer_per_seed(
        peer, ["parity_check"]
    )
    cell = lg_results.peer_json(peer)["rope"]["parity_check"]
    assert cell["long"]["per_seed"] == [0.25, 0.75] and cell["long"]["mean"] == 0.5
    assert cell["test"]["per_seed"] == [0.9, 1.0] and cell["step_ms"]["mean"] == 20.0


def test_median_range_keeps_one_fast_run_out_of_the_cell() -> None:
    """Timing cells: the median over seeds, the fastest and slowest in brackets."""
    assert sweep.median_range([150.0, 148.0, 92.0, 152.0, 149.0]) == "149.0 (92.0-152.0)"
    assert sweep.median_range([10.0, 20.0]) == "15.0 (10.0-20.0)"
    assert sweep.median_range([7.25]) == "7.2 (7.2-7.2)"
    assert sweep.median_range([1.0, 1.5, 1.25], digits=2, unit="x") == "1.25x (1.00-1.50)"
    assert sweep.median_range([]) == "n/a" and sweep.median_range([float("nan")]) == "n/a"


def test_length_generalization_peer_side_by_side() -> None:
    """The peer table: agreement within the larger seed std, one-seed cells marked n/a."""
    ours = {"long": sweep.spread(0.6, 0.1, [0.5, 0.7]), "step_ms": sweep.spread(5.0, 1.0, [4, 6])}
    theirs = [{"long/accuracy": a, "step_ms": 20.0} for a in (0.65, 0.75)]
    far = [{"long/accuracy": a, "step_ms": 30.0} for a in (0.9, 0.9)]
    table = lg_tables.peer_section(
        {"rope": {"parity_check": ours, "bucket_sort": ours}},
        {"rope": {"parity_check": theirs, "bucket_sort": far}},
        ["parity_check", "bucket_sort"],
    )
    assert (
        "| `rope` | parity_check | 60.0 ± 10.0 | 70.0 ± 5.0 | yes (p = 0.67) | 5.0 (4.0-6.0) "
        "| 20.0 (20.0-20.0) |" in table
    )  # 4 of the 6 splits of {0.5, 0.7, 0.65, 0.75} are at least 10 points apart
    assert "| `rope` | bucket_sort | 60.0 ± 10.0 | 90.0 ± 0.0 | no (gap 30.0, p = 0.33) |" in table
    one = lg_tables.peer_section(
        {"rope": {"parity_check": {**ours, "long": sweep.spread(0.6, 0.0, [0.6])}}},
        {"rope": {"parity_check": theirs[:1]}},
        ["parity_check"],
    )
    assert "n/a, one seed (gap 5.0)" in one


def test_length_generalization_init_probe_section_and_json() -> None:
    """The probe table: the study's init, the torch-scale init and the peer side by side per
    split, and whether each init's test-length accuracy is within the peer's seed spread; the
    probe's config carries the options it names."""
    from copejax.config.base import load_config

    def run(test: float, long: float) -> list[dict[str, float]]:
        return [{"step": 9, "eval/test/accuracy": test, "eval/long/accuracy": long}]

    result = sweep.Sweep(
        study=lg_arms.STUDY,
        scale="smoke",
        seeds=[0, 1],
        records={
            lg_arms.label("parity_check", "nope"): [run(0.7, 0.5), run(0.9, 0.5)],
            lg_arms.probe_label("parity_check", "nope"): [run(1.0, 0.6), run(1.0, 0.8)],
        },
        commands=[],
        wall_time_s=1.0,
        workdirs={},
    )
    peer = {"nope": {"parity_check": [{"test/accuracy": 0.95, "long/accuracy": 0.65}] * 2}}
    table = lg_tables.init_probe_section(result, peer, ["parity_check"])
    assert (
        "| `nope` | parity_check | 80.0 ± 10.0 | 100.0 ± 0.0 | 95.0 ± 0.0 "
        "| 50.0 ± 0.0 | 70.0 ± 10.0 | 65.0 ± 0.0 | no (gap 15.0, p = 0.33) | yes (p = 1) |" in table
    )
    assert "`alibi`" not in table  # probe arms that did not run are left out
    probe = lg_results.summarize(
        result, ["parity_check"], lg_arms.INIT_PROBE_ARMS, lg_arms.probe_label
    )
    cell = probe["nope"]["parity_check"]
    assert cell["long"]["per_seed"] == [0.6, 0.8] and cell["test"]["mean"] == 1.0
    config = load_config(
        sweep.ROOT / lg_arms.CONFIG,
        f"parity_check,smoke,position=nope{lg_arms.INIT_PROBE}",
    )
    assert config.model.init_std == 0.072 and config.model.scale_embeddings is False
    assert config.model.dense_init == "normal"  # every weight N(0, 0.072^2)
    default = load_config(sweep.ROOT / lg_arms.CONFIG, "parity_check,smoke,position=nope")
    assert default.model.scale_embeddings is True and default.model.dense_init == "fan_in"


def test_length_generalization_tasks_subset() -> None:
    assert lg_arms.select_tasks("cpu", "") == lg_arms.SCALE_TASKS["cpu"]
    assert lg_arms.select_tasks("cpu", "parity_check, reverse_string") == (
        "reverse_string",
        "parity_check",
    )
    with pytest.raises(SystemExit, match="unknown \\['reverse'\\]; the cpu scale has"):
        lg_arms.select_tasks("cpu", "reverse")
    with pytest.raises(SystemExit, match="unknown"):
        lg_arms.select_tasks("smoke", "parity_check")  # not among the smoke scale's tasks


def test_length_generalization_probe_arms_subset() -> None:
    """The parametrisation probe trains every peer arm, or a named subset in the peer's
    order; an unknown name is an error that lists the peer's arms."""
    assert (
        lg_arms.select_probe_arms("") == lg_arms.PEER_PROBE_ARMS == length_generalization_peer.ARMS
    )
    assert lg_arms.select_probe_arms("fox,learned") == ("learned", "fox")
    with pytest.raises(SystemExit, match="unknown \\['randomized'\\]; the peer has nope"):
        lg_arms.select_probe_arms("nope,randomized")  # copejax's arm, not the peer's


def test_length_generalization_probe_arms_per_task() -> None:
    """``--peer-probe-arms`` names the probe's arms for every task, or per task as
    ``TASK:ARM+ARM`` (a task not named is not probed); the page's regenerate command writes
    the plan back in the shortest form that reads back the same."""
    tasks = ("reverse_string", "duplicate_string", "odds_first")
    every = lg_arms.select_probe_plan("", tasks)
    assert every == dict.fromkeys(tasks, lg_arms.PEER_PROBE_ARMS)
    assert lg_arms.select_probe_plan("fox,nope", tasks) == dict.fromkeys(tasks, ("nope", "fox"))
    spec = "odds_first:sinusoidal+nope, reverse_string:fox+rope+nope"
    plan = lg_arms.select_probe_plan(spec, tasks)
    assert plan == {"reverse_string": ("nope", "rope", "fox"), "odds_first": ("nope", "sinusoidal")}
    flag = lg_arms.probe_plan_flag(plan, tasks)
    assert flag == "reverse_string:nope+rope+fox,odds_first:nope+sinusoidal"
    assert lg_arms.select_probe_plan(flag, tasks) == plan
    assert lg_arms.probe_plan_flag(every, tasks) == ""
    same = lg_arms.select_probe_plan(",".join(f"{t}:nope+rope" for t in tasks), tasks)
    assert lg_arms.probe_plan_flag(same, tasks) == "nope,rope"
    with pytest.raises(SystemExit, match="task 'bucket_sort' not among the page's tasks"):
        lg_arms.select_probe_plan("bucket_sort:nope", tasks)
    with pytest.raises(SystemExit, match="task 'odds_first' named twice"):
        lg_arms.select_probe_plan("odds_first:nope,odds_first:rope", tasks)
    with pytest.raises(SystemExit, match="not both"):
        lg_arms.select_probe_plan("nope,odds_first:rope", tasks)
    with pytest.raises(SystemExit, match="names no arm"):
        lg_arms.select_probe_plan("odds_first:", tasks)
    with pytest.raises(SystemExit, match="unknown \\['randomized'\\]"):
        lg_arms.select_probe_plan("odds_first:nope+randomized", tasks)
    own = argparse.Namespace(
        peer=True, peer_threads=1, init_probe=False, peer_probe=True, peer_probe_arms=spec,
        records="",
    )  # fmt: skip
    assert length_generalization.page_options(own, tasks, "cpu")[-1] == f"--peer-probe-arms={flag}"


def test_peer_venv_is_built_once_for_concurrent_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_peer's threads all ask for the side venv at once: one creates and installs it, the
    others wait and reuse it (they used to pip-install into a venv still being created); a
    venv whose install did not finish (no pins.txt) is created afresh."""
    import threading
    import time

    peer = length_generalization_peer
    monkeypatch.setattr(peer, "PEER_VENV", tmp_path / "venv")
    created, installed = [], []

    class Builder:
        def __init__(self, *, with_pip: bool, clear: bool) -> None:
            assert with_pip and clear

        def create(self, path: Path) -> None:
            created.append(path)
            time.sleep(0.2)  # long enough for the other threads to arrive
            (path / "bin").mkdir(parents=True, exist_ok=True)
            (path / "bin" / "python").write_text("")

    def install(command: list[str], check: bool) -> None:
        assert Path(command[0]).exists(), "pip ran before the venv existed"
        installed.append(command[-len(peer.PINS) :])

    monkeypatch.setattr(peer.venv, "EnvBuilder", Builder)
    monkeypatch.setattr(peer.subprocess, "run", install)
    threads = [threading.Thread(target=peer.ensure_venv) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(created) == 1 and installed == [list(peer.PINS)]
    assert peer.ensure_venv() == tmp_path / "venv" / "bin" / "python" and len(created) == 1
    (tmp_path / "venv" / "pins.txt").unlink()  # an install that was cut off
    peer.ensure_venv()
    assert len(created) == 2 and len(installed) == 2


def test_peer_runs_train_once_each_with_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_peer trains every (task, arm, seed) not cached, jobs at a time, and then only
    reads: results come back per arm, task and seed in seed order."""
    peer = length_generalization_peer
    calls = []

    def fake_run(config_arg: str, arm: str, threads: int, parametrisation: str) -> dict:
        calls.append((config_arg, arm, threads))
        seed = int(config_arg.rsplit("seed=", 1)[1])
        offset = 0.5 if parametrisation == "copejax" else 0.0
        return {"long/accuracy": offset + seed / 10, "step_ms": 1.0}

    monkeypatch.setattr(peer, "run", fake_run)
    out = lg_results.run_peer(["parity_check"], "smoke", [0, 1], str(tmp_path), 1, jobs=2)
    assert len(calls) == 2 * len(peer.ARMS)
    assert {arg for arg, _, _ in calls} == {"parity_check,smoke,steps=10,seed=0",
                                            "parity_check,smoke,steps=10,seed=1"}  # fmt: skip
    assert [r["long/accuracy"] for r in out["rope"]["parity_check"]] == [0.0, 0.1]
    again = lg_results.run_peer(["parity_check"], "smoke", [0, 1], str(tmp_path), 1, jobs=2)
    assert len(calls) == 2 * len(peer.ARMS) and again == out
    probe = lg_results.run_peer(
        ["parity_check"], "smoke", [0, 1], str(tmp_path), 1, parametrisation="copejax",
        arms=("nope", "sinusoidal"),
    )  # fmt: skip
    assert sorted(probe) == ["nope", "sinusoidal"]
    assert [r["long/accuracy"] for r in probe["nope"]["parity_check"]] == [0.5, 0.6]
    assert len(calls) == 2 * len(peer.ARMS) + 4  # cached apart from the default runs
    cached = sorted(p.name for p in (tmp_path / lg_arms.STUDY / "smoke" / "peer").iterdir())
    assert "parity_check_nope_seed1_copejax.json" in cached and len(cached) == 18
    assert lg_results.run_peer(["parity_check"], "smoke", [0, 1], str(tmp_path), 1) == out


def test_length_generalization_peer_probe_section() -> None:
    """The parametrisation probe's table: copejax, the peer and the re-parametrised peer per
    split, each peer's agreement with copejax's spread, and the probe's every seed."""
    ours = {
        "test": sweep.spread(0.9, 0.0, [0.9, 0.9]),
        "long": sweep.spread(0.6, 0.1, [0.5, 0.7]),
    }
    peer = {"nope": {"parity_check": [{"test/accuracy": 1.0, "long/accuracy": 0.9}] * 2}}
    probe = {
        "nope": {
            "parity_check": [
                {"test/accuracy": 0.8, "long/accuracy": 0.55},
                {"test/accuracy": 1.0, "long/accuracy": 0.65},
            ]
        }
    }
    table = lg_tables.peer_probe_section(
        {"nope": {"parity_check": ours}}, peer, probe, ["parity_check"]
    )
    assert (
        "| `nope` | parity_check | 90.0 ± 0.0 | 100.0 ± 0.0 | 90.0 ± 10.0 | 60.0 ± 10.0 "
        "| 90.0 ± 0.0 | 60.0 ± 5.0 | no (gap 30.0, p = 0.33) | yes (p = 1) | 55.0 / 65.0 |" in table
    )
    assert "`sinusoidal`" not in table  # probe arms that did not run are left out


def test_length_generalization_peer_schedule_and_data(tmp_path: Path) -> None:
    """The peer's learning rate is copejax's schedule; its data are the trainer's batches."""
    from copejax.config.base import load_config
    from copejax.data.base import make_task
    from copejax.training import input_pipeline, optim

    peer = length_generalization_peer
    config = load_config(peer.CONFIG, "parity_check,smoke,steps=6,seed=2")
    for schedule in ("cosine", "linear", "constant"):
        config.train.update(schedule=schedule, warmup_steps=2, steps=6)
        reference = optim.learning_rate_schedule(config.train)
        for step in range(8):
            got = length_generalization_peer_worker.learning_rate(config.train.to_dict(), step)
            assert got == pytest.approx(float(reference(step)), rel=1e-5, abs=1e-9)
    spec = peer.spec_of("parity_check,smoke,steps=3,seed=2", "cope")
    assert spec["arm"] == "cope" and spec["cope_p_max"] == 64 and spec["seed"] == 2
    assert spec["mlp_dim"] > 0 and spec["head_dim"] * spec["num_heads"] == spec["d_model"]
    peer.write_data(spec, tmp_path / "data.npz")
    data = np.load(tmp_path / "data.npz")
    task = make_task("parity_check", spec["task_options"])
    stream = input_pipeline.train_dataset(task, 2, spec["train"]["batch_size"])
    for step in range(3):
        np.testing.assert_array_equal(data["train_inputs"][step], stream[step]["inputs"])
    assert data["long_inputs"].shape[-1] == task.split_length("long")
    with pytest.raises(ValueError, match="unknown peer arm"):
        peer.spec_of("parity_check,smoke", "randomized")
    assert spec["parametrisation"] == "x-transformers" and spec["init_std"] == 0.02
    as_copejax = peer.spec_of("parity_check,smoke", "sinusoidal", "copejax")
    assert as_copejax["parametrisation"] == "copejax"
    rope = peer.spec_of("parity_check,smoke", "rope", "copejax")
    assert rope["copejax_position"] == {"rotary_dim": rope["head_dim"]}
    with pytest.raises(ValueError, match="unknown peer parametrisation 'haiku'"):
        peer.spec_of("parity_check,smoke", "nope", "haiku")


@pytest.mark.slow  # creates the side venv (torch, x-transformers) on first use
def test_length_generalization_peer_trains() -> None:
    results = length_generalization_peer.run("parity_check,smoke,steps=3", "rope", threads=1)
    for split in ("test", "long"):
        assert 0.0 <= results[f"{split}/accuracy"] <= 1.0
    assert results["step_ms"] > 0 and results["threads"] == 1
    probe = length_generalization_peer.run(
        "parity_check,smoke,steps=3", "sinusoidal", threads=1, parametrisation="copejax"
    )
    assert 0.0 <= probe["long/accuracy"] <= 1.0 and probe["final_loss"] > 0


# Run by the side venv's Python: builds the peer for the spec in argv[1] and prints what its
# weights and maps are (torch and x-transformers are not importable in the test's process).
_DESCRIBE_PEER = """
import json, math, sys
import torch
sys.path.insert(0, sys.argv[2])
import length_generalization_peer_worker as peer
spec = json.loads(sys.argv[1])
torch.manual_seed(spec["seed"])
model = peer.build_model(spec)
table = model.token_emb.emb.weight
ids = torch.arange(spec["vocab_size"])
linears = [m for m in model.attn_layers.modules() if isinstance(m, torch.nn.Linear)]
scale = getattr(model.pos_emb, "scale", None)
print(json.dumps({
    "table_std": table.std().item(),
    "lookup_over_row": (model.token_emb(ids) / table[ids]).flatten().tolist(),
    "logit_scale": model.tie_embedding_scale,
    "kernel_std_times_sqrt_fan_in": [m.weight.std().item() * math.sqrt(m.in_features)
                                     for m in linears],
    "kernel_max_times_sqrt_fan_in": [m.weight.abs().max().item() * math.sqrt(m.in_features)
                                     for m in linears],
    "biases": sum(m.bias is not None for m in linears),
    "sinusoid_scale": None if scale is None else [scale.item(), scale.requires_grad],
}))
"""


def _describe_peer(script: str, arm: str, parametrisation: str) -> dict:
    """Runs ``script`` in the peer's side venv on the spec of ``arm`` (``parity_check,smoke``)
    and returns the JSON it prints, with the spec's ``d_model``, ``head_dim`` and
    ``init_std``."""
    peer = length_generalization_peer
    spec = peer.spec_of("parity_check,smoke", arm, parametrisation)
    command = [
        str(peer.ensure_venv()),
        "-c",
        script,
        json.dumps(spec),
        str(peer.ROOT / "experiments"),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return {
        **json.loads(out),
        "d": spec["d_model"],
        "head_dim": spec["head_dim"],
        "init_std": spec["init_std"],
    }


@pytest.mark.slow  # the side venv (torch, x-transformers), created on first use
def test_copejax_parametrised_peer_starts_as_copejax() -> None:
    """The probe's peer: token table N(0, init_std^2) read times sqrt(D), tied logits at
    scale 1, every block kernel a normal truncated at two std (std 1 / sqrt(fan_in), so the
    sample std is 0.88 / sqrt(fan_in)), no biases, the sinusoid at a fixed scale 1; the
    default peer keeps x-transformers' Kaiming table, D^-1/2 logits, uniform kernels (sample
    std 0.58 / sqrt(fan_in)), MLP biases and a learned D^-1/2 sinusoid scale."""
    ours = _describe_peer(_DESCRIBE_PEER, "sinusoidal", "copejax")
    theirs = _describe_peer(_DESCRIBE_PEER, "sinusoidal", "x-transformers")
    d = ours["d"]
    assert ours["table_std"] == pytest.approx(ours["init_std"], rel=0.25)
    np.testing.assert_allclose(ours["lookup_over_row"], math.sqrt(d), rtol=1e-5)
    assert ours["logit_scale"] == 1.0 and ours["biases"] == 0
    assert all(0.75 < s < 1.0 for s in ours["kernel_std_times_sqrt_fan_in"])
    assert all(m <= 2.0 + 1e-6 for m in ours["kernel_max_times_sqrt_fan_in"])
    assert ours["sinusoid_scale"] == [1.0, False]
    assert theirs["table_std"] == pytest.approx(math.sqrt(2 / d), rel=0.25)
    np.testing.assert_allclose(theirs["lookup_over_row"], 1.0, rtol=1e-6)
    assert theirs["logit_scale"] == pytest.approx(d**-0.5) and theirs["biases"] > 0
    assert all(0.45 < s < 0.7 for s in theirs["kernel_std_times_sqrt_fan_in"])
    assert theirs["sinusoid_scale"] == [pytest.approx(d**-0.5), True]


_DESCRIBE_PEER_POSITIONS = """
import json, sys
import torch
sys.path.insert(0, sys.argv[2])
import length_generalization_peer_worker as peer
spec = json.loads(sys.argv[1])
model = peer.build_model(spec)
torch.manual_seed(spec["seed"])
model = peer.build_model(spec)
rotary = model.attn_layers.rotary_pos_emb
gates = [m.to_forget_gates[0] for m in model.modules() if type(m).__name__ == "DataDependentAlibi"]
table = getattr(model.pos_emb, "emb", None)
print(json.dumps({
    "rotated": None if rotary is None else 2 * rotary.inv_freq.numel(),
    "forget_bias": [g.bias.tolist() for g in gates],
    "forget_kernel_std": [g.weight.std().item() for g in gates],
    "position_table": None if table is None else [table.weight.std().item(), model.pos_emb.scale],
}))
"""


@pytest.mark.slow  # the side venv (torch, x-transformers), created on first use
def test_peer_rope_and_fox_keep_x_transformers_choices() -> None:
    """What the page says of the peer's ``rope`` and ``fox`` arms holds for the pinned
    x-transformers: its RoPE rotates dim_head // 2 features (copejax all of them) and its
    forget gate's bias starts at 5 (copejax's ``forget_bias_init`` at 0)."""
    rope = _describe_peer(_DESCRIBE_PEER_POSITIONS, "rope", "x-transformers")
    assert rope["rotated"] == rope["head_dim"] // 2 and rope["forget_bias"] == []
    fox = _describe_peer(_DESCRIBE_PEER_POSITIONS, "fox", "x-transformers")
    assert fox["rotated"] is None and len(fox["forget_bias"]) > 0
    np.testing.assert_array_equal(np.concatenate(fox["forget_bias"]), 5.0)


@pytest.mark.slow  # the side venv (torch, x-transformers), created on first use
def test_copejax_parametrised_peer_starts_positions_as_copejax() -> None:
    """The probe's peer starts each scheme's own weights as copejax's scheme does: RoPE
    rotates all of each head (``fraction = 1``), the FoX gate's kernel is N(0, 0.02²) and its
    bias ``forget_bias_init`` = 0, the learned table N(0, 0.02²) at scale 1 (the default peer:
    N(0, 1) at D^-1/2)."""
    from copejax.positions import fox, learned, rope

    ours = _describe_peer(_DESCRIBE_PEER_POSITIONS, "rope", "copejax")
    assert ours["rotated"] == ours["head_dim"] and rope.RoPE().fraction == 1.0
    ours = _describe_peer(_DESCRIBE_PEER_POSITIONS, "fox", "copejax")
    np.testing.assert_array_equal(np.concatenate(ours["forget_bias"]), fox.FoX().forget_bias_init)
    assert all(s == pytest.approx(fox.GATE_INIT_STD, rel=0.3) for s in ours["forget_kernel_std"])
    ours = _describe_peer(_DESCRIBE_PEER_POSITIONS, "learned", "copejax")
    theirs = _describe_peer(_DESCRIBE_PEER_POSITIONS, "learned", "x-transformers")
    std = learned.Learned().init_std
    assert ours["position_table"] == [pytest.approx(std, rel=0.1), 1.0]
    d_scale = pytest.approx(ours["d"] ** -0.5)
    assert theirs["position_table"] == [pytest.approx(1.0, rel=0.1), d_scale]


def test_peer_refuses_schemes_it_cannot_build() -> None:
    """The peer has RoPE at base 10000 without scaling and FoX's basic gate only: a config
    asking for more is an error that names it, not a silently different peer."""
    from copejax.positions import fox, rope

    peer = length_generalization_peer
    assert peer.copejax_position("rope", rope.RoPE(fraction=0.5), 16) == {"rotary_dim": 8}
    with pytest.raises(ValueError, match="the config turns on \\['output_gate'\\]"):
        peer.copejax_position("fox", fox.FoX(output_gate=True), 16)
    with pytest.raises(ValueError, match=r"got base=500\.0"):
        peer.copejax_position("rope", rope.RoPE(base=500.0), 16)
    with pytest.raises(ValueError, match="scaling='linear'"):
        peer.copejax_position("rope", rope.RoPE(scaling="linear", factor=2.0), 16)


def test_peer_weight_map_layouts() -> None:
    """The permutations that match copejax's layouts to x-transformers': RoPE's pairs
    (f, f + R/2) to (2f, 2f + 1) over the rotated features only, and the residual stream's
    sin/cos pairs to halves on each parameter's residual axis; a parameter without a known
    residual axis is an error that names it."""
    weights = length_generalization_peer_weights
    kernel = np.arange(8.0).reshape(1, 1, 8)
    np.testing.assert_array_equal(
        weights._interleave_rotary(kernel, 8)[0, 0], [0, 4, 1, 5, 2, 6, 3, 7]
    )
    np.testing.assert_array_equal(
        weights._interleave_rotary(kernel, 4)[0, 0], [0, 2, 1, 3, 4, 5, 6, 7]
    )
    params = {
        "token_embed/embedding": np.arange(8.0)[None],
        "block_0/attention/out/kernel": np.arange(8.0).reshape(1, 1, 8),
    }
    halves = weights._sinusoid_halves(params, 8)
    np.testing.assert_array_equal(halves["token_embed/embedding"][0], [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(
        halves["block_0/attention/out/kernel"][0, 0], [0, 2, 4, 6, 1, 3, 5, 7]
    )
    with pytest.raises(ValueError, match="alibi/slopes: no residual axis of width 8"):
        weights._sinusoid_halves({"block_0/attention/alibi/slopes": np.ones(4)}, 8)


@pytest.mark.slow  # the side venv (torch, x-transformers) and seven small models
def test_peer_with_copejax_weights_computes_and_trains_as_copejax() -> None:
    """With copejax's (noised) initial weights copied in, x-transformers in copejax's
    parametrisation computes copejax's logits for every study arm, and ten training steps on
    the study's batches (copejax's own jitted train step against the torch loop) give the same
    losses: the two implementations build and train the same function, so a gap between their
    trained accuracies is the random initialisation and the seeds, not the code."""
    weights = length_generalization_peer_weights
    for arm in length_generalization_peer.ARMS:
        found = weights.compare("parity_check,smoke", arm, steps=10)
        assert found["max_abs_logit"] > 0.5, arm  # logits large enough to tell a difference
        assert found["max_abs_difference"] < 1e-4 * found["max_abs_logit"], (arm, found)
        assert len(found["losses"]) == len(found["peer_losses"]) == 10
        assert found["losses"][-1] < found["losses"][0], arm  # the steps do train
        np.testing.assert_allclose(found["peer_losses"], found["losses"], rtol=1e-4, err_msg=arm)


def test_length_generalization_same_function_section() -> None:
    """The same-function table: per arm the logit gap beside the largest logit, copejax's
    first and last compared loss, and the largest loss gap."""
    found = {
        "max_abs_difference": 4.8e-6,
        "max_abs_logit": 2.82,
        "losses": [1.3512, 1.0, 0.7452],
        "peer_losses": [1.3512, 1.0, 0.7452],
        "max_loss_difference": 6e-7,
    }
    table = lg_tables.same_function_section({"nope": found})
    assert "| `nope` | 4.8e-06 | 2.82 | 1.3512 → 0.7452 | 6.0e-07 |" in table
    note = lg_page.SAME_FUNCTION_NOTE.format(noise=0.1, steps=20, task="t")
    assert "N(0, 0.1²)" in note and "20 steps" in note and "`t` batches" in note
