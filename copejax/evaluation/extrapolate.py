"""Length extrapolation of trained LM runs (CoPE Figure 3, arXiv 2405.18719): perplexity at
T, 2T, 4T, 8T and loss per position bucket, from each workdir's latest checkpoint.

    python -m copejax.evaluation.extrapolate --workdir=workdirs/lm_rope \
        [--workdir=workdirs/lm_cope ...] [--out=workdirs/extrapolation] \
        [--batch_size=8] [--max_examples=0] [--bucket_width=64]

Writes ``extrapolation.json`` and ``extrapolation.png`` into every workdir and, with ``--out``,
``<out>.json`` and ``<out>.png`` comparing the runs (one line per position scheme).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from absl import app, flags

from copejax.config import command_line
from copejax.runtime.results_json import write_json


def can_write(directory: str | os.PathLike) -> bool:
    """True when a file can be created in ``directory`` (tried, not guessed from the mode
    bits: root ignores them, a read-only mount does not)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def writable_workdirs(workdirs: list[str], out: str | None) -> list[str]:
    """The workdirs that can take ``extrapolation.json`` / ``.png``, checked before any compute.

    A read-only workdir is skipped with a note when ``out`` collects the results; without
    ``out`` it would lose them, so it is an error.
    """
    writable = []
    for path in workdirs:
        if can_write(path):
            writable.append(path)
        elif out:
            print(f"note: {path} is not writable: its results go only to {out}.json", flush=True)
        else:
            raise ValueError(
                f"{path} is not writable, so extrapolation.json cannot be written there; "
                "pass --out=<path prefix> to write the results elsewhere"
            )
    return writable


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from copejax.data.lm import LanguageModel
    from copejax.evaluation import lm_eval
    from copejax.runtime.workdir import run_labels
    from copejax.training.trained_run import load_run

    out = flags.FLAGS.out
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        if not can_write(Path(out).parent):
            raise ValueError(f"--out={out}: {Path(out).parent} is not writable")
    writable = writable_workdirs(flags.FLAGS.workdir, out)
    labels = run_labels(flags.FLAGS.workdir)
    runs, train_length = {}, 0
    for path in flags.FLAGS.workdir:
        run = load_run(path, flags.FLAGS.step)
        if not isinstance(run.task, LanguageModel):
            raise ValueError(
                f"{path} trained task {run.task.name!r}; extrapolate needs an 'lm' run"
            )
        results = lm_eval.evaluate_lengths(
            run.model_config, run.params, run.task, batch_size=flags.FLAGS.batch_size,
            max_examples=flags.FLAGS.max_examples, bucket_width=flags.FLAGS.bucket_width,
        )  # fmt: skip
        label = labels[path]
        record = {"workdir": str(path), "step": run.step, "position": run.label, "splits": results}
        train_length = run.task.seq_len
        runs[label] = results
        if path in writable:
            write_json(Path(path) / "extrapolation.json", record)
            lm_eval.plot_extrapolation(
                {label: results}, train_length, str(Path(path) / "extrapolation.png")
            )
        for split, r in results.items():
            shown = f"ppl {r['perplexity']:.3f}" if "error" not in r else r["error"]
            print(f"{label} {split} (length {r['length']}): {shown}", flush=True)
    if out:
        write_json(Path(out).with_suffix(".json"), runs)
        lm_eval.plot_extrapolation(runs, train_length, str(Path(out).with_suffix(".png")))


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module next to other tools defines no clashing flags)."""
    flags.DEFINE_multi_string("workdir", None, "Workdir(s) of lm training runs.")
    flags.DEFINE_string("out", None, "Path prefix of the comparison (.json and .png).")
    flags.DEFINE_integer("batch_size", 8, "Rows per batch at the training length.")
    flags.DEFINE_integer("max_examples", 0, "Rows per split (0 = all).")
    flags.DEFINE_integer("bucket_width", 64, "Width of the position buckets.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
    flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
    define_flags()
    app.run(command_line.one_line_errors(main))
