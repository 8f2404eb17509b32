"""Files that survive a kill: atomic writes, file locks, file stamps and SHA-256s, the cache directory and what it remembers.

A write goes to a temporary file (beside its target, or in a directory on the same filesystem), is
fsynced, renamed over the target, and the directory is fsynced: a reader sees the old file or the new
one, never part of either. A write that fails removes its temporary file and raises a one-line
`KevscoreFailure` naming the target. Writers may call `kevscore.faults.point` inside a write, so tests
kill the process or fill the disk there.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kevscore import faults
from kevscore.errors import KevscoreFailure, os_failure

Filler = Callable[[BinaryIO], None]  # writes a file's contents into the open temporary file
_REMEMBERED: dict[tuple[str, str], str] = {}  # this process's `remembered` values, by (cache, key)


def cache_root() -> Path:
    """kevscore's cache directory: $KEVSCORE_CACHE, else ~/.cache/kevscore (read now, not at import)."""
    return Path(os.environ.get("KEVSCORE_CACHE") or Path.home() / ".cache" / "kevscore")


def temp_path(path: Path, tmp_dir: Path | None = None) -> Path:
    """A fresh hidden temporary name for a write of `path`, in `tmp_dir` (default: path's directory); a long name
    stands as its digest, so the temporary name fits where `path`'s does."""
    name = path.name if len(path.name.encode()) <= 200 else hashlib.sha256(path.name.encode()).hexdigest()[:32]
    return Path(tmp_dir or path.parent) / f".{name}.{secrets.token_hex(4)}.tmp"


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort: some filesystems refuse a directory fsync)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def lock_file(path: Path, exclusive: bool = True, wait: bool = True) -> BinaryIO | None:
    """`path` open, holding a flock on it (exclusive, creating the file, or shared); None when `wait` is False
    and another process holds it. Closing the file (or leaving a `with` block on it) releases the lock."""
    lock = open(os.open(path, os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY, 0o644), "rb", buffering=0)
    try:
        fcntl.flock(lock, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        lock.close()
        return None
    return lock


def write_new(tmp: Path, fill: Filler, what: Path) -> None:
    """Create `tmp`, let `fill` write it and fsync it; on any failure remove it. An OSError (disk full,
    the directory gone) becomes a KevscoreFailure naming `what`, the file being written."""
    try:
        with open(tmp, "xb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise os_failure(f"{what}: cannot write", e) from e
        raise


def replace_into(tmp: Path, path: Path) -> None:
    """Rename a complete temporary file over `path` and make the rename durable."""
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise os_failure(f"{path}: cannot write", e) from e
    fsync_dir(path.parent)


def write_atomic(path: Path, fill: Filler, tmp_dir: Path | None = None) -> None:
    """Write `path` whole or not at all: `fill` into a temporary file in tmp_dir (default: path's
    directory; it must be on path's filesystem), fsync, rename over `path`, fsync the directory."""
    tmp = temp_path(path, tmp_dir)
    write_new(tmp, fill, path)
    replace_into(tmp, path)


def bytes_filler(data: bytes | memoryview, point: str | None = None) -> Filler:
    """A filler writing `data`; `point` is a fault point halfway, with the first half in the file."""
    def fill(f: BinaryIO) -> None:
        view = memoryview(data).cast("B")
        f.write(view[:len(view) // 2])
        if point:
            f.flush()
            faults.point(point)
        f.write(view[len(view) // 2:])
    return fill


def write_json(path: Path, data: dict, point: str | None = None, tmp_dir: Path | None = None,
               indent: int | None = None) -> None:
    """`write_atomic` of `data` as JSON; `point`: a fault point halfway through the write (`bytes_filler`)."""
    write_atomic(path, bytes_filler(json.dumps(data, indent=indent).encode(), point), tmp_dir)


def write_cache_file(path: Path, data: bytes) -> None:
    """`write_atomic` of `data` into a cache file, its directory made first. Best effort: a failed write is
    ignored (it costs a recompute next time)."""
    with contextlib.suppress(OSError, KevscoreFailure):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, bytes_filler(data))


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read 16 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def read_json_object(path: Path) -> dict | None:
    """The JSON object a file holds: None when there is no file, {} when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stamp(path: Path) -> tuple[int, int, int]:
    """What tells a file's versions apart without reading it: its size, modification time and inode."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def cached_sha256(path: Path) -> str:
    """file_sha256, remembered by the path and its `stamp` (`remembered`), so a large file (a checkpoint's
    weights) is hashed once per version."""
    ident = ":".join(map(str, (path.resolve(), *stamp(path))))
    return remembered("weights-sha256.json", ident, lambda: file_sha256(path),
                      lambda key: os.path.exists(key.rsplit(":", 3)[0]))


def remembered(name: str, key: str, compute: Callable[[], str], keep: Callable[[str], bool] = lambda _: True) -> str:
    """`compute()`, remembered under `key` in this process and in `cache_root()/name` (a JSON object) across
    processes. A new value also drops the stored keys that `keep` rejects (their files are gone). Best
    effort: an unreadable cache is recomputed, a failed write costs a recompute next time."""
    if (name, key) in _REMEMBERED:
        return _REMEMBERED[name, key]
    cache = cache_root() / name
    known = read_json_object(cache) or {}
    if not isinstance(known.get(key), str):
        known = {k: v for k, v in known.items() if keep(k)} | {key: compute()}
        write_cache_file(cache, json.dumps(known).encode())
    _REMEMBERED[name, key] = known[key]
    return known[key]
