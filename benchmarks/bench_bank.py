"""Loading bank entries from disk against prefilling the same documents. Prints a table and writes JSON.

    python benchmarks/bench_bank.py --model kev-4b --docs 32 --json benchmarks/results/bank-kev-4b-h200.json
    python benchmarks/bench_bank.py --model demo --device cpu --docs 16

Workload (defaults): 16 documents of 1024 random tokens, all in one bank wave. Measured, as medians over
--reps repetitions (GPU: CUDA events around each phase; CPU: perf_counter):
- prefill: `Engine.prefill_wave` without a store (what a cold run spends per wave);
- save: copying the prefilled entries out of the bank, serializing, writing, fsync, rename, index commit;
- load, page cache dropped: `BankStore.load` of every entry into freshly allocated slots after
  posix_fadvise(DONTNEED) on each entry file; the resident fraction of the files is measured with
  mincore() before each such load and reported (the drop is advisory; it cannot reach a host-side cache
  below a virtual disk);
- load, page cache warm: the same, the files read just before (repeated reads);
- read + verify only: reading and checking the files on the host, without the copy into the bank.
The first load of the process is reported apart: it also pays the pinned host buffers' allocation.
After the loads, the bank's used region is compared with its state right after prefill (bit-exact).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kevscore.model.prompt import Encoded


def timed(fn, device: torch.device) -> float:
    """Seconds for fn(): CUDA events on the GPU (the phase's host work included), perf_counter on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def resident_fraction(paths: list[Path]) -> float | None:
    """The fraction of the files' pages in the OS page cache (mincore over a fresh mapping), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec.raw[:pages])
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def filesystem(path: Path) -> str:
    """The filesystem type of the mount holding `path` (from /proc/mounts), e.g. ext4, xfs, tmpfs."""
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    except OSError:
        pass
    return kind


def workload(vocab: int, docs: int, doc_len: int, seed: int) -> Encoded:
    gen = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(100, min(vocab, 1200), (doc_len,), generator=gen).tolist() for _ in range(docs)]
    return Encoded(prefixes, [], [], [], [])


def environment(device: torch.device) -> dict:
    import importlib.metadata as md
    import platform

    versions = {}
    for pkg in ("torch", "safetensors", "triton", "fla-core"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "versions": versions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="demo, kev-0.8b, kev-4b or a checkpoint directory")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="prefill group size (Engine default)")
    ap.add_argument("--workers", type=int, default=None, help="store reader/writer threads (default: up to 8)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="bank directory to create (default: a fresh one under the current directory, removed "
                         "afterwards; avoid tmpfs, where 'disk' is memory)")
    ap.add_argument("--keep", action="store_true", help="keep the bank directory")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from kevscore.engine.backend import build_runner, resolve_device
    from kevscore.engine.bank_entry import model_fingerprint, read_entry, read_header
    from kevscore.engine.bank_store import BankStore
    from kevscore.engine.pipeline import Engine, Scores
    from kevscore.model.checkpoint import load_checkpoint

    device = resolve_device(args.device)
    ckpt = load_checkpoint(args.model, device)
    enc = workload(ckpt.config.vocab_size, args.docs, args.doc_len, seed=0)
    wave = list(range(args.docs))
    runner = build_runner(ckpt, device, [len(p) for p in enc.prefixes], None, eager=True)
    bank = runner.bank
    engine = Engine(runner, prefill_tokens=args.prefill_tokens)
    stats = Scores.empty(0).stats

    engine.prefill_wave(enc, wave, stats)  # warm-up (GPU: Triton autotuning and compilation)
    prefill = [timed(lambda: engine.prefill_wave(enc, wave, stats), device) for _ in range(args.reps)]
    n, used = bank.used_entries, bank.used_tokens
    reference = [bank.state[:, :n].clone(), bank.conv[:, :n].clone(), bank.kv[:, :, :used].clone()]
    slot_of = {d: d for d in wave}  # prefill_wave allocates slots in wave order

    root = args.dir or Path(tempfile.mkdtemp(prefix=".bench-bank-", dir="."))
    if args.dir is not None and root.exists():
        shutil.rmtree(root)
    backend = runner.model.ops.__name__.rsplit(".", 1)[-1]  # its NAME (kevscore.model.layers.ops.Ops)
    t0 = time.perf_counter()
    fingerprint = model_fingerprint(ckpt, bank.conv.dtype, backend)
    fingerprint_s = time.perf_counter() - t0
    try:
        with BankStore(root, fingerprint, workers=args.workers) as store:
            fs = filesystem(root)
            save = timed(lambda: store.save(bank, enc.prefixes, wave, slot_of), device)
            files = sorted(root.glob("entries/*/*.safetensors"))
            assert len(files) == args.docs, f"{len(files)} entry files for {args.docs} documents"
            file_bytes = sum(f.stat().st_size for f in files)
            components = read_header(files[0]).component_bytes()

            def load() -> None:
                bank.reset()
                for d in wave:
                    bank.alloc(len(enc.prefixes[d]))
                bank.publish()
                got = store.load(bank, enc.prefixes, wave, slot_of)
                assert len(got) == args.docs, f"loaded {len(got)} of {args.docs}"

            def dropped_load() -> tuple[float, float | None]:
                drop_cache(files)
                before = resident_fraction(files)
                return timed(load, device), before

            first, first_resident = dropped_load()  # pays pinned host buffer allocation (GPU)
            cold = [dropped_load() for _ in range(args.reps)]
            identical = all(torch.equal(a, b) for a, b in zip(
                reference, [bank.state[:, :n], bank.conv[:, :n], bank.kv[:, :, :used]]))
            load()
            warm_resident = resident_fraction(files)
            warm = [timed(load, device) for _ in range(args.reps)]
            identical = identical and all(torch.equal(a, b) for a, b in zip(
                reference, [bank.state[:, :n], bank.conv[:, :n], bank.kv[:, :, :used]]))

            def read_only() -> None:
                for _ in store._pipelined(lambda f: read_entry(f, pin=device.type == "cuda"), [(f,) for f in files]):
                    pass

            host = [timed(read_only, device) for _ in range(args.reps)]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    med = {"prefill": statistics.median(prefill), "save": save, "load_first": first,
           "load_cold": statistics.median(t for t, _ in cold), "load_warm": statistics.median(warm),
           "read_verify_warm": statistics.median(host)}
    report = {
        "workload": {"model": args.model, "device": str(device), "docs": args.docs, "doc_len": args.doc_len,
                     "reps": args.reps, "prefill_tokens": args.prefill_tokens, "workers": store.workers},
        "environment": environment(device) | {"bank_dir_fs": fs},
        "entry_bytes": file_bytes / args.docs, "entry_components": components, "total_bytes": file_bytes,
        "fingerprint_s": fingerprint_s,
        "samples_s": {"prefill": prefill, "load_cold": [t for t, _ in cold], "load_warm": warm,
                      "read_verify_warm": host},
        "median_s": med, "gb_per_s": {k: file_bytes / v / 1e9 for k, v in med.items() if k != "prefill"},
        "load_speedup_over_prefill": {k: med["prefill"] / med[k] for k in ("load_first", "load_cold", "load_warm")},
        "resident_before": {"load_first": first_resident, "load_cold": [r for _, r in cold],
                            "load_warm": warm_resident},
        "bank_identical_after_load": identical,
    }
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def print_table(r: dict) -> None:
    w, c = r["workload"], r["entry_components"]
    mb = 1e6
    print(f"\n{r['environment']['device']} | {w['model']} on {w['device']} | {w['docs']} docs x {w['doc_len']} tokens "
          f"| entry {r['entry_bytes'] / mb:.1f} MB (recurrent {c['recurrent'] / mb:.1f}, conv {c['conv'] / mb:.2f}, "
          f"K/V {c['kv'] / mb:.1f}) | {r['total_bytes'] / mb:.0f} MB in all | bank on {r['environment']['bank_dir_fs']}"
          f" | {w['workers']} store threads")
    print(f"{'phase':<34}{'median ms':>11}{'ms/doc':>9}{'GB/s':>8}{'x prefill':>11}")
    rows = [("prefill (no bank)", "prefill"), ("save: copy out, write, fsync, commit", "save"),
            ("load #1 (incl. buffer allocation)", "load_first"), ("load, page cache dropped", "load_cold"),
            ("load, page cache warm", "load_warm"), ("read + verify only, warm", "read_verify_warm")]
    for label, key in rows:
        s = r["median_s"][key]
        gbs = f"{r['gb_per_s'][key]:.2f}" if key in r["gb_per_s"] else "-"
        speed = f"{r['median_s']['prefill'] / s:.2f}x" if key.startswith("load") else "-"
        print(f"{label:<34}{1000 * s:>11.1f}{1000 * s / w['docs']:>9.2f}{gbs:>8}{speed:>11}")
    res = r["resident_before"]
    print(f"page cache before loads (mincore): #1 {_pct(res['load_first'])}, dropped "
          f"{', '.join(_pct(x) for x in res['load_cold'])}, warm {_pct(res['load_warm'])}")
    print(f"bank identical to prefill after loads: {r['bank_identical_after_load']} | model fingerprint "
          f"{r['fingerprint_s']:.2f} s")


if __name__ == "__main__":
    main()
