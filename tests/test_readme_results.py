"""README's "Results" table stays a summary: each study's finding in at most three lines, the
detail on the study's page (issue 44)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Three lines of the README's 100-character width.
MAX_FINDING_CHARS = 300


def results_rows(readme: str) -> list[list[str]]:
    """The cells of each row of the table in README's "## Results" section (header and rule
    left out)."""
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]  # not |---|
    return [[c.strip() for c in re.split(r" \| ", row.strip()[2:-2])] for row in rows[1:]]


def test_each_finding_fits_three_lines_and_links_its_page() -> None:
    rows = results_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(rows) >= 10, f"the Results table was not found whole: {len(rows)} rows"
    assert rows[0][0].startswith("1 "), f"the first study was not read: {rows[0][0]!r}"
    too_long, unlinked = [], []
    for study, page, finding, *_ in rows:
        if len(finding) > MAX_FINDING_CHARS:
            too_long.append(f"{study[:60]}: {len(finding)} characters")
        link = re.search(r"\]\((experiments/results/[^)]+\.md)\)", page)
        if link is None or not (ROOT / link.group(1)).is_file():
            unlinked.append(study[:60])
    assert not too_long, (
        f"findings over {MAX_FINDING_CHARS} characters (move the detail to the page):\n"
        + "\n".join(too_long)
    )
    assert not unlinked, f"rows without an existing page: {unlinked}"


def test_the_reader_sees_a_long_finding() -> None:
    """The parser itself: a fabricated table with a 301-character finding is read whole."""
    finding = "x" * (MAX_FINDING_CHARS + 1)
    readme = (
        "# t\n\n## Results\n\n| study | page | in short |\n|---|---|---|\n"
        f"| 1 a | [a.md](experiments/results/a.md) | {finding} |\n\n## Layout\n| not | this |\n"
    )
    assert results_rows(readme) == [["1 a", "[a.md](experiments/results/a.md)", finding]]
