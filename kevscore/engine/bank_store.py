"""The persistent state bank (`--bank DIR`): bank entries kept on disk between runs.

An entry is keyed by the model's fingerprint and the document's prefix token ids. A run asks the store,
wave by wave, which of its documents it already has, copies those entries into their freshly allocated
bank slots (host file -> bank tensors, on any device), prefills the rest and saves them.

    DIR/kevbank.json                          format marker {"format": "kevscore-bank", "version": 1}
    DIR/index.json                            entry records: file, model, tokens, bytes, doc ids, last use
    DIR/lock                                  flock: exclusive while entry files are renamed in or
                                              removed and the index is rewritten; shared for inspection
    DIR/entries/<key[:2]>/<key>.safetensors   one entry: tensors state, conv, kv, ids and metadata
    DIR/tmp/<owner>/, DIR/tmp/<owner>.lock    one process's temporary files; the lock is flock-held
                                              while the process lives, so leftovers of a killed run
                                              are recognised and removed by the next one

Every write goes to a temporary file that is fsynced, renamed into place, and the directory fsynced, so
a file under entries/ is always complete. Loading checks the header, the shapes against the bank, the
key against the model fingerprint and the prefix ids, and a CRC-32 of every tensor; an entry failing any
check is reported on one line and recomputed (its file is replaced by the recomputed entry).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kevscore import faults
from kevscore.durable import bytes_filler, fsync_dir, lock_file, temp_path, write_json, write_new
from kevscore.engine import bank_dir, bank_entry
from kevscore.engine.backend import synchronize
from kevscore.engine.bank_entry import EntryError, Fingerprint
from kevscore.errors import KevscoreError, KevscoreFailure, first_line, listed
from kevscore.model.prompt import prefix_key

MARKER_FIELDS = {"format": bank_entry.FORMAT, "version": bank_entry.VERSION}  # the marker file's, the index's


@dataclass(slots=True)
class BankStats:
    loaded: int = 0          # entries copied from disk into the bank
    saved: int = 0           # entries written after prefill
    read_bytes: int = 0
    written_bytes: int = 0
    load_s: float = 0.0      # reading, checking and copying into the bank (device synchronized)
    save_s: float = 0.0      # copying out of the bank, serializing, writing, committing
    evicted: int = 0
    rejected: int = 0        # entries found but not used (reported, recomputed)
    warnings: list[str] = field(default_factory=list)


def stored(root: Path, model: str, prefix_sha256: str) -> str | None:
    """The key of the entry the bank at `root` holds for a document (its prefix ids' `prefix_key`) and a model (its
    fingerprint's digest), or None: how a run finds a document in the bank (and a dry run, which only looks)."""
    key = bank_entry.entry_key(model, prefix_sha256)
    return key if (root / bank_dir.entry_file(key)).exists() else None


class BankStore(AbstractContextManager):
    """An open bank directory for one model, closed when its `with` block ends; a directory it cannot open is a
    one-line KevscoreError."""

    def __init__(self, root: Path, model: Fingerprint, max_bytes: int | None = None,
                 warn: Callable[[str], None] | None = None, workers: int | None = None, wanted: Iterable[str] = ()):
        self.root, self.model, self.max_bytes = Path(root), model, max_bytes
        self._warn_cb = warn or (lambda message: None)
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        self.stats = BankStats()
        self._touched: dict[str, dict] = {}          # key -> record of an entry used or written, for the next commit
        self._doc_ids: dict[str, dict[str, None]] = {}  # prefix sha256 -> document ids of this run (MAX_DOC_IDS)
        self._owner_lock: BinaryIO | None = None
        # prefix sha256s of this run's documents (`wanted`, then each window's), kept from eviction until used
        self._wanted: set[str] = set(wanted)
        self._opened, self.index = time.time(), None
        try:
            bank_dir.check_bank_dir(self.root, create=True)
            try:
                self._open_writable()
            except (OSError, KevscoreFailure) as exc:  # a read-only mount, a full disk: used as it is, unchanged
                self._release()
                why = exc.strerror if isinstance(exc, OSError) else first_line(exc)
                self.warn(f"cannot write to it ({why}); using it read-only: entries are loaded, none saved or evicted")
                if self.index is None:
                    with bank_dir.bank_lock(self.root, False, "open"):
                        self.index = self._load_index(reconcile=True)[0]
        except BaseException as exc:
            self._release()
            if isinstance(exc, OSError):
                raise KevscoreError(f"{self.root}: cannot open the bank ({exc.strerror or exc})") from exc
            raise

    def _open_writable(self) -> None:
        """Under the lock: the layout made, dead processes' temporary files removed, this process's temporary
        directory owned, and the index read; it is written only when reconciling it with the files changed it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with bank_dir.bank_lock(self.root, True, "open"):
            bank_dir.check_bank_dir(self.root, create=True)  # again, under the lock
            (self.root / bank_dir.ENTRIES).mkdir(exist_ok=True)
            (self.root / bank_dir.TMP).mkdir(exist_ok=True)
            self._clean_tmp()
            # this process's temporary directory, owned while its lock is held
            self.tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.root / bank_dir.TMP))
            self._owner_lock = lock_file(self.tmp.with_name(self.tmp.name + ".lock"))
            if not (self.root / bank_dir.MARKER).exists():
                write_json(self.root / bank_dir.MARKER, MARKER_FIELDS, tmp_dir=self.tmp)
            self.index, changed = self._load_index(reconcile=True)
            self.index["models"].setdefault(self.model.digest, self.model.about)
            if changed:
                self._publish(self.index, "bank-index-write-open")

    # ------------------------------------------------------------ housekeeping

    def warn(self, message: str) -> None:
        """A problem the run recovers from, recorded and told with the bank's name."""
        self.stats.warnings.append(f"bank {self.root}: {message}")
        self._warn_cb(self.stats.warnings[-1])

    def _clean_tmp(self) -> None:
        """Remove the temporary files of processes that no longer run (their owner lock is free or gone)."""
        base = self.root / bank_dir.TMP
        for owner in {p.name.removesuffix(".lock") for p in base.iterdir()}:
            lock, owned = base / f"{owner}.lock", base / owner
            if (held := lock_file(lock, wait=False)) is None:  # a missing lock is made here, and removed below
                continue  # its process is alive
            held.close()
            if owned.is_dir():
                shutil.rmtree(owned, ignore_errors=True)
            else:
                owned.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        """The end of its `with` block: the last uses of loaded entries committed, this process's temporary directory
        removed."""
        try:
            if self._touched and self._owner_lock is not None:
                self._commit_or_warn([])
        finally:
            self._release()

    def _release(self) -> None:
        if self._owner_lock is None:
            return
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.with_name(self.tmp.name + ".lock").unlink(missing_ok=True)
        self._owner_lock.close()
        self._owner_lock = None

    def _path(self, key: str) -> Path:
        return self.root / bank_dir.entry_file(key)

    def _load_index(self, reconcile: bool) -> tuple[dict, bool]:
        """The index (under the lock); rebuilt from the entry files when missing or unreadable. With
        `reconcile`, files the index lacks are adopted (a run killed between rename and index write)
        and records whose file is gone are dropped; with whether the index read needs writing again."""
        files = bank_dir.entry_files(self.root)
        index, why = bank_dir.index_or_why(self.root)
        if why is not None and (files or why != bank_dir.INDEX_MISSING):  # no index, no entry: a new bank
            self.warn(f"{why}; rebuilding it from {len(files)} entry files")
        if index is None:
            index, reconcile = {**MARKER_FIELDS, "entries": {}, "models": {}}, True
        if not reconcile:
            return index, why is not None
        if gone := [r["file"] for k, r in index["entries"].items() if k not in files]:
            self.warn(f"{len(gone)} indexed entries have no file (e.g. {gone[0]}); dropped from the index")
        entries = index["entries"] = {k: r for k, r in index["entries"].items() if k in files}
        adopted = False
        for key, path in [(k, p) for k, p in files.items() if k not in entries]:  # files the index lacks: adopted
            try:
                entry = bank_entry.read_header(path)
                if entry.meta["key"] != key:
                    raise EntryError("the file name does not match the key in its header")
            except (OSError, EntryError) as exc:
                fate = "removed" if self._owner_lock is not None else "not used (the bank is read-only)"
                self.warn(f"entry file {path.relative_to(self.root)}: {exc}; {fate}")
                if self._owner_lock is not None:
                    path.unlink(missing_ok=True)
                continue
            entries[key], adopted = bank_dir.entry_record(entry, path.stat().st_mtime), True
        return index, why is not None or bool(gone) or adopted

    def _publish(self, index: dict, hook: str, evicted: Sequence[Path] = ()) -> None:
        """Under the lock: this model recorded, the index written (`hook`: a fault point halfway), then the files of
        entries `_evict` dropped from it removed."""
        index["models"][self.model.digest] = self.model.about
        write_json(self.root / bank_dir.INDEX, index, hook, self.tmp, indent=0)
        for path in evicted:
            path.unlink(missing_ok=True)
        self.index = index

    def _evict(self, index: dict) -> list[Path]:
        """Drop least-recently-used records until the entries fit `max_bytes`; returns their files. Entries of this
        run's documents not used by it yet (it is about to load them) are kept."""
        if self.max_bytes is None:
            return []
        entries = index["entries"]
        kept = {k for k, r in entries.items() if r["prefix_sha256"] in self._wanted and r["last_used"] < self._opened
                and r["model"] == self.model.digest}
        oldest = sorted(entries.keys() - kept, key=lambda k: (entries[k]["last_used"], k))
        over = sum(r["file_bytes"] for r in entries.values()) - self.max_bytes  # bytes to free
        freed = itertools.accumulate((entries[k]["file_bytes"] for k in oldest), initial=0)
        n = next((i for i, f in enumerate(freed) if f >= over), len(oldest))  # the fewest oldest entries that free them
        self.stats.evicted += n
        return [self.root / entries.pop(k)["file"] for k in oldest[:n]]

    def _commit(self, written: list[tuple[str, Path, dict]]) -> None:
        """Under the lock: rename written entries into place, merge this run's records and uses into the
        freshly read index, evict, write the index, then remove evicted files."""
        faults.point("bank-before-commit")
        with bank_dir.bank_lock(self.root, True, "commit"):
            faults.point("bank-commit-locked")
            index = self._load_index(reconcile=False)[0]
            for key, tmp, _ in written:
                (final := self._path(key)).parent.mkdir(exist_ok=True)
                os.replace(tmp, final)
            dirs = {self._path(key).parent for key, _, _ in written}
            for d in [*dirs, self.root / bank_dir.ENTRIES] if dirs else []:  # the renames made durable
                fsync_dir(d)
            faults.point("bank-renamed")
            entries = index["entries"]
            for key, rec in self._touched.items():
                if not self._path(key).exists():
                    continue  # evicted by another run meanwhile
                old = entries.get(key, {})
                ids = dict.fromkeys([*old.get("doc_ids", []), *self._doc_ids.get(rec["prefix_sha256"], [])])
                entries[key] = dict(rec, last_used=max(rec["last_used"], old.get("last_used", 0.0)),
                                    doc_ids=list(ids)[:bank_dir.MAX_DOC_IDS])
            self._publish(index, "bank-index-write", self._evict(index))  # at commits only: after this run's loads
        self._touched.clear()

    # ------------------------------------------------------------ a run's documents

    def note_documents(self, prefixes: Sequence[Sequence[int]], row_prefix: Sequence[int],
                       doc_ids: Sequence[str] | None) -> None:
        """Remember the document id of each row (`doc_ids`, None without them) with its prefix (`row_prefix`), and
        report when this run's documents have entries made by another model (a bank pointed at a different model):
        those are not used."""
        shas = [prefix_key(p) for p in prefixes]
        self._wanted.update(shas)
        for p, doc_id in zip(row_prefix, doc_ids or ()):
            if len(ids := self._doc_ids.setdefault(shas[p], {})) < bank_dir.MAX_DOC_IDS:
                ids[doc_id] = None
        entries = self.index["entries"].values()
        wanted = set(shas) - {r["prefix_sha256"] for r in entries if r["model"] == self.model.digest}
        foreign = Counter(r["model"] for r in entries if r["model"] != self.model.digest and r["prefix_sha256"] in wanted)
        for fp, n in foreign.items():
            self.warn(f"{n} of this run's documents have entries made by another model ({self._model_named(fp)}); they "
                      f"are not used: prefilling them for this model ({self._model_named(self.model.digest)})")

    def _model_named(self, fingerprint: str) -> str:
        """A model of the bank's index as messages name it: its name and fingerprint."""
        return f"{self.index['models'].get(fingerprint, {}).get('name', '?')}, fingerprint {fingerprint[:12]}"

    def load(self, bank, prefixes: Sequence[Sequence[int]], docs: Sequence[int], slot_of: dict[int, int]) -> set[int]:
        """Copy the entries the store has for `docs` into their bank slots; returns the documents loaded.
        Entries that fail a check are reported and left to be prefilled (and saved again)."""
        t0 = time.perf_counter()
        found = [(d, stored(self.root, self.model.digest, prefix_key(prefixes[d]))) for d in docs if prefixes[d]]
        wanted = [(d, key) for d, key in found if key is not None]
        loaded: set[int] = set()
        for (d, key), result in zip(wanted, self._pipelined(
                lambda d, key: self._read_checked(key, bank, prefixes[d], slot_of[d]), wanted)):
            if isinstance(result, Exception):
                if not isinstance(result, FileNotFoundError):  # gone: another run evicted it
                    self.stats.rejected += 1
                    ids = self._doc_ids.get(prefix_key(prefixes[d]))
                    named = f", doc ids {listed(list(ids), 3, 'doc ids')}" if ids else ""
                    self.warn(f"entry {key[:12]} ({bank_dir.entry_file(key)}{named}): {result}; recomputing it")
                continue
            entry, tensors, views = result
            for t in bank.declared:  # one copy per contiguous block, non-blocking from pinned memory on CUDA
                lead = 1 + (t.token_axis or 0)  # leading dims (layers, any before a token axis): one block per index
                for dst, src in zip(views[t.name].flatten(0, lead - 1), tensors[t.name].flatten(0, lead - 1)):
                    dst.copy_(src, non_blocking=True)
            loaded.add(d)
            self._touched[key] = bank_dir.entry_record(entry, time.time())
            self.stats.loaded += 1
            self.stats.read_bytes += entry.size
        synchronize(bank.state.device)
        self.stats.load_s += time.perf_counter() - t0
        return loaded

    def _keys(self, prefixes: Sequence[Sequence[int]], docs: Sequence[int]) -> list[tuple[int, str]]:
        """(document, entry key) of `docs`, but those with an empty prefix (nothing to store, prefill is free)."""
        return [(d, bank_entry.entry_key(self.model.digest, prefix_key(prefixes[d]))) for d in docs if prefixes[d]]

    def _pipelined(self, fn, items: list[tuple]) -> Iterator:
        """fn(*item) for each item on worker threads, results in order, at most 2 x workers in flight (bounded
        host memory); an exception is yielded as the item's result."""
        def result(future: Future):
            try:
                return future.result()
            except (OSError, EntryError, KevscoreFailure) as exc:
                return exc

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            todo = iter(items)
            pending = deque(pool.submit(fn, *item) for item in itertools.islice(todo, 2 * self.workers))
            while pending:
                yield result(pending.popleft())
                pending.extend(pool.submit(fn, *item) for item in itertools.islice(todo, 1))  # one in, one out

    def _read_checked(self, key: str, bank, prefix: Sequence[int], slot: int):
        """An entry read back and checked (`read_entry`: its key, checked against the file name asked for, stands for
        this model's fingerprint and the prefix ids), and its shapes against the bank slot's; with the slot's views,
        where it goes."""
        entry, tensors = bank_entry.read_entry(self._path(key), pin=bank.state.device.type == "cuda")
        for name, view in (views := bank.entry(slot, len(prefix))).items():  # the shapes the bank needs
            t = tensors[name]
            if t.dtype != view.dtype or t.shape != view.shape:
                raise EntryError(f"tensor {name!r} is {tuple(t.shape)} {t.dtype}, the bank needs {tuple(view.shape)} "
                                 f"{view.dtype}")
        return entry, tensors, views

    def save(self, bank, prefixes: Sequence[Sequence[int]], docs: Sequence[int], slot_of: dict[int, int]) -> None:
        """Write the entries of freshly prefilled `docs` (copied out of their bank slots) and commit them (not in a
        bank used read-only)."""
        if self._owner_lock is None:
            return
        t0 = time.perf_counter()
        items = self._keys(prefixes, docs)

        def write(d: int, key: str):
            host = {n: t.to("cpu", copy=True).contiguous() for n, t in bank.entry(slot_of[d], len(prefixes[d])).items()}
            data = bank_entry.entry_bytes(key, self.model.digest, prefixes[d], host)
            tmp = temp_path(self._path(key), self.tmp)
            write_new(tmp, bytes_filler(data, "bank-entry-write"), self._path(key))
            return key, tmp, bank_dir.entry_record(bank_entry.read_header(tmp), time.time())

        written = []
        for (d, key), result in zip(items, self._pipelined(write, items)):
            if isinstance(result, Exception):
                self.warn(f"cannot write entry {key[:12]} ({result}); not saved")
                continue
            written.append(result)
            self._touched[key] = result[2]
        if (written or self._touched) and self._commit_or_warn(written):  # the summary counts entries the bank keeps
            self.stats.saved += len(written)
            self.stats.written_bytes += sum(rec["file_bytes"] for _, _, rec in written)
        self.stats.save_s += time.perf_counter() - t0

    def _commit_or_warn(self, written: list[tuple[str, Path, dict]]) -> bool:
        """Commit, or warn and return False: a failed commit (disk full, I/O error) costs the bank these entries,
        not the run its scores."""
        try:
            self._commit(written)
        except (OSError, KevscoreFailure) as exc:
            self._touched.clear()
            for _, tmp, _ in written:
                tmp.unlink(missing_ok=True)
            self.warn(f"cannot update the bank ({exc}); this run's {len(written)} new entries may be missing from it")
            return False
        return True
