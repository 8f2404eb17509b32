"""What an output records about the job that made it: its digest, its provenance, what changed.

The job's digest (a rerun of the same job is "already complete") is taken of its identity (what its results
depend on); its provenance is what `kevscore info` prints; what changed between two jobs is said in words."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kevscore.durable import file_sha256
from kevscore.engine.plan import Windows
from kevscore.errors import KevscoreError, first_line
from kevscore.job.files import Inputs, Source, file_format
from kevscore.job.options import RunOptions, carries

JOB_KEY = b"kevscore.job"
PROVENANCE_KEY = b"kevscore.provenance"  # how the output was made: version, inputs, model, options (`kevscore info`)
# how `differences` names an option that is not simply --NAME (state_read: --state-read)
OPTION_FLAGS = {"shard": "shard (rank, world)", "ranks": "ranks (--gpus, torchrun)", "carry": "--carry/--no-carry",
                "rename": "the column options (--question-column, ...)"}


def job_digest(identity: dict) -> str:
    """The digest naming a job in its parts' and its output's Parquet metadata."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def output_job(output: Path) -> str | None:
    """The job digest a merged output records (None: not a kevscore output, or unreadable)."""
    try:
        job = (pq.read_schema(output).metadata or {}).get(JOB_KEY)
    except (OSError, pa.ArrowException):
        return None
    return job.decode("ascii", "replace") if job else None


def provenance(identity: dict) -> dict:
    """What an output records of how it was made: the job's identity (inputs and their SHA-256s, template,
    model and its fingerprint, options, plan), kevscore's version and the model's dtype. No time: the same
    job writes the same bytes, so a resumed run's output equals an uninterrupted one's."""
    from kevscore import __version__

    return {"kevscore": __version__, "dtype": identity["options"]["dtype"], "job": job_digest(identity), **identity}


def output_provenance(output: Path) -> dict:
    """The provenance a kevscore Parquet output records (a KevscoreError for any other file)."""
    if (fmt := file_format(output)) != "parquet":
        raise KevscoreError(f"{output}: a {fmt} file; only Parquet outputs record how they were made")
    try:
        text = (pq.read_schema(output).metadata or {})[PROVENANCE_KEY]
    except KeyError:
        raise KevscoreError(f"{output}: records no provenance (not written by kevscore run, or not as Parquet)") from None
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise KevscoreError(f"{output}: not a readable Parquet file ({first_line(exc)})") from exc
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not all(isinstance(record.get(k, {}), dict) for k in ("options", "model", "plan")):
        raise KevscoreError(f"{output}: its {PROVENANCE_KEY.decode()} record is not one kevscore writes")
    plan, labels = record.get("plan", {}), record.get("options", {}).get("labels")
    if damaged := [name for name in ("input", "documents", "template") if record.get(name) and not (isinstance(
            entry := record[name], dict) and all(isinstance(entry.get(k), str) for k in ("name", "sha256")))] + [
            f"plan {k}" for k in ("rows", "windows") if not isinstance(plan.get(k, 0), int)] + (
            ["labels"] if labels is not None and not isinstance(labels, list) else []):
        raise KevscoreError(f"{output}: its {PROVENANCE_KEY.decode()} record is damaged ({', '.join(damaged)})")
    return record


def differences(old: dict, new: dict) -> list[str]:
    """What changed between two job identities, in words."""
    out = []
    for name in ("input", "documents", "template"):
        was, now = old.get(name), new.get(name)
        if was != now and was and now and was.get("name") == now.get("name"):
            out.append(f"{name} {now['name']} changed (SHA-256 {was['sha256'][:12]} -> {now['sha256'][:12]})")
        elif was != now:
            out.append(f"{name} {(was or {}).get('name', 'none')} -> {(now or {}).get('name', 'none')}")
    if old.get("model") != new.get("model"):
        was, now = old.get("model") or {}, new.get("model") or {}
        out.append(f"model {was.get('name')} ({str(was.get('fingerprint'))[:12]}) -> "
                   f"{now.get('name')} ({str(now.get('fingerprint'))[:12]})")
    was, now = old.get("options") or {}, new.get("options") or {}
    out += [f"{OPTION_FLAGS.get(key, '--' + key.replace('_', '-'))} {was.get(key)} -> {now.get(key)}"
            for key in sorted(set(was) | set(now)) if was.get(key) != now.get(key)]
    if not out and old.get("plan") != new.get("plan"):
        out.append("the window plan")
    return out or ["the parts' format"]


def job_identity(opts: RunOptions, inputs: Inputs, model: str, fingerprint, device: str, windows: Windows,
                 ranks: int = 1) -> dict:
    """What a job's results depend on; a resumed run (on any number of processes) must match it exactly.
    `fingerprint`: the model's (engine.bank_entry.Fingerprint), whose dtype (bfloat16, float32) is the job's:
    `--dtype auto` is the job of the dtype it picks."""
    def file(path):
        return None if path is None else {"name": Path(path).name, "sha256": file_sha256(Path(path))}

    def source(src: Source | None):
        if src is None or len(src.files) == 1:
            return file(src.files[0] if src else None)
        if not src.files:  # a URI: its staged copy stands for it
            return {"name": src.given, "sha256": file_sha256(src.path)}
        listing = "\n".join(f"{f} {file_sha256(f)}" for f in src.files)
        return {"name": src.given, "sha256": hashlib.sha256(listing.encode()).hexdigest()}

    return {
        "input": source(inputs.questions), "documents": source(inputs.documents), "template": file(opts.template),
        "model": {"name": model, "fingerprint": fingerprint.digest},
        "options": {"device": device, "dtype": fingerprint.about["dtype"], "state_read": opts.state_read,
                    "labels": list(opts.labels), "batch_rows": opts.batch_rows,
                    "bank_capacity": opts.bank_capacity, "eager": opts.eager, "batch_invariant": opts.batch_invariant,
                    "window": opts.window, "shard": list(opts.shard) if opts.shard else None, "ranks": ranks,
                    "skip_invalid": opts.skip_invalid, "limit": opts.limit, "carry": carries(opts, ranks),
                    "rename": {k: v for k, v in sorted(opts.rename.items()) if k != v}},
        "plan": {"windows": len(windows), "rows": int(windows.rows.sum()), "digest": windows.digest()}}
