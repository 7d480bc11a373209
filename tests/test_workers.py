"""experiments.workers: runs side by side, each pinned to one CPU, labelled, stopped together."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest

from experiments import workers

# A stand-in for copejax.main: says where it runs, then does what its argument asks.
PROBE = textwrap.dedent(
    """
    import os, signal, sys, time

    def saved(signum, frame):
        print("saved at the signal", flush=True)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, saved)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    print(f"cpus {cpus}")
    print(f"flags {os.environ.get('XLA_FLAGS', '')}")
    what = sys.argv[1]
    if what == "fail":
        sys.exit(3)
    if what == "stop":  # the batch's process receives SIGTERM, as from a job scheduler
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(30)
        sys.exit("the signal was not passed on")
    time.sleep(0.5)  # both runs of a batch of two are alive at once
    print("beyond ascii: \u03c0 \u2248 3.14")
    print("done")
    """
)


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "workers_probe.py").write_text(PROBE)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return "workers_probe"


def _lines(text: str, label: str) -> list[str]:
    prefix = f"[{label}] "
    return [line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)]


def test_runs_side_by_side_on_one_cpu_each_with_labelled_lines(
    probe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    jobs = [workers.Job("a", (probe, "ok")), workers.Job("b seed 1", (probe, "ok"))]
    outcome = workers.run_pinned(jobs, processes=2)
    assert outcome == workers.Outcome({"a": 0, "b seed 1": 0}) and not outcome.failed()
    out = capsys.readouterr().out
    runs = {label: _lines(out, label) for label in ("a", "b seed 1")}
    for lines in runs.values():
        assert lines[-2:] == ["beyond ascii: \u03c0 \u2248 3.14", "done"] and len(lines) == 4, out
        assert workers.SINGLE_THREAD_FLAGS in lines[1]
    if hasattr(os, "sched_setaffinity"):
        cpus = [eval(lines[0].removeprefix("cpus ")) for lines in runs.values()]
        assert all(len(c) == 1 and c[0] in workers.usable_cpus() for c in cpus), cpus
        if len(workers.usable_cpus()) >= 2:
            assert cpus[0] != cpus[1]


def test_a_failed_run_is_reported_and_the_next_still_runs(probe: str) -> None:
    jobs = [workers.Job("bad", (probe, "fail")), workers.Job("good", (probe, "ok"))]
    outcome = workers.run_pinned(jobs, processes=1)
    assert outcome.codes == {"bad": 3, "good": 0} and outcome.failed() == ["bad"]
    assert outcome.stopped_by is None


def test_a_signal_is_passed_on_to_the_runs_and_no_new_run_starts(
    probe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    jobs = [workers.Job("stop", (probe, "stop")), workers.Job("later", (probe, "ok"))]
    outcome = workers.run_pinned(jobs, processes=1)
    assert outcome == workers.Outcome({"stop": 128 + signal.SIGTERM}, signal.SIGTERM)
    assert _lines(capsys.readouterr().out, "stop")[-1] == "saved at the signal"
    assert signal.getsignal(signal.SIGTERM) == before


def test_no_processes_is_refused() -> None:
    with pytest.raises(ValueError, match="processes must be >= 1, got 0"):
        workers.run_pinned([], processes=0)


def test_a_training_job_is_the_command_line_with_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    job = workers.Job.training("cope", "configs/flipflop.py", "cpu,position=cope", Path("runs/c"))
    config, workdir = tmp_path / "configs" / "flipflop.py", tmp_path / "runs" / "c"
    assert job.argv == (
        "copejax.main",
        f"--config={config}:cpu,position=cope",
        f"--workdir={workdir}",
    )
    assert (
        job.command()
        == f"python -m copejax.main --config={config}:cpu,position=cope --workdir={workdir}"
    )
