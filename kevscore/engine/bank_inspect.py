"""`kevscore bank-inspect`: a read-only report of a bank directory, its models, entries and their checks."""
from __future__ import annotations

import shutil
from pathlib import Path

from kevscore.engine.bank_dir import TMP, bank_lock, check_bank_dir, entry_file, entry_files, index_or_why
from kevscore.engine.bank_entry import COMPONENTS, FORMAT, VERSION, EntryError, read_entry, read_header
from kevscore.errors import KevscoreError


def inspect_bank(root: Path, entry: str | None = None, verify: bool = False) -> dict:
    """A read-only report of a bank directory (the shape `bank-inspect --json` prints)."""
    root = Path(root)
    check_bank_dir(root, create=False)
    with bank_lock(root, False, "inspect"):
        files = entry_files(root)
        index, why = index_or_why(root)
        notes = [f"{why}: entries listed from their files (the next run rebuilds it)"] if why else []
        records, models = (dict(index["entries"]), dict(index["models"])) if index else ({}, {})
        keys = sorted(set(records) | set(files))
        chosen = _chosen_entry(root, keys, entry)
        rows = [_entry_row(key, records.get(key), files.get(key), verify and chosen in (None, key), entry is not None)
                for key in keys]
        temporary = [p.name for p in (root / TMP).glob("*") if not p.name.endswith(".lock")]  # none without tmp/
    models |= {fp: {"name": "?"} for r in rows if (fp := r.get("model")) and fp not in models}
    per_model = {fp: {"about": about, "entries": sum(r.get("model") == fp for r in rows),
                      "file_bytes": sum(r["file_bytes"] for r in rows if r.get("model") == fp)}
                 for fp, about in models.items()}
    totals = {"entries": len(rows), "file_bytes": sum(r["file_bytes"] for r in rows),
              "tokens": sum(r.get("tokens") or 0 for r in rows),
              **{comp: sum((r.get("bytes") or {}).get(comp, 0) for r in rows) for comp in COMPONENTS.values()}}
    disk = shutil.disk_usage(root)
    shown = rows if chosen is None else [r for r in rows if r["key"] == chosen]
    bad = [r["key"] for r in shown if r["status"] not in ("ok", "unchecked")]
    return {"bank": str(root), "format": FORMAT, "version": VERSION, "models": per_model, "entries": shown,
            "totals": totals, "disk": {"free_bytes": disk.free, "total_bytes": disk.total}, "verified": verify,
            "bad_entries": bad, "notes": notes, "unindexed": [r["key"] for r in rows if not r["indexed"]],
            "temporary": temporary}


def _chosen_entry(root: Path, keys: list[str], prefix: str | None) -> str | None:
    """The one key starting with `prefix` (None without a prefix); a one-line error for none or several."""
    if prefix is None:
        return None
    if not (matches := [k for k in keys if k.startswith(prefix)]):
        raise KevscoreError(f"{root}: no entry {prefix!r}")
    if len(matches) > 1:
        raise KevscoreError(f"{root}: entry {prefix!r} is ambiguous ({len(matches)} entries start with it)")
    return matches[0]


def _entry_row(key: str, rec: dict | None, path: Path | None, verify: bool, detail: bool) -> dict:
    """One entry's row: its record's figures (a file the index lacks has none), overridden by its file's header's
    (and, with `verify`, checked by a full read)."""
    known = rec or {"model": None, "tokens": None, "bytes": {}, "doc_ids": [], "last_used": path.stat().st_mtime}
    row = {"key": key, "file": entry_file(key), "indexed": rec is not None, "status": "unchecked",
           **{name: known[name] for name in ("model", "tokens", "bytes", "doc_ids", "last_used")}}
    if path is None:
        return row | {"status": "missing file", "file_bytes": 0}
    try:
        head = read_header(path)
        row.update(model=head.meta["model"], tokens=head.tokens, bytes=head.component_bytes(), file_bytes=head.size,
                   created=float(head.meta["created"]),
                   tensors={n: {"dtype": d, "shape": s} for n, (d, s, _, _) in head.tensors.items()})
        if verify:
            checked, tensors = read_entry(path)  # every check; a corrupt entry's row keeps its header's figures
            row["status"] = "ok"
            if detail:
                row.update(ids_head=tensors["ids"][:16].tolist(), crc32=checked.crc)
    except (OSError, EntryError) as exc:
        row.update(status=f"corrupt: {exc}", file_bytes=path.stat().st_size)
    return row
