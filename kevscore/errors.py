"""The one exception type kevscore shows to users: a one-line message, no traceback."""
from __future__ import annotations

from collections.abc import Sequence


class KevscoreError(Exception):
    """A problem with the user's input, options or environment, reported on one line."""


def rows_phrase(rows: Sequence[int], limit: int = 10) -> str:
    """'row 3', 'rows 3, 7, 12' or 'rows 3, 7, … (25 rows)': 0-based row numbers of the input file."""
    rows = sorted(rows)
    shown = ", ".join(str(r) for r in rows[:limit])
    if len(rows) == 1:
        return f"row {shown}"
    more = f", … ({len(rows)} rows)" if len(rows) > limit else ""
    return f"rows {shown}{more}"
