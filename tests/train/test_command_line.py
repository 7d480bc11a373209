"""The command line (issue 17): scheme options set both ways, mistakes end in one ``error:``
line (typo'd keys with a suggestion, a missing config file, an unknown variant or option), a
peer that never comes, and the tools on a run they cannot use."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from copejax.config import config_flag
from copejax.runtime import results_json
from copejax.runtime.workdir import run_labels
from copejax.training import train
from tests.train import unprivileged

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _run(*args: str, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, check=False,
        timeout=300, **kwargs,
    )  # fmt: skip


def _parse(monkeypatch: pytest.MonkeyPatch, *argv: str) -> ml_collections.ConfigDict:
    """``copejax.main``'s flag parsing, in this process, on fresh flags."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config", flag_values=values)
    flags.DEFINE_string("workdir", None, "workdir", flag_values=values)
    full = ["prog", "--workdir=/tmp/unused", *argv]
    monkeypatch.setattr(sys, "argv", list(full))  # ml_collections reads overrides from it
    config_flag.parse_flags(full, values=values)
    return values["config"].value


def _parse_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        _parse(monkeypatch, *argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, (done.stdout[-1000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "position", "options"),
    [
        (["--config=configs/lm.py:smoke,position=cope,p_max=8,mlp_hidden=16"], "cope",
         {"p_max": 8, "mlp_hidden": 16}),
        (["--config=configs/flipflop.py:smoke,position=cope",
          "--config.model.position_options.p_max=8",
          "--config.model.position_options.gates=values"], "cope",
         {"p_max": 8, "gates": "values"}),
        (["--config=configs/flipflop.py:smoke", "--config.model.position=fox",
          "--config.model.position_options.output_gate=true"], "fox", {"output_gate": True}),
        (["--config=configs/flipflop.py:smoke,position=cope+rope,base=500,p_max=4"], "cope+rope",
         {"base": 500.0, "p_max": 4}),
        (["--config=configs/flipflop.py:smoke,position=cope,p_max=16,alibi_slopes=press",
          "--config.model.position_options.p_max=8",
          "--config.model.position_options.alibi_slopes=None"], "cope",
         {"p_max": 8, "alibi_slopes": None}),
        (["--config=configs/flipflop.py:smoke,position=t5",
          "--config.model.position_options.num_buckets=16"], "t5", {"num_buckets": 16}),
    ],
)  # fmt: skip
def test_any_scheme_option_from_the_command_line(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], position: str, options: dict
) -> None:
    model = _parse(monkeypatch, *argv).model
    assert (model.position, model.position_options.to_dict()) == (position, options)
    assert type(model.position_options.get("base", 0.0)) is float


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--config=configs/flipflop.py:smoke", "--config.model.postion=cope"],
         "unknown config key 'model.postion' (--config.model.postion); did you mean 'position'?"),
        (["--config=configs/nope.py:smoke"], "config file 'configs/nope.py' not found"),
        (["--config=configs/flipflop.py:smok"],
         "unknown config argument 'smok'; did you mean 'smoke'? Known: the variants smoke, cpu, "
         "paper;"),
        (["--config=configs/flipflop.py:smoke,position=cope",
          "--config.model.position_options.p_mx=8"],
         "position scheme 'cope' has no option 'p_mx'; did you mean 'p_max'? Its options "
         "(defaults): gates='keys', p_max=64,"),
        (["--config=configs/lm.py:smoke,position=rope,p_max=8"],
         "position scheme 'rope' has no option 'p_max'. Its options (defaults): base=10000.0,"),
        (["--config=configs/flipflop.py:smoke", "--config.train.steps=abc"],
         "flag --config.train.steps=abc: invalid literal for int()"),
    ],
)  # fmt: skip
def test_command_line_mistakes_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, argv: list[str], expected: str
) -> None:
    line = _parse_error(monkeypatch, capsys, *argv)
    assert expected in line
    assert line.count("did you mean") <= 1


def test_the_training_program_parses_that_way() -> None:
    """End to end: ``python -m copejax.main`` with a typo'd key is one line, no traceback."""
    done = _run(
        "-m", "copejax.main", "--workdir=/tmp/unused", "--config=configs/flipflop.py:smoke",
        "--config.model.postion=cope",
    )  # fmt: skip
    assert "did you mean 'position'?" in _one_error_line(done)


def test_a_peer_that_never_comes_is_named_and_timed_out() -> None:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    done = _run(
        "-m", "copejax.main", "--config=configs/flipflop.py:smoke", "--workdir=/tmp/unused",
        f"--coordinator_address=localhost:{port}", "--num_processes=2", "--process_id=0",
        "--peer_timeout=3",
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    waiting = f"process 0: waiting up to 3 s for process 1 of 2 to join at localhost:{port}"
    assert lines[0] == waiting
    assert lines[-1].startswith("error: process 0: gave up after 3 s waiting for process 1 of 2")
    assert "Check failure" not in done.stderr


@pytest.fixture(scope="module")
def flipflop_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 2-step flip-flop run (not an LM) in a directory other users can read."""
    from configs.flipflop import get_config

    root = Path(tempfile.mkdtemp(prefix="copejax-ff-"))
    root.chmod(0o755)
    config = get_config("smoke,steps=2")
    config.eval.splits = ("test",)
    train.run(config, root / "run")
    yield root / "run"
    unprivileged.make_writable(root)
    shutil.rmtree(root)


@pytest.mark.parametrize(
    ("tool", "flags", "expected"),
    [
        (
            "copejax.evaluation.sample",
            ["--prompt=a"],
            "trained task 'flipflop', which has no text to sample",
        ),
        ("copejax.plots.maps", ["--text=a"], "trained task 'flipflop'; maps of a --text need"),
        (
            "copejax.evaluation.extrapolate",
            ["--out=/tmp/unused-x"],
            "extrapolate needs an 'lm' run",
        ),
    ],
)
def test_tools_on_a_non_lm_run_say_so_in_one_line_without_orbax_logs(
    flipflop_run: Path, tool: str, flags: list[str], expected: str
) -> None:
    done = _run("-m", tool, f"--workdir={flipflop_run}", *flags)
    assert expected in _one_error_line(done)  # and no INFO lines from orbax before it


def test_extrapolate_checks_writability_before_computing(flipflop_run: Path) -> None:
    """A read-only workdir: with --out the run is only read (a note); without, an error first."""
    unprivileged.make_read_only(flipflop_run)
    try:
        code = (
            "import sys; from copejax.evaluation import extrapolate as e; w = sys.argv[1];"
            "print(e.writable_workdirs([w], 'elsewhere'));"
            "e.writable_workdirs([w], None)"
        )
        home = flipflop_run.parent / "home"
        done = _run("-c", code, str(flipflop_run), **unprivileged.subprocess_kwargs(home))
    finally:
        unprivileged.make_writable(flipflop_run)
    assert f"note: {flipflop_run} is not writable" in done.stdout and "[]" in done.stdout
    assert "pass --out=<path prefix>" in done.stderr


def test_extrapolation_json_has_no_nan_literals(tmp_path: Path) -> None:
    record = {"splits": {"x8": {"perplexity": float("nan"), "buckets": [1.0, float("inf")]}}}
    results_json.write_json(tmp_path / "e.json", record)
    text = (tmp_path / "e.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=pytest.fail) == {
        "splits": {"x8": {"perplexity": None, "buckets": [1.0, None]}}
    }


def test_runs_of_one_scheme_get_their_directory_names(tmp_path: Path) -> None:
    for name, position in (("a", "rope"), ("b", "rope"), ("c", "cope")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model": {"position": position}}))
    paths = [str(tmp_path / n) for n in "abc"]
    assert list(run_labels(paths).values()) == ["rope (a)", "rope (b)", "cope"]
