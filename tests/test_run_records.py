"""experiments/run_records.py: complete runs (config and metrics) and peer results are kept
and read back; unfinished runs and runs of this machine are never kept over or overwritten;
a sweep with ``records_dir`` reads a kept run instead of training it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from copejax.config.base import load_config
from copejax.runtime.workdir import config_to_dict
from experiments import counting, run_records, sweep

ARM = sweep.Arm("cope", counting.CONFIG, "smoke,position=cope,steps=4")


def write_run(workdir: Path, steps_done: int, seed: int = 0) -> list[dict]:
    """A workdir as training leaves it: ARM's config for ``seed`` and metrics up to
    ``steps_done`` (the config has 4 steps), with a checkpoint directory."""
    config = load_config(sweep.ROOT / ARM.config_file, ARM.config_arg(seed))
    records = [{"step": s, "train/loss": 1.0 / s} for s in range(2, steps_done + 1, 2)]
    records.append({"step": steps_done, "eval/test/error": 0.25})
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps(config_to_dict(config)))
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (workdir / "checkpoints" / str(steps_done)).mkdir(parents=True)
    return records


def test_save_keeps_complete_runs_and_peer_results_and_restore_reads_them(tmp_path: Path) -> None:
    work, kept = tmp_path / "work" / "counting" / "smoke", tmp_path / "records"
    write_run(work / "cope_seed0", 4)
    write_run(work / "cope_seed1", 2, seed=1)  # unfinished: not kept
    (work / "peer").mkdir()
    (work / "peer" / "task_rope_seed0.json").write_text('{"long/accuracy": 0.5}')
    assert run_records.complete(work / "cope_seed0")
    assert not run_records.complete(work / "cope_seed1")

    assert run_records.save(tmp_path / "work", kept, "counting", "smoke") == 2
    saved = kept / "counting" / "smoke"
    assert sorted(p.name for p in (saved / "cope_seed0").iterdir()) == [
        "config.json",
        "metrics.jsonl",
    ]  # no checkpoints
    assert not (saved / "cope_seed1").exists()
    assert (saved / "peer" / "task_rope_seed0.json").read_text() == '{"long/accuracy": 0.5}'
    assert run_records.save(tmp_path / "work", kept, "counting", "smoke") == 0  # unchanged

    fresh = tmp_path / "fresh"
    assert run_records.restore(kept, fresh, "counting", "smoke") == 2
    for name in run_records.RUN_FILES:
        restored = fresh / "counting" / "smoke" / "cope_seed0" / name
        assert restored.read_bytes() == (work / "cope_seed0" / name).read_bytes()
    assert (fresh / "counting" / "smoke" / "peer" / "task_rope_seed0.json").exists()
    assert run_records.restore(kept, fresh, "counting", "smoke") == 0  # already there
    assert run_records.restore(kept, fresh, "counting", "cpu") == 0  # no records of that scale


def test_restore_never_overwrites_a_run_of_this_machine(tmp_path: Path) -> None:
    kept = tmp_path / "records"
    write_run(tmp_path / "old" / "counting" / "smoke" / "cope_seed0", 4)
    run_records.save(tmp_path / "old", kept, "counting", "smoke")
    here = tmp_path / "here" / "counting" / "smoke" / "cope_seed0"
    mine = write_run(here, 2)  # training in progress on this machine
    assert run_records.restore(kept, tmp_path / "here", "counting", "smoke") == 0
    lines = (here / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == mine


def test_sweep_reads_kept_runs_instead_of_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep over a fresh workroot with ``records_dir`` trains nothing: both seeds are copied
    in, read and counted as re-read; the records are left as they were."""
    from copejax.training import train

    kept = tmp_path / "records"
    expected = [write_run(tmp_path / "old" / "counting" / "smoke" / f"cope_seed{s}", 4, s)
                for s in (0, 1)]  # fmt: skip
    run_records.save(tmp_path / "old", kept, "counting", "smoke")
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}

    def refuse(config: object, workdir: Path) -> None:
        raise AssertionError(f"train.run called for {workdir}")

    monkeypatch.setattr(train, "run", refuse)
    result = sweep.run_sweep(
        "counting", "smoke", [ARM], [0, 1], tmp_path / "fresh", jobs=2, records_dir=kept
    )
    assert result.records["cope"] == expected and result.reused == 2
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before
