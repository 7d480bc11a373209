"""A results page of final-evaluation metrics: one row per arm, one column per split (mean ±
std over seeds), the paper's numbers in adjacent columns (CoPE, arXiv 2405.18719; TAPE,
arXiv 2501.00712), a bar plot and a JSON file.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from experiments import sweep, sweep_page, sweep_plots


@dataclasses.dataclass(frozen=True)
class Column:
    """One measured column: ``eval/<key>`` shown as ``title`` (times ``scale``)."""

    key: str
    title: str
    scale: float = 100.0
    digits: int = 1


@dataclasses.dataclass(frozen=True)
class PaperColumn:
    """One column of the paper's numbers: ``paper[label][key]`` shown as ``title``."""

    key: str
    title: str


def summarize(result: sweep.Sweep, columns: Sequence[Column]) -> dict[str, dict[str, list]]:
    """label -> column key -> [mean, std, per-seed values]."""
    out: dict[str, dict[str, list]] = {}
    for label in result.records:
        out[label] = {}
        for column in columns:
            values = result.final(label, column.key)
            out[label][column.key] = [*sweep.mean_std(values), values]
    return out


def write_page(
    args: argparse.Namespace,
    result: sweep.Sweep,
    *,
    study: str,
    title: str,
    notes: str,
    caption: str,
    columns: Sequence[Column],
    paper: Mapping[str, Mapping[str, float]],
    paper_columns: Sequence[PaperColumn],
    reading: Callable[[dict[str, dict[str, list]]], str],
    ylabel: str,
    extra_images: Sequence[Path] = (),
    extra_sections: Sequence[str] = (),
) -> Path:
    """Writes the markdown page, its JSON and ``<study>_bars.png``; prints the table."""
    summary = summarize(result, columns)
    labels = list(result.records)
    rows = [
        [
            label,
            *(sweep.percent(tuple(summary[label][c.key][:2]), c.scale, c.digits) for c in columns),
            *(sweep.paper_cell(paper, label, p.key) for p in paper_columns),
        ]
        for label in labels
    ]
    table = sweep.markdown_table(
        ["arm", *(c.title for c in columns), *(p.title for p in paper_columns)], rows
    )
    bars = sweep_plots.plot_path(args.out, study, args.scale, "bars")
    sweep_plots.bar_plot(
        labels,
        {c.title: [tuple(summary[label][c.key][:2]) for label in labels] for c in columns},
        bars,
        ylabel=ylabel,
        title=f"{study}: mean ± std over seeds",
    )
    images = [bars, *extra_images]
    page = "\n".join(
        [
            sweep_page.header(title, args.scale, result, notes),
            caption,
            "",
            table,
            "",
            f"Every seed's value (seeds {', '.join(map(str, result.seeds))}, in that order):",
            "",
            sweep.per_seed_table(
                result, {c.key: c.title for c in columns}, columns[0].scale, columns[0].digits
            ),
            "",
            *(f"![{p.stem}]({p.name})\n" for p in images),
            "## Reading",
            "",
            reading(summary),
            "",
            *extra_sections,
            "## Commands",
            "",
            sweep_page.commands_block(study, args, result),
        ]
    )
    path = sweep_page.write_outputs(
        args.out,
        study,
        args.scale,
        page,
        result,
        results={
            label: {
                c.key: sweep.spread(*v)
                for c, v in zip(columns, summary[label].values(), strict=True)
            }
            for label in labels
        },
        paper=paper,
    )
    print(table)
    print(f"wrote {path}")
    return path


def ranking(summary: dict[str, dict[str, list]], key: str, scale: float = 100.0) -> str:
    """``"`a` 1.0 %, `b` 2.0 %"``: arms sorted by the mean of ``key``, lowest first."""
    means = {label: v[key][0] for label, v in summary.items()}
    ordered = sorted(means.items(), key=lambda kv: kv[1])
    return ", ".join(f"`{k}` {scale * v:.1f} %" for k, v in ordered)
