"""The exceptions kevscore shows to users as one line, no traceback, and the exit status each one earns."""
from __future__ import annotations

import os
from collections.abc import Sequence


class KevscoreError(Exception):
    """A problem with the user's input or options, reported on one line (exit status 2)."""
    exit_code = 2


class KevscoreFailure(KevscoreError):
    """A fault of the run or its environment (disk, memory, another process), on one line (exit status 1)."""
    exit_code = 1


def traced(exc: BaseException) -> bool:
    """Whether `exc` is a bug whose traceback KEVSCORE_TRACEBACK=1 asks to see (a user's error or the OS's never)."""
    return os.environ.get("KEVSCORE_TRACEBACK") == "1" and not isinstance(exc, (KevscoreError, OSError))


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (its type's name when it has none)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def os_failure(what: str, e: OSError) -> KevscoreFailure:
    """`what` (a file and an action) failed with an OSError: the one-line failure to raise."""
    return KevscoreFailure(f"{what} ({e.strerror or first_line(e)})")


def rows_phrase(rows: Sequence[int], limit: int = 10) -> str:
    """'row 3', 'rows 3, 7, 12' or 'rows 3, 7, … (25 rows)': 0-based row numbers of the input file."""
    rows = sorted(rows)
    return f"row {rows[0]}" if len(rows) == 1 else "rows " + listed([str(r) for r in rows], limit, "rows")


def listed(items: Sequence[str], limit: int, unit: str) -> str:
    """'a, b' or 'a, b, … (12 values)': the first `limit` items, and how many there are when some are left out."""
    return ", ".join(items[:limit]) + (f", … ({len(items)} {unit})" if len(items) > limit else "")


def reported(exc: BaseException) -> KevscoreError:
    """What to tell the user about `exc`: a KevscoreError as it is, an OSError not caught where it happened
    (disk full, a file removed mid-run) as a KevscoreFailure naming its file, anything else (a bug in kevscore)
    as a KevscoreFailure that says so in one line."""
    if isinstance(exc, KevscoreError):
        return exc
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return KevscoreFailure(f"{where}{exc.strerror or first_line(exc)}")
    return KevscoreFailure(f"internal error, a bug in kevscore: {type(exc).__name__}: {first_line(exc)} (rerun "
                           f"with KEVSCORE_TRACEBACK=1 for where it happened, and report it)")
