"""Printing the CLI's tables so that cell labels stay whole.

A label (``llama-d4096-L4-torchao-fp8-tensorwise-fp8-all-gather-compiled-fsdp2``) is what a user greps
for and compares; a table folded into 80 columns cuts it mid-word or ends it in ``…``. The tables mark
their label column ``no_wrap``; when the console is too narrow for the table even so, its rows are printed
as plain lines instead (the label first, whole; the terminal wraps the rest).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _plain(cell: object) -> str:
    return cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain


def plain_lines(table: Table) -> list[str]:
    """The table as text: its title, a header line, then one line per row, columns aligned two spaces apart."""
    columns = [[_plain(c) for c in col.cells] for col in table.columns]
    rows = [[_plain(col.header) for col in table.columns], *zip(*columns)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(table.columns))]
    title = [_plain(table.title)] if table.title else []
    return title + ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]


def min_width(table: Table) -> int:
    """Columns the table needs with its no_wrap columns whole and the others wrapped at spaces: each column's
    widest cell (no_wrap) or widest word, plus a border and padding of one on each side."""
    need = 1
    for col in table.columns:
        texts = [_plain(col.header), *(_plain(c) for c in col.cells)]
        need += 3 + max((len(t) if col.no_wrap else max((len(w) for w in t.split()), default=0)) for t in texts)
    return need


def print_table(console: Console, table: Table) -> None:
    """``console.print(table)`` when it fits the console's width with its no_wrap columns whole
    (:func:`min_width`), else :func:`plain_lines`."""
    if min_width(table) <= console.width:
        console.print(table)
        return
    for line in plain_lines(table):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
