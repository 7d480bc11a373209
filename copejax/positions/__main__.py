"""``python -m copejax.positions``: a table of every registered scheme."""

from __future__ import annotations

import dataclasses

from copejax.positions import registry


def table() -> str:
    """Markdown table: name, sites, options with defaults, paper."""
    rows = ["| scheme | sites | options (defaults) | paper |", "|---|---|---|---|"]
    for name in registry.names():
        cls = registry.get(name)
        options = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)) or "-"
        rows.append(f"| `{name}` | {', '.join(cls.sites) or '-'} | {options} | {cls.paper} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
