"""The cross-revision benchmark (``experiments.bench_revisions``): its verdicts, its page, that an
earlier revision unpacks and imports its own copejax, and (slow) one end-to-end smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_revisions
from experiments.bench_settings import ROOT


def test_verdicts_need_every_round_on_one_side() -> None:
    slower = bench_revisions.summarize([{"base": 1.0, "head": 1.3}, {"base": 1.0, "head": 1.2}])
    assert slower["verdict"] == "slower"
    assert slower["ratio"] == pytest.approx(1.25)
    assert slower["base_s"] == 1.0 and slower["head_s"] == pytest.approx(1.25)
    # a median past the tolerance, but one round the other way: noise
    mixed = [{"base": 1.0, "head": 1.5}, {"base": 1.0, "head": 1.4}, {"base": 1.0, "head": 0.9}]
    assert bench_revisions.summarize(mixed)["verdict"] == "within noise"
    faster = bench_revisions.summarize([{"base": 2.0, "head": 1.0}, {"base": 2.0, "head": 1.5}])
    assert faster["verdict"] == "faster"
    close = bench_revisions.summarize([{"base": 1.0, "head": 1.05}, {"base": 1.0, "head": 1.08}])
    assert close["verdict"] == "within noise"
    with pytest.raises(ValueError, match="at least one round"):
        bench_revisions.summarize([])


def test_measure_alternates_order_resumes_and_records_failures(monkeypatch) -> None:
    calls: list[tuple[str, str]] = []
    trees = {"base": Path("/base"), "head": Path("/head")}

    def fake_time_layer(tree: Path, scheme: str, length: int, repeats: int, cap_s: float):
        calls.append((tree.name, scheme))
        if scheme == "broken" and tree.name == "head":
            return {"scheme": scheme, "T": length, "status": "error", "stderr_tail": "boom"}
        return {"status": "ok", "time_s": 2.0 if tree.name == "head" else 1.0}

    monkeypatch.setattr(bench_revisions, "time_layer", fake_time_layer)
    saved: list[dict] = []
    kept = {"kept@64": {"scheme": "kept", "T": 64, "rounds": []}}
    done = bench_revisions.measure(
        trees, [("kept", 64), ("nope", 64), ("broken", 64)], 2, dict(kept), saved.append
    )
    assert calls[:4] == [("base", "nope"), ("head", "nope"), ("head", "nope"), ("base", "nope")]
    assert ("base", "kept") not in calls and ("head", "kept") not in calls
    assert done["nope@64"]["verdict"] == "slower" and done["nope@64"]["ratio"] == 2.0
    assert done["broken@64"]["failure"]["side"] == "head"
    assert done["broken@64"]["rounds"] == []
    assert len(saved) == 2
    page = bench_revisions.render(
        {
            "meta": {
                "date": "2026-12-07",
                "machine": "x86_64, 2 CPUs",
                "jax": "0.10.2",
                "base": "bcea296",
                "base_sha": "b" * 40,
                "head": "the working tree",
                "head_sha": "a" * 40,
                "dirty": True,
                "commands": ["python -m experiments.bench_revisions"],
            },
            "cases": {k: v for k, v in done.items() if k != "kept@64"},
        }
    )
    assert "| nope | 64 | 1.000 | 2.000 | 2.00x (2.00-2.00) | 2 | slower |" in page
    assert "| broken | 64 | - | - | - | 0 | failed under head: error |" in page
    assert "with uncommitted changes" in page
    assert "Slower: 1; within noise: 0; faster: 0; failed: 1." in page


def test_a_revision_unpacks_and_imports_its_own_copejax(tmp_path: Path) -> None:
    tree = bench_revisions.unpack("HEAD", tmp_path)
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert tree.name == sha and (tree / "copejax" / "__init__.py").exists()
    assert tree in bench_revisions.imported_from(tree).parents
    assert bench_revisions.unpack(sha[:12], tmp_path) == tree  # unpacked once
    with pytest.raises(SystemExit, match="no-such-revision"):
        bench_revisions.unpack("no-such-revision", tmp_path)


@pytest.mark.slow  # two worker processes per round, each compiling the layer
def test_smoke_run_writes_page_and_json(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "experiments.bench_revisions", "--base", "HEAD", "--schemes",
        "nope", "--lengths", "64", "--rounds", "2", "--out_dir", str(tmp_path / "out"),
        "--trees", str(tmp_path / "trees"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "bench_revisions.json").read_text())
    case = result["cases"]["nope@64"]
    assert len(case["rounds"]) == 2 and case["verdict"] in ("slower", "within noise", "faster")
    assert "| nope | 64 |" in (tmp_path / "out" / "bench_revisions.md").read_text()


def test_resume_refuses_another_pair_of_revisions(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    meta = {"base_sha": sha, "head_sha": "0" * 40, "commands": []}
    (out / "bench_revisions.json").write_text(json.dumps({"meta": meta, "cases": {}}))
    command = [
        sys.executable, "-m", "experiments.bench_revisions", "--base", "HEAD", "--head", "HEAD",
        "--schemes", "nope", "--lengths", "64", "--resume", "--out_dir", str(out),
        "--trees", str(tmp_path / "trees"),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode != 0
    assert f"measured head_sha {'0' * 40}, this run {sha}" in done.stderr
    assert "round" not in done.stdout  # nothing was timed
