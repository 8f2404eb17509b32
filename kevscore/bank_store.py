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

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kevscore import faults
from kevscore.durable import bytes_filler, cached_sha256, fsync_dir, write_atomic, write_new
from kevscore.errors import KevscoreError, KevscoreFailure, first_line
from kevscore.layers.common import TOKENS
from kevscore.model import BANK_GROUPS, BANK_TENSORS
from kevscore.prompt import prefix_key

FORMAT, VERSION = "kevscore-bank", 1
MARKER, INDEX, LOCK, ENTRIES, TMP = "kevbank.json", "index.json", "lock", "entries", "tmp"
BANK_NAMES = {MARKER, INDEX, LOCK, ENTRIES, TMP}
SUFFIX = ".safetensors"
TENSORS = (*(t.name for t in BANK_TENSORS), "ids")  # the layers' declared tensors and the prefix ids
COMPONENTS = {t.name: t.component or t.name for t in BANK_TENSORS}  # tensor -> component name in reports
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
RANKS = {**{t.name: 1 + len(t.dims) for t in BANK_TENSORS}, "ids": 1}  # [layers, *dims]; ids [tokens]
MAX_DOC_IDS = 32  # document ids remembered per entry
META_KEYS = ("format", "version", "key", "model", "prefix_sha256", "tokens", "crc32", "created")


class EntryError(Exception):
    """An entry file that must not be used; the message says why, on one line."""


class VersionError(KevscoreError):
    pass


# ---------------------------------------------------------------- model fingerprint

@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What makes bank entries interchangeable: config, weights, bank dtype and ops backend."""
    digest: str
    about: dict  # name, dtype, backend, weights digest, config (for bank-inspect)

    @property
    def short(self) -> str:
        return self.digest[:12]


def model_fingerprint(ckpt, dtype: torch.dtype, backend: str) -> Fingerprint:
    """sha256 over the model config, a digest of the weights, the bank dtype and the ops backend
    (CPU fp32 torch ops and GPU bf16 FLA kernels make different entries for the same weights)."""
    config = dataclasses.asdict(ckpt.config)
    about = {"name": ckpt.name, "dtype": str(dtype).removeprefix("torch."), "backend": backend,
             "weights": weights_digest(ckpt), "config": config}
    digest = hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()
    return Fingerprint(digest, about)


def weights_digest(ckpt) -> str:
    """A checkpoint directory: sha256 of its safetensors files (cached per file by path, size, mtime and
    inode, so it is computed once per checkpoint). In-memory weights (benchmark shapes, tests): sha256
    over names, dtypes, shapes and the tensors' bytes, sampled for large tensors (seeded random weights)."""
    if ckpt.path is not None:
        files = sorted(Path(ckpt.path).glob("*.safetensors"))
        return hashlib.sha256("".join(f"{f.name}:{cached_sha256(f)};" for f in files).encode()).hexdigest()
    digest = hashlib.sha256()
    for name in sorted(ckpt.weights):
        t = ckpt.weights[name].detach()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        flat = t.reshape(-1)
        if flat.numel() > 1 << 20:  # 65537 evenly spaced elements, the last one included
            step = max(1, flat.numel() // 65536)
            flat = torch.cat([flat[::step], flat[-1:]])
        digest.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return "mem:" + digest.hexdigest()


def entry_key(model: str, prefix_sha256: str) -> str:
    return hashlib.sha256(f"{model}:{prefix_sha256}".encode()).hexdigest()


# ---------------------------------------------------------------- files

@dataclass(slots=True)
class EntryFile:
    """A parsed entry file: its metadata, and per tensor (dtype, shape, absolute byte range)."""
    meta: dict[str, str]
    tensors: dict[str, tuple[str, list[int], int, int]]
    size: int

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    def component_bytes(self) -> dict[str, int]:
        return {COMPONENTS[n]: end - begin for n, (_, _, begin, end) in self.tensors.items() if n in COMPONENTS}


def _parse_header(head: bytes, size: int) -> EntryFile:
    """Check a safetensors header (`head` holds at least its first 8 + n bytes) and the entry layout it
    describes: the four tensors, their ranks and dtypes, byte ranges that tile the data exactly, and the
    metadata fields. Raises EntryError, whatever the bytes."""
    try:
        return _checked_header(head, size)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise EntryError(f"malformed header ({type(exc).__name__}: {str(exc)[:80]})") from None


def _tensor_spec(name: str, spec) -> tuple[str, list[int], int, int]:
    """(dtype, shape, begin, end) of one tensor's header entry; EntryError unless it is well formed."""
    ints = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)  # noqa: E731
    if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and ints(spec.get("shape"))
            and ints(spec.get("data_offsets")) and len(spec["data_offsets"]) == 2):
        raise EntryError(f"tensor {name!r}: malformed header entry")
    return spec["dtype"], spec["shape"], *spec["data_offsets"]


def _checked_header(head: bytes, size: int) -> EntryFile:
    if size < 8:
        raise EntryError(f"truncated ({size} bytes)")
    n = int.from_bytes(head[:8], "little")
    if n > size - 8 or n > 1 << 24:
        raise EntryError(f"truncated or not safetensors (header of {n} bytes, file of {size})")
    try:
        header = json.loads(bytes(head[8:8 + n]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise EntryError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise EntryError("unreadable header (not a JSON object)")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or any(not isinstance(meta.get(k), str) for k in META_KEYS):
        raise EntryError("header metadata missing or incomplete")
    if meta["format"] != FORMAT:
        raise EntryError(f"not a kevscore bank entry (format {meta['format']!r})")
    if meta["version"] != str(VERSION):
        raise EntryError(f"bank format version {meta['version']}, this kevscore reads version {VERSION}")
    if sorted(header) != sorted(TENSORS):
        raise EntryError(f"tensors {sorted(header)}, expected {sorted(TENSORS)}")
    tensors, spans = {}, []
    data_start = 8 + n
    for name, spec in header.items():
        dtype, shape, begin, end = _tensor_spec(name, spec)
        if dtype not in DTYPES or len(shape) != RANKS[name] or min(shape, default=0) < 0:
            raise EntryError(f"tensor {name!r}: unexpected dtype {dtype} or shape {shape}")
        nbytes = DTYPES[dtype].itemsize
        for s in shape:
            nbytes *= s
        if end - begin != nbytes:
            raise EntryError(f"tensor {name!r}: byte range {begin}..{end} does not hold {shape} {dtype}")
        tensors[name] = (dtype, shape, data_start + begin, data_start + end)
        spans.append((begin, end))
    spans.sort()
    if spans[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
        raise EntryError("tensor byte ranges do not tile the data")
    if data_start + spans[-1][1] != size:
        kind = "truncated" if data_start + spans[-1][1] > size else "trailing bytes"
        raise EntryError(f"{kind}: the header describes {data_start + spans[-1][1]} bytes, the file has {size}")
    try:
        tokens, _ = int(meta["tokens"]), float(meta["created"])
        crc = json.loads(meta["crc32"])
        assert isinstance(crc, dict) and sorted(crc) == sorted(TENSORS)
        assert all(isinstance(v, int) for v in crc.values())
    except (ValueError, AssertionError):
        raise EntryError("header metadata tokens/created/crc32 malformed") from None
    if not _consistent({name: spec[1] for name, spec in tensors.items()}, tokens) or tensors["ids"][0] != "I64":
        shapes = ", ".join(f"{name} {tensors[name][1]}" for name in TENSORS)
        raise EntryError(f"inconsistent shapes for {tokens} tokens: {shapes}")
    return EntryFile(meta, tensors, size)


def _consistent(shapes: dict[str, list[int]], tokens: int) -> bool:
    """Shapes that fit the layers' declarations: `tokens` ids and rows on every token axis, the declared
    literal sizes, one layer count per layer kind."""
    if shapes["ids"] != [tokens]:
        return False
    for group in BANK_GROUPS:
        if len({shapes[t.name][0] for t in group}) > 1:
            return False
        for t in group:
            want = [tokens if d == TOKENS else d for d in t.dims]
            if any(isinstance(w, int) and w != got for w, got in zip(want, shapes[t.name][1:])):
                return False
    return True


def read_header(path: Path) -> EntryFile:
    """Parse an entry file's header only (no data read, no checksum)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            head += f.read(min(int.from_bytes(head, "little"), 1 << 24))
    return _parse_header(head, size)


def read_entry(path: Path, pin: bool = False) -> tuple[EntryFile, dict[str, torch.Tensor]]:
    """Read an entry file into one host buffer (pinned when `pin`) and check it: header, layout, key
    derived from the model and the ids, and every tensor's CRC-32. Returns views into the buffer."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        view = memoryview(buf.numpy())
        done = 0
        while done < size:
            got = f.readinto(view[done:])
            if not got:
                raise EntryError(f"truncated while reading ({done} of {size} bytes)")
            done += got
    entry = _parse_header(view, size)
    crc = json.loads(entry.meta["crc32"])
    tensors = {}
    for name, (dtype, shape, begin, end) in entry.tensors.items():
        if zlib.crc32(view[begin:end]) != crc[name]:
            raise EntryError(f"checksum mismatch in {name!r} (CRC-32 {zlib.crc32(view[begin:end]):08x}, "
                             f"recorded {crc[name]:08x})")
        raw = buf[begin:end]
        if begin % DTYPES[dtype].itemsize:  # safetensors aligns data; copy if a writer did not
            raw = raw.clone()
        tensors[name] = raw.view(DTYPES[dtype]).view(shape)
    prefix_sha = hashlib.sha256(tensors["ids"].numpy().tobytes()).hexdigest()
    if prefix_sha != entry.meta["prefix_sha256"]:
        raise EntryError("prefix ids do not match the recorded prefix hash")
    key = entry_key(entry.meta["model"], prefix_sha)
    if key != entry.meta["key"] or path.name != key + SUFFIX:
        raise EntryError("key does not match the model fingerprint and prefix ids, or the file name")
    return entry, tensors


def entry_bytes(key: str, model: str, ids: Sequence[int], entry: dict[str, torch.Tensor]) -> bytes:
    """Serialize one entry (contiguous host tensors, by name) as safetensors, with CRC-32s in the metadata."""
    from safetensors.torch import save

    tensors = {**entry, "ids": torch.as_tensor(list(ids), dtype=torch.int64)}
    crc = {n: zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) for n, t in tensors.items()}
    meta = {"format": FORMAT, "version": str(VERSION), "key": key, "model": model,
            "prefix_sha256": prefix_key(ids), "tokens": str(len(ids)), "crc32": json.dumps(crc),
            "created": f"{time.time():.3f}"}
    return save(tensors, metadata=meta)


def _record(entry: EntryFile, path: Path, root: Path, last_used: float, doc_ids: Sequence[str] = ()) -> dict:
    return {"file": path.relative_to(root).as_posix(), "model": entry.meta["model"],
            "prefix_sha256": entry.meta["prefix_sha256"], "tokens": entry.tokens,
            "bytes": entry.component_bytes(), "file_bytes": entry.size, "created": float(entry.meta["created"]),
            "last_used": last_used, "doc_ids": list(doc_ids)[:MAX_DOC_IDS]}


def _check_record(key: str, rec) -> None:
    ok = (isinstance(rec, dict) and isinstance(rec.get("file"), str) and isinstance(rec.get("model"), str)
          and isinstance(rec.get("tokens"), int) and isinstance(rec.get("file_bytes"), int)
          and isinstance(rec.get("bytes"), dict) and all(type(v) is int for v in rec["bytes"].values())
          and isinstance(rec.get("last_used"), (int, float)) and isinstance(rec.get("doc_ids"), list)
          and all(isinstance(i, str) for i in rec["doc_ids"]) and isinstance(rec.get("prefix_sha256"), str)
          and rec["file"] == f"{ENTRIES}/{key[:2]}/{key}{SUFFIX}")
    if not ok:
        raise TypeError(f"malformed record for entry {key[:12]}")


def _merge_ids(old: Sequence[str], new: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([*old, *new]))[:MAX_DOC_IDS]


# ---------------------------------------------------------------- the bank directory

def check_bank_dir(root: Path, create: bool) -> None:
    """Refuse what is not a kevscore bank of this format version, with a one-line message."""
    if root.exists() and not root.is_dir():
        raise KevscoreError(f"{root}: the bank is not a directory")
    if not root.exists():
        if create:
            return
        raise KevscoreError(f"{root}: no such bank directory")
    try:
        _check_bank_contents(root, create)
    except OSError as exc:
        raise KevscoreError(f"{root}: cannot read the bank directory ({exc.strerror or exc})") from exc


def _check_bank_contents(root: Path, create: bool) -> None:
    marker = root / MARKER
    if marker.is_file():
        try:
            info = json.loads(marker.read_text())
            fmt, version = info["format"], info["version"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KevscoreError(f"{marker}: unreadable bank marker ({type(exc).__name__}); "
                                "not a kevscore bank?") from None
        if fmt != FORMAT:
            raise KevscoreError(f"{marker}: format {fmt!r} is not a kevscore bank")
        if version != VERSION:
            raise VersionError(f"{root}: kevscore bank format version {version}; this kevscore reads version "
                               f"{VERSION} only. Use another --bank directory (or delete this one)")
        return
    others = sorted(p.name for p in root.iterdir() if p.name not in BANK_NAMES)
    if others:
        raise KevscoreError(f"{root}: not a kevscore bank (no {MARKER}) and not empty "
                            f"(holds {', '.join(others[:3])}{', …' if len(others) > 3 else ''})")
    if not create and not (root / ENTRIES).is_dir():
        raise KevscoreError(f"{root}: not a kevscore bank (no {MARKER})")


def _entry_files(root: Path) -> dict[str, Path]:
    out = {}
    base = root / ENTRIES
    if base.is_dir():
        for sub in base.iterdir():
            if sub.is_dir():
                for p in sub.iterdir():
                    if p.name.endswith(SUFFIX):
                        out[p.name[: -len(SUFFIX)]] = p
    return out


def _read_index(root: Path) -> dict:
    """The parsed index; ValueError when missing-but-expected or malformed, VersionError when foreign."""
    try:
        data = json.loads((root / INDEX).read_bytes())
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a kevscore bank index")
    if data.get("version") != VERSION:
        raise VersionError(f"{root / INDEX}: kevscore bank format version {data.get('version')}; this kevscore "
                           f"reads version {VERSION} only. Use another --bank directory (or delete this one)")
    entries, models = data.get("entries"), data.get("models")
    if not isinstance(entries, dict) or not isinstance(models, dict):
        raise TypeError("no entries/models tables")
    if not all(isinstance(about, dict) for about in models.values()):
        raise TypeError("malformed models table")
    for key, rec in entries.items():
        _check_record(key, rec)
    return data


@contextlib.contextmanager
def _flock(root: Path, exclusive: bool, purpose: str) -> Iterator[None]:
    faults.point(f"bank-lock-wait-{purpose}")
    path = root / LOCK
    if not exclusive and not path.exists():
        yield  # a read-only look at a bank without a lock file (nothing can be writing to it)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


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


class BankStore:
    """An open bank directory for one model; call close() at the end of the run."""

    def __init__(self, root: Path, model: Fingerprint, max_bytes: int | None = None,
                 warn: Callable[[str], None] | None = None, workers: int | None = None):
        self.root, self.model, self.max_bytes = Path(root), model, max_bytes
        self._warn_cb = warn
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        self.stats = BankStats()
        self._touched: dict[str, float] = {}         # key -> last use, for the next commit
        self._records: dict[str, dict] = {}          # key -> record of entries used or written by this run
        self._doc_ids: dict[str, list[str]] = {}     # prefix sha256 -> document ids of this run
        self._owner_fd: int | None = None
        check_bank_dir(self.root, create=True)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            with _flock(self.root, True, "open"):
                check_bank_dir(self.root, create=True)  # again, under the lock
                (self.root / ENTRIES).mkdir(exist_ok=True)
                self._clean_tmp()
                self._make_owner()
                if not (self.root / MARKER).exists():
                    marker = json.dumps({"format": FORMAT, "version": VERSION}).encode()
                    write_atomic(self.root / MARKER, bytes_filler(marker), self.tmp)
                index = self._load_index(reconcile=True)
                index["models"][model.digest] = model.about
                for path in self._evict(index):
                    path.unlink(missing_ok=True)
                self._write_index(index, "bank-index-write-open")
                self.index = index
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------ housekeeping

    def warn(self, message: str) -> None:
        self.stats.warnings.append(message)
        if self._warn_cb is not None:
            self._warn_cb(message)

    def _clean_tmp(self) -> None:
        """Remove the temporary files of processes that no longer run (their owner lock is free)."""
        base = self.root / TMP
        if not base.is_dir():
            return
        for p in base.iterdir():
            if p.name.endswith(".lock"):
                continue
            lock = p.with_name(p.name + ".lock")
            if lock.exists():
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process is alive
                finally:
                    os.close(fd)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
        for lock in base.glob("*.lock"):
            if not lock.with_suffix("").exists():
                lock.unlink(missing_ok=True)

    def _make_owner(self) -> None:
        base = self.root / TMP
        base.mkdir(exist_ok=True)
        owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._owner_fd = os.open(base / f"{owner}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._owner_fd, fcntl.LOCK_EX)
        self.tmp = base / owner
        self.tmp.mkdir()

    def close(self) -> None:
        """Commit the last uses of loaded entries, remove this process's temporary directory."""
        if self._owner_fd is None:
            return
        try:
            if self._touched:
                self._commit_or_warn([])
        finally:
            self._release()

    def _release(self) -> None:
        if self._owner_fd is None:
            return
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.with_name(self.tmp.name + ".lock").unlink(missing_ok=True)
        os.close(self._owner_fd)
        self._owner_fd = None

    def _path(self, key: str) -> Path:
        return self.root / ENTRIES / key[:2] / f"{key}{SUFFIX}"

    def _load_index(self, reconcile: bool) -> dict:
        """The index (under the lock); rebuilt from the entry files when missing or unreadable. With
        `reconcile`, files the index lacks are adopted (a run killed between rename and index write)
        and records whose file is gone are dropped."""
        files = _entry_files(self.root)
        try:
            index = _read_index(self.root)
        except FileNotFoundError:
            index = None
            if files:
                self.warn(f"bank {self.root}: {INDEX} is missing; rebuilding it from {len(files)} entry files")
        except VersionError:
            raise
        except (OSError, ValueError, TypeError) as exc:
            index = None
            self.warn(f"bank {self.root}: {INDEX} is unreadable ({first_line(exc)[:120]}); "
                      f"rebuilding it from {len(files)} entry files")
        if index is None:
            index, reconcile = {"format": FORMAT, "version": VERSION, "entries": {}, "models": {}}, True
        if not reconcile:
            return index
        entries = index["entries"]
        gone = [k for k in entries if k not in files]
        if gone:
            self.warn(f"bank {self.root}: {len(gone)} indexed entries have no file "
                      f"(e.g. {entries[gone[0]]['file']}); dropped from the index")
            for k in gone:
                del entries[k]
        for key, path in files.items():
            if key in entries:
                continue
            try:
                entry = read_header(path)
                if entry.meta["key"] != key:
                    raise EntryError("the file name does not match the key in its header")
            except (OSError, EntryError) as exc:
                self.warn(f"bank {self.root}: entry file {path.relative_to(self.root)}: {exc}; removed")
                path.unlink(missing_ok=True)
                continue
            entries[key] = _record(entry, path, self.root, path.stat().st_mtime)
        return index

    def _write_index(self, index: dict, hook: str) -> None:
        write_atomic(self.root / INDEX, bytes_filler(json.dumps(index, indent=0).encode(), hook), self.tmp)

    def _evict(self, index: dict) -> list[Path]:
        """Drop least-recently-used records until the entries fit `max_bytes`; returns their files."""
        if self.max_bytes is None:
            return []
        entries = index["entries"]
        total = sum(r["file_bytes"] for r in entries.values())
        out = []
        for key in sorted(entries, key=lambda k: (entries[k]["last_used"], k)):
            if total <= self.max_bytes:
                break
            total -= entries[key]["file_bytes"]
            out.append(self.root / entries.pop(key)["file"])
        self.stats.evicted += len(out)
        return out

    def _commit(self, written: list[tuple[str, Path, dict]]) -> None:
        """Under the lock: rename written entries into place, merge this run's records and uses into the
        freshly read index, evict, write the index, then remove evicted files."""
        faults.point("bank-before-commit")
        with _flock(self.root, True, "commit"):
            faults.point("bank-commit-locked")
            index = self._load_index(reconcile=False)
            dirs = set()
            for key, tmp, _ in written:
                final = self._path(key)
                final.parent.mkdir(exist_ok=True)
                os.replace(tmp, final)
                dirs.add(final.parent)
            for d in dirs:
                fsync_dir(d)
            if dirs:
                fsync_dir(self.root / ENTRIES)
            faults.point("bank-renamed")
            entries = index["entries"]
            index["models"][self.model.digest] = self.model.about
            for key, used in self._touched.items():
                if not self._path(key).exists():
                    continue  # evicted by another run meanwhile
                old = entries.get(key, {})
                rec = dict(self._records[key], last_used=max(used, old.get("last_used", 0.0)))
                rec["doc_ids"] = _merge_ids(old.get("doc_ids", []), self._doc_ids.get(rec["prefix_sha256"], []))
                entries[key] = rec
            evicted = self._evict(index)
            self._write_index(index, "bank-index-write")
            for path in evicted:
                path.unlink(missing_ok=True)
            self.index = index
        self._touched.clear()

    # ------------------------------------------------------------ a run's documents

    def note_documents(self, prefixes: Sequence[Sequence[int]], doc_ids: Sequence[Sequence[str]]) -> None:
        """Remember the document ids seen with each prefix, and report when this run's documents have
        entries made by another model (a bank pointed at a different model): those are not used."""
        shas = [prefix_key(p) for p in prefixes]
        for sha, ids in zip(shas, doc_ids):
            self._doc_ids[sha] = _merge_ids(self._doc_ids.get(sha, []), ids)
        entries = self.index["entries"]
        mine = {r["prefix_sha256"] for r in entries.values() if r["model"] == self.model.digest}
        foreign: dict[str, int] = {}
        wanted = set(shas) - mine
        for r in entries.values():
            if r["model"] != self.model.digest and r["prefix_sha256"] in wanted:
                foreign[r["model"]] = foreign.get(r["model"], 0) + 1
        for fp, n in foreign.items():
            name = self.index["models"].get(fp, {}).get("name", "?")
            self.warn(f"bank {self.root}: {n} of this run's documents have entries made by another model "
                      f"({name}, fingerprint {fp[:12]}); they are not used: prefilling them for this model "
                      f"({self.model.about['name']}, fingerprint {self.model.short})")

    def load(self, bank, prefixes: Sequence[Sequence[int]], docs: Sequence[int], slot_of: dict[int, int]) -> set[int]:
        """Copy the entries the store has for `docs` into their bank slots; returns the documents loaded.
        Entries that fail a check are reported and left to be prefilled (and saved again)."""
        t0 = time.perf_counter()
        device = bank.state.device
        wanted = []
        for d in docs:
            if not prefixes[d]:
                continue  # an empty prefix: nothing to store, prefill is free
            key = entry_key(self.model.digest, prefix_key(prefixes[d]))
            if self._path(key).exists():
                wanted.append((d, key))
        loaded: set[int] = set()
        for (d, key), result in zip(wanted, self._pipelined(
                lambda item: self._read_checked(item[1], bank, prefixes[item[0]]), wanted)):
            if isinstance(result, Exception):
                if not isinstance(result, FileNotFoundError):  # gone: another run evicted it
                    self.stats.rejected += 1
                    self.warn(f"bank {self.root}: entry {key[:12]} ({self._path(key).relative_to(self.root)}"
                              f"{self._ids_phrase(prefixes[d])}): {result}; recomputing it")
                continue
            entry, tensors = result
            self._copy_in(bank, slot_of[d], tensors)
            loaded.add(d)
            self._touched[key] = time.time()
            self._records[key] = _record(entry, self._path(key), self.root, time.time())
            self.stats.loaded += 1
            self.stats.read_bytes += entry.size
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.stats.load_s += time.perf_counter() - t0
        return loaded

    def _ids_phrase(self, prefix: Sequence[int]) -> str:
        ids = self._doc_ids.get(prefix_key(prefix))
        return f", doc ids {', '.join(ids[:3])}{', …' if len(ids) > 3 else ''}" if ids else ""

    def _pipelined(self, fn, items: list) -> Iterator:
        """fn over items on worker threads, results in order, at most 2 x workers in flight (bounded
        host memory); an exception is yielded as the item's result."""
        if not items:
            return
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            pending: list[Future] = []
            it = iter(items)
            for item in it:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * self.workers:
                    break
            while pending:
                fut = pending.pop(0)
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(pool.submit(fn, nxt))
                try:
                    yield fut.result()
                except (OSError, EntryError, KevscoreFailure) as exc:
                    yield exc

    def _read_checked(self, key: str, bank, prefix: Sequence[int]):
        path = self._path(key)
        entry, tensors = read_entry(path, pin=bank.state.device.type == "cuda")
        if entry.meta["model"] != self.model.digest:
            name = self.index["models"].get(entry.meta["model"], {}).get("name", "?")
            raise EntryError(f"made by another model ({name}, fingerprint {entry.meta['model'][:12]})")
        for name, (dtype, shape) in bank.entry_shapes(len(prefix)).items():
            t = tensors[name]
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise EntryError(f"tensor {name!r} is {tuple(t.shape)} {t.dtype}, the bank needs {shape} {dtype}")
        if tensors["ids"].tolist() != list(prefix):
            raise EntryError("its prefix ids differ from the document's")
        return entry, tensors

    @staticmethod
    def _copy_in(bank, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Host -> bank slot, one copy per contiguous block (per layer, and per index of the dims before a
        token axis), non-blocking from pinned memory on CUDA."""
        views = bank.entry(slot, len(tensors["ids"]))
        for t in bank.declared:
            lead = 1 + (t.token_axis or 0)  # leading dims whose every index is one contiguous block
            for dst, src in zip(views[t.name].flatten(0, lead - 1), tensors[t.name].flatten(0, lead - 1)):
                dst.copy_(src, non_blocking=True)

    def save(self, bank, prefixes: Sequence[Sequence[int]], docs: Sequence[int], slot_of: dict[int, int]) -> None:
        """Write the entries of freshly prefilled `docs` (copied out of their bank slots) and commit them."""
        t0 = time.perf_counter()
        items = []
        for d in docs:
            if prefixes[d]:
                items.append((d, entry_key(self.model.digest, prefix_key(prefixes[d]))))

        def write(item):
            d, key = item
            prefix = prefixes[d]
            host = {name: t.to("cpu", copy=True).contiguous() for name, t in bank.entry(slot_of[d], len(prefix)).items()}
            data = entry_bytes(key, self.model.digest, prefix, host)
            tmp = self.tmp / f"{key}{SUFFIX}.tmp"
            tmp.unlink(missing_ok=True)
            write_new(tmp, bytes_filler(data, "bank-entry-write"), self._path(key))
            return key, tmp, _record(read_header(tmp), self._path(key), self.root, time.time())

        written = []
        for (d, key), result in zip(items, self._pipelined(write, items)):
            if isinstance(result, Exception):
                self.warn(f"bank {self.root}: cannot write entry {key[:12]} ({result}); not saved")
                continue
            written.append(result)
            self._records[key] = result[2]
            self._touched[key] = result[2]["last_used"]
            self.stats.saved += 1
            self.stats.written_bytes += result[2]["file_bytes"]
        if written or self._touched:
            self._commit_or_warn(written)
        self.stats.save_s += time.perf_counter() - t0

    def _commit_or_warn(self, written: list[tuple[str, Path, dict]]) -> None:
        """A failed commit (disk full, I/O error) costs the bank these entries, not the run its scores."""
        try:
            self._commit(written)
        except (OSError, KevscoreFailure) as exc:
            self._touched.clear()
            for _, tmp, _ in written:
                tmp.unlink(missing_ok=True)
            self.stats.saved -= len(written)  # the summary counts entries the bank keeps
            self.stats.written_bytes -= sum(rec["file_bytes"] for _, _, rec in written)
            self.warn(f"bank {self.root}: cannot update the bank ({exc}); this run's {len(written)} new "
                      "entries may be missing from it")


# ---------------------------------------------------------------- inspection

def inspect_bank(root: Path, entry: str | None = None, verify: bool = False) -> dict:
    """A read-only report of a bank directory (the shape `bank-inspect --json` prints)."""
    root = Path(root)
    check_bank_dir(root, create=False)
    with _flock(root, False, "inspect"):
        files = _entry_files(root)
        notes: list[str] = []
        try:
            index = _read_index(root)
        except VersionError:
            raise
        except FileNotFoundError:
            index = None
            notes.append(f"{INDEX} is missing: entries listed from their files (the next run rebuilds it)")
        except (OSError, ValueError, TypeError) as exc:
            index = None
            notes.append(f"{INDEX} is unreadable ({first_line(exc)[:120]}): entries listed from "
                         "their files (the next run rebuilds it)")
        records = dict(index["entries"]) if index else {}
        models = dict(index["models"]) if index else {}
        rows = []
        keys = sorted(set(records) | set(files))
        chosen = None
        if entry is not None:
            matches = [k for k in keys if k.startswith(entry)]
            if not matches:
                raise KevscoreError(f"{root}: no entry {entry!r}")
            if len(matches) > 1:
                raise KevscoreError(f"{root}: entry {entry!r} is ambiguous ({len(matches)} entries start with it)")
            chosen = matches[0]
        for key in keys:
            rec, path = records.get(key), files.get(key)
            row = {"key": key, "file": f"{ENTRIES}/{key[:2]}/{key}{SUFFIX}", "indexed": rec is not None,
                   "status": "unchecked"}
            if path is None:
                row.update(status="missing file", model=rec["model"], tokens=rec["tokens"], doc_ids=rec["doc_ids"],
                           bytes=rec["bytes"], file_bytes=0, last_used=rec["last_used"])
                rows.append(row)
                continue
            try:
                head = read_header(path)
                row.update(model=head.meta["model"], tokens=head.tokens, bytes=head.component_bytes(),
                           file_bytes=head.size, created=float(head.meta["created"]),
                           tensors={n: {"dtype": d, "shape": s} for n, (d, s, _, _) in head.tensors.items()})
            except (OSError, EntryError) as exc:
                row.update(status=f"corrupt: {exc}", model=rec["model"] if rec else None,
                           tokens=rec["tokens"] if rec else None, bytes=rec["bytes"] if rec else {},
                           file_bytes=path.stat().st_size)
            row["doc_ids"] = rec["doc_ids"] if rec else []
            row["last_used"] = rec["last_used"] if rec else path.stat().st_mtime
            if verify and row["status"] == "unchecked" and chosen in (None, key):
                try:
                    checked, tensors = read_entry(path)
                    row["status"] = "ok"
                    if entry is not None:
                        row["ids_head"] = tensors["ids"][:16].tolist()
                        row["crc32"] = json.loads(checked.meta["crc32"])
                except (OSError, EntryError) as exc:
                    row["status"] = f"corrupt: {exc}"
            rows.append(row)
        tmp = root / TMP
        leftovers = [p for p in tmp.iterdir() if not p.name.endswith(".lock")] if tmp.is_dir() else []
    for fp in {r.get("model") for r in rows if r.get("model")}:
        models.setdefault(fp, {"name": "?"})
    per_model = {fp: {"about": about, "entries": sum(r.get("model") == fp for r in rows),
                      "file_bytes": sum(r["file_bytes"] for r in rows if r.get("model") == fp)}
                 for fp, about in models.items()}
    totals = {"entries": len(rows), "file_bytes": sum(r["file_bytes"] for r in rows), "tokens": 0}
    for r in rows:
        totals["tokens"] += r.get("tokens") or 0
        for comp in COMPONENTS.values():
            totals[comp] = totals.get(comp, 0) + (r.get("bytes") or {}).get(comp, 0)
    disk = shutil.disk_usage(root)
    shown = rows if chosen is None else [r for r in rows if r["key"] == chosen]
    bad = [r["key"] for r in shown if r["status"] not in ("ok", "unchecked")]
    return {"bank": str(root), "format": FORMAT, "version": VERSION, "models": per_model, "entries": shown,
            "totals": totals, "disk": {"free_bytes": disk.free, "total_bytes": disk.total},
            "verified": verify, "bad_entries": bad, "notes": notes,
            "unindexed": [r["key"] for r in rows if not r["indexed"]],
            "temporary": [p.name for p in leftovers]}
