"""The bank directory's layout and guards: format marker, index of entry records, entry files, lock.

The lock serializes writers; `bank_store` describes the whole layout."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from kevscore import faults
from kevscore.durable import lock_file, read_json_object
from kevscore.engine.bank_entry import FORMAT, SUFFIX, VERSION, EntryFile
from kevscore.errors import KevscoreError, first_line

MARKER, INDEX, LOCK, ENTRIES, TMP = "kevbank.json", "index.json", "lock", "entries", "tmp"
BANK_NAMES = {MARKER, INDEX, LOCK, ENTRIES, TMP}
MAX_DOC_IDS = 32  # document ids remembered per entry
INDEX_MISSING = f"{INDEX} is missing"
RECORD_FIELDS = {"file": str, "model": str, "prefix_sha256": str, "tokens": int, "bytes": dict, "file_bytes": int,
                 "last_used": (int, float), "doc_ids": list}  # an index record's fields and their types


def entry_file(key: str) -> str:
    """Where the entry of `key` lies, relative to the bank directory."""
    return f"{ENTRIES}/{key[:2]}/{key}{SUFFIX}"


def entry_record(entry: EntryFile, last_used: float) -> dict:
    """An entry file's index record; its document ids are merged in when the index is committed."""
    return {"file": entry_file(entry.meta["key"]), "model": entry.meta["model"],
            "prefix_sha256": entry.meta["prefix_sha256"], "tokens": entry.tokens, "bytes": entry.component_bytes(),
            "file_bytes": entry.size, "created": float(entry.meta["created"]), "last_used": last_used, "doc_ids": []}


def check_bank_dir(root: Path, create: bool) -> None:
    """Refuse what is not a kevscore bank of this format version, with a one-line message."""
    if create and not root.exists():
        return  # a new bank
    if not root.is_dir():
        raise KevscoreError(f"{root}: {'the bank is not a directory' if root.exists() else 'no such bank directory'}")
    try:  # an unreadable directory is one line too
        marker = root / MARKER
        if (info := read_json_object(marker)) is not None:
            if not {"format", "version"} <= info.keys():
                raise KevscoreError(f"{marker}: unreadable bank marker; not a kevscore bank?")
            if info["format"] != FORMAT:
                raise KevscoreError(f"{marker}: format {info['format']!r} is not a kevscore bank")
            if info["version"] != VERSION:
                raise KevscoreError(f"{root}: kevscore bank format version {info['version']}; this kevscore reads "
                                    f"version {VERSION} only. Use another --bank directory (or delete this one)")
            return
        if others := sorted(p.name for p in root.iterdir() if p.name not in BANK_NAMES):
            raise KevscoreError(f"{root}: not a kevscore bank (no {MARKER}) and not empty "
                                f"(holds {', '.join(others[:3])}{', …' if len(others) > 3 else ''})")
        if not create and not (root / ENTRIES).is_dir():
            raise KevscoreError(f"{root}: not a kevscore bank (no {MARKER})")
    except OSError as exc:
        raise KevscoreError(f"{root}: cannot read the bank directory ({exc.strerror or exc})") from exc


def entry_files(root: Path) -> dict[str, Path]:
    return {p.stem: p for p in (root / ENTRIES).glob(f"*/*{SUFFIX}")}


def index_or_why(root: Path) -> tuple[dict | None, str | None]:
    """The index, or None and why it cannot be used (INDEX_MISSING, or unreadable: malformed, any record
    included); a bank of another format version raises KevscoreError."""
    try:
        data = json.loads((root / INDEX).read_bytes())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a kevscore bank index")
        if data.get("version") != VERSION:
            raise KevscoreError(f"{root / INDEX}: kevscore bank format version {data.get('version')}; this kevscore "
                                f"reads version {VERSION} only. Use another --bank directory (or delete this one)")
        entries, models = data.get("entries"), data.get("models")
        if not (isinstance(entries, dict) and isinstance(models, dict) and all(type(m) is dict for m in models.values())):
            raise TypeError("malformed entries/models tables")
        for key, rec in entries.items():
            if not (isinstance(rec, dict) and all(isinstance(rec.get(n), kind) for n, kind in RECORD_FIELDS.items())
                    and all(type(v) is int for v in rec["bytes"].values())
                    and all(isinstance(i, str) for i in rec["doc_ids"])
                    and rec["file"] == entry_file(key)):
                raise TypeError(f"malformed record for entry {key[:12]}")
        return data, None
    except FileNotFoundError:
        return None, INDEX_MISSING
    except (OSError, ValueError, TypeError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
        return None, f"{INDEX} is unreadable ({first_line(exc)[:120]})"


def bank_lock(root: Path, exclusive: bool, purpose: str) -> contextlib.AbstractContextManager:
    """The bank's lock, held while a `with` block on it runs: exclusive for writers, shared for a look."""
    faults.point(f"bank-lock-wait-{purpose}")
    path = root / LOCK
    # a read-only look at a bank without a lock file takes none (nothing can be writing to it)
    return lock_file(path, exclusive) if exclusive or path.exists() else contextlib.nullcontext()

