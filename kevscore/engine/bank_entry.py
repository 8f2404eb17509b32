"""One persistent bank entry on disk: the model fingerprint that keys it, its file, its checked read.

One persistent bank entry on disk: the model fingerprint that keys it (config, weights, bank dtype, ops
backend), its safetensors file (the layers' declared tensors, the prefix ids, metadata with CRC-32s), and
reading it back with every check (header, layout, shapes, key, checksums). `bank_store` keeps the entries."""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kevscore.durable import cached_sha256
from kevscore.model.kev import BANK_GROUPS, BANK_TENSORS
from kevscore.model.layers.common import TOKENS
from kevscore.model.prompt import prefix_key

FORMAT, VERSION = "kevscore-bank", 1
SUFFIX = ".safetensors"
TENSORS = (*(t.name for t in BANK_TENSORS), "ids")  # the layers' declared tensors and the prefix ids
COMPONENTS = {t.name: t.component or t.name for t in BANK_TENSORS}  # tensor -> component name in reports
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
RANKS = {**{t.name: 1 + len(t.dims) for t in BANK_TENSORS}, "ids": 1}  # [layers, *dims]; ids [tokens]
META_KEYS = ("format", "version", "key", "model", "prefix_sha256", "tokens", "crc32", "created")


class EntryError(Exception):
    """An entry file that must not be used; the message says why, on one line."""


# ---------------------------------------------------------------- model fingerprint

@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What makes bank entries interchangeable: config, weights, bank dtype and ops backend."""
    digest: str
    about: dict  # name, dtype, backend, weights digest, config (for bank-inspect)


def model_fingerprint(ckpt, dtype: torch.dtype, backend: str, weights: str | None = None) -> Fingerprint:
    """sha256 over the model config, a digest of the weights (`weights`: `weights_digest(ckpt)` computed
    before), the bank dtype and the ops backend (CPU fp32 torch ops and GPU bf16 FLA kernels make different
    entries for the same weights)."""
    about = {"name": ckpt.name, "dtype": str(dtype).removeprefix("torch."), "backend": backend,
             "weights": weights or weights_digest(ckpt), "config": asdict(ckpt.config)}
    return Fingerprint(hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest(), about)


def weights_digest(ckpt) -> str:
    """A checkpoint directory: sha256 of its safetensors files (cached per file by path, size, mtime and
    inode, so it is computed once per checkpoint). In-memory weights (benchmark shapes, tests): sha256
    over names, dtypes, shapes and the tensors' bytes, sampled for large tensors (seeded random weights)."""
    if ckpt.path is not None:
        files = sorted(Path(ckpt.path).glob("*.safetensors"))
        return hashlib.sha256("".join(f"{f.name}:{cached_sha256(f)};" for f in files).encode()).hexdigest()
    weights = sorted(ckpt.weights.items())
    samples = []  # each tensor's bytes, sampled: brought to the host in one copy (one wait for a GPU)
    for _, t in weights:
        flat = t.detach().reshape(-1)
        if flat.numel() > 1 << 20:  # 65537 evenly spaced elements, the last one included
            flat = torch.cat([flat[::max(1, flat.numel() // 65536)], flat[-1:]])
        samples.append(flat.contiguous().view(torch.uint8))
    host = torch.cat(samples).cpu().split([s.numel() for s in samples]) if samples else ()
    digest = hashlib.sha256()
    for (name, t), sample in zip(weights, host):
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(sample.numpy().tobytes())
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
    crc: dict[str, int]  # per tensor, the CRC-32 of its bytes
    tokens: int          # the prefix's, as the metadata records it

    def component_bytes(self) -> dict[str, int]:
        return {COMPONENTS[n]: end - begin for n, (_, _, begin, end) in self.tensors.items() if n in COMPONENTS}


def _parse_header(head: bytes, size: int) -> EntryFile:
    """Check a safetensors header (`head` holds at least its first 8 + n bytes) and the entry layout it
    describes: the four tensors, their ranks and dtypes, byte ranges that tile the data exactly, and the
    metadata fields. Raises EntryError, whatever the bytes."""
    try:
        n = int.from_bytes(head[:8], "little")
        if n > size - 8 or n > 1 << 24:  # a file under 8 bytes too
            raise EntryError(f"truncated or not safetensors (header of {n} bytes, file of {size})")
        header = json.loads(bytes(head[8:8 + n]))  # not JSON, or not an object: malformed (below)
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or any(not isinstance(meta.get(k), str) for k in META_KEYS):
            raise EntryError("header metadata missing or incomplete")
        if meta["format"] != FORMAT:
            raise EntryError(f"not a kevscore bank entry (format {meta['format']!r})")
        if meta["version"] != str(VERSION):
            raise EntryError(f"bank format version {meta['version']}, this kevscore reads version {VERSION}")
        if sorted(header) != sorted(TENSORS):
            raise EntryError(f"tensors {sorted(header)}, expected {sorted(TENSORS)}")
        tensors = {}
        data_start = 8 + n
        for name, spec in header.items():
            if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and _naturals(spec.get("shape"))
                    and _naturals(spec.get("data_offsets")) and len(spec["data_offsets"]) == 2):
                raise EntryError(f"tensor {name!r}: malformed header entry")
            dtype, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
            if dtype not in DTYPES or len(shape) != RANKS[name]:
                raise EntryError(f"tensor {name!r}: unexpected dtype {dtype} or shape {shape}")
            if end - begin != DTYPES[dtype].itemsize * math.prod(shape):
                raise EntryError(f"tensor {name!r}: byte range {begin}..{end} does not hold {shape} {dtype}")
            tensors[name] = (dtype, shape, data_start + begin, data_start + end)
        spans = sorted((begin - data_start, end - data_start) for _, _, begin, end in tensors.values())
        if spans[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
            raise EntryError("tensor byte ranges do not tile the data")
        if data_start + spans[-1][1] != size:
            kind = "truncated" if data_start + spans[-1][1] > size else "trailing bytes"
            raise EntryError(f"{kind}: the header describes {data_start + spans[-1][1]} bytes, the file has {size}")
        # figures that do not parse, or a crc32 that is not an object: malformed (the handler below)
        tokens, _, crc = int(meta["tokens"]), float(meta["created"]), json.loads(meta["crc32"])
        if sorted(crc) != sorted(TENSORS) or not all(isinstance(v, int) for v in crc.values()):
            raise EntryError("header metadata tokens/created/crc32 malformed")
        if not _consistent({name: spec[1] for name, spec in tensors.items()}, tokens) or tensors["ids"][0] != "I64":
            shapes = ", ".join(f"{name} {tensors[name][1]}" for name in TENSORS)
            raise EntryError(f"inconsistent shapes for {tokens} tokens: {shapes}")
        return EntryFile(meta, tensors, size, crc, tokens)
    except (TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise EntryError(f"malformed header ({type(exc).__name__}: {str(exc)[:80]})") from None


def _naturals(xs) -> bool:
    """A list of non-negative ints (a header's shape or byte range)."""
    return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)


def _consistent(shapes: dict[str, list[int]], tokens: int) -> bool:
    """Shapes that fit the layers' declarations: `tokens` ids and rows on every token axis, the declared
    literal sizes, one layer count per layer kind."""
    def fits(t) -> bool:
        want = [tokens if d == TOKENS else d for d in t.dims]
        return all(not isinstance(w, int) or w == got for w, got in zip(want, shapes[t.name][1:]))

    return shapes["ids"] == [tokens] and all(len({shapes[t.name][0] for t in group}) == 1
                                             and all(fits(t) for t in group) for group in BANK_GROUPS)


def read_header(path: Path) -> EntryFile:
    """Parse an entry file's header only (no data read, no checksum)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        head += f.read(min(int.from_bytes(head, "little"), 1 << 24))  # nothing left to read when under 8 bytes
    return _parse_header(head, size)


def read_entry(path: Path, pin: bool = False) -> tuple[EntryFile, dict[str, torch.Tensor]]:
    """Read an entry file into one host buffer (pinned when `pin`) and check it: header, layout, key
    derived from the model and the ids, and every tensor's CRC-32. Returns views into the buffer."""
    with open(path, "rb") as f:  # a buffered file's readinto reads until the buffer is full or the file ends
        size = os.fstat(f.fileno()).st_size
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        view = memoryview(buf.numpy())
        if (done := f.readinto(view)) < size:
            raise EntryError(f"truncated while reading ({done} of {size} bytes)")
    entry = _parse_header(view, size)
    tensors = {}
    for name, (dtype, shape, begin, end) in entry.tensors.items():
        if (crc := zlib.crc32(view[begin:end])) != entry.crc[name]:
            raise EntryError(f"checksum mismatch in {name!r} (CRC-32 {crc:08x}, recorded {entry.crc[name]:08x})")
        raw = buf[begin:end]
        if begin % DTYPES[dtype].itemsize:  # safetensors aligns data; copy if a writer did not
            raw = raw.clone()
        tensors[name] = raw.view(DTYPES[dtype]).view(shape)
    prefix_sha = prefix_key(tensors["ids"].numpy())
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
    meta = {"format": FORMAT, "version": str(VERSION), "key": key, "model": model, "prefix_sha256": prefix_key(ids),
            "tokens": str(len(ids)), "crc32": json.dumps(crc), "created": f"{time.time():.3f}"}
    return save(tensors, metadata=meta)

