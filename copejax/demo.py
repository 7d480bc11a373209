"""The first command to run: Flip-Flop language modelling (Liu et al. 2023, arXiv 2306.00946)
trained on CPU in a few minutes, with a results table and a loss plot.

    python -m copejax.demo [--position=rope] [--workdir=workdirs/demo]

Trains ``configs/flipflop.py:cpu`` (a small model on 63-token sequences), printing the loss as
it falls, then a table of the test and out-of-distribution errors and ``loss.png`` (training
and evaluation loss against step) in ``<workdir>/<position>``. Re-running resumes or, when the
run is complete, just prints the results again.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_collections
from absl import app, flags, logging

from copejax.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
_POSITION = flags.DEFINE_string(
    "position", "rope", "Position scheme (python -m copejax.positions)."
)
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/demo", "Parent of the run's workdir.")
_ARG = flags.DEFINE_string("variant", "cpu", "Argument of configs/flipflop.py (smoke, cpu).")


def load_config(path: Path, arg: str) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of a config file, as ``--config=path:arg`` would load it."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def results_table(records: list[dict[str, float]]) -> str:
    """A plain-text table of the last evaluation: one row per split."""
    last = next((r for r in reversed(records) if any(k.startswith("eval/") for k in r)), None)
    if last is None:
        return "(no evaluation yet)"
    splits = sorted({k.split("/")[1] for k in last if k.startswith("eval/")})
    names = sorted({k.split("/")[2] for k in last if k.startswith("eval/")})
    width = max(len(s) for s in splits)
    lines = [f"step {last['step']}", f"{'split':<{width}}  " + "  ".join(f"{n:>11}" for n in names)]
    for split in splits:
        cells = "  ".join(f"{last.get(f'eval/{split}/{n}', float('nan')):>11.4f}" for n in names)
        lines.append(f"{split:<{width}}  {cells}")
    return "\n".join(lines)


def plot_losses(records: list[dict[str, float]], path: Path, title: str) -> None:
    """Training loss (and each split's evaluation loss) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    train = [(r["step"], r["train/loss"]) for r in records if r.get("train/loss") is not None]
    if train:
        axes.plot(*zip(*train, strict=True), label="train")
    splits = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/")})
    for split in splits:
        points = [
            (r["step"], r[f"eval/{split}/loss"]) for r in records if f"eval/{split}/loss" in r
        ]
        axes.plot(*zip(*points, strict=True), marker="o", label=f"eval {split}")
    axes.set(xlabel="step", ylabel="cross-entropy (scored tokens)", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    from copejax import train

    config = load_config(
        ROOT / "configs" / "flipflop.py", f"{_ARG.value},position={_POSITION.value}"
    )
    workdir = Path(_WORKDIR.value) / _POSITION.value
    print(f"Flip-Flop with {_POSITION.value}: {config.train.steps} steps -> {workdir}", flush=True)
    train.run(config, workdir)
    records = read_jsonl(workdir / "metrics.jsonl")
    print("\nerror = wrong reads / reads; glitch_rate = sequences with any wrong read")
    print(results_table(records))
    plot = workdir / "loss.png"
    plot_losses(records, plot, f"Flip-Flop, {_POSITION.value}")
    print(f"\nloss plot: {plot}\nmetrics: {workdir / 'metrics.jsonl'}")


if __name__ == "__main__":
    app.run(main)
