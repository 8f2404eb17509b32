"""How a run looks: progress bars or JSON Lines, and every table the commands print.

The tables: the run summary, the dry-run plan, an output's provenance, a bank's report and `compare`'s;
text from files is escaped."""
from __future__ import annotations

import dataclasses
import json
import re
import time

from rich.console import Console
from rich.markup import escape as markup_escape
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.table import Column, Table
from rich.text import Text

from kevscore.engine.pipeline import Reporter
from kevscore.job.files import stdout_closed

console = Console(stderr=True)  # messages and progress; results go to stdout
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # never sent raw to a terminal (escape codes in doc ids, names)


def escape(text: str) -> str:
    """Text for rich: markup escaped, control characters shown as \\xNN (one line, no terminal codes)."""
    return markup_escape(CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def table_console(stderr: bool = False) -> Console:
    """A console for a result's table on stdout (or stderr): a terminal's width, else 80 columns (a file, a pipe)."""
    return TableConsole(stderr=stderr, width=None if Console(stderr=stderr).is_terminal else 80)


class TableConsole(Console):
    def on_broken_pipe(self) -> None:
        """The reader stopped early (`| true`): it has all it wanted, as with -o - (not rich's exit 1)."""
        self.quiet = True
        stdout_closed()


def phase_rate(task) -> float | None:
    """Rows (or documents) per second over this run's part of the phase so far. Not rich's `speed`, which
    averages its last few samples only: two batches read back together would make it thousands of times too high."""
    done, elapsed = task.completed - task.fields.get("resumed", 0), task.finished_time or task.elapsed
    return done / elapsed if task.fields.get("unit") and done > 0 and elapsed else None


class RateColumn(ProgressColumn):
    """The phase's rate, or seconds per one when slower; nothing for the bank."""

    def render(self, task) -> Text:
        if not (speed := phase_rate(task)):
            return Text("")
        unit = task.fields["unit"]
        rate = f"{speed:,.1f} {unit}s/s" if speed >= 1 else f"{1 / speed:,.1f} s/{unit}"
        return Text(rate, style="progress.data.speed")


class CountColumn(ProgressColumn):
    """Done / total, with thousands separators."""

    def render(self, task) -> Text:
        return Text(f"{int(task.completed):,}/{int(task.total or 0):,}", style="progress.download")


class EtaColumn(ProgressColumn):
    """The phase's time left at its rate so far; nothing for the bank."""

    def render(self, task) -> Text:
        speed = phase_rate(task)
        s = None if speed is None else int((task.total - task.completed) / speed)  # seconds
        left = "-:--:--" if s is None else f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
        return Text(left if task.fields.get("unit") else "", style="progress.remaining")


class RichProgress(Reporter):
    """Prefill (documents) and score (rows) bars with rates and ETAs, and the bank's use in the current wave."""

    def __init__(self, bar: Progress):
        self.bar, self.windows = bar, 0  # tasks: each phase's bar, the loading line's (`start`) until `loaded`
        self.tasks = {"start": bar.add_task("start", total=None, unit="", info="checking the input, loading the model")}

    def start(self, phase: str, total: int, done: int = 0) -> None:
        self.loaded()
        unit = "row" if phase == "score" else "doc"
        self.tasks[phase] = self.bar.add_task(phase, total=total, completed=done, resumed=done, unit=unit, info="")

    def advance(self, phase: str, n: int) -> None:
        self.bar.advance(self.tasks[phase], n)

    def loaded(self) -> None:
        """The run has started (or failed before it did): the loading line goes."""
        if (loading := self.tasks.pop("start", None)) is not None:
            self.bar.remove_task(loading)

    def event(self, name: str, **f) -> None:
        if name == "start":
            self.windows = f["windows"]
            if f["windows_done"]:
                self.bar.console.print(f"resuming: {f['windows_done']:,} of {f['windows']:,} windows "
                                       f"({f['rows_done']:,} rows) were done by an earlier run", highlight=False)
        elif name == "window" and "score" in self.tasks:
            self.bar.update(self.tasks["score"], info=f"window {f['window'] + 1}/{self.windows}")
        elif name == "wave":
            if "bank" not in self.tasks:
                self.tasks["bank"] = self.bar.add_task("bank", total=f["entry_capacity"], unit="", info="")
            self.bar.update(self.tasks["bank"], completed=f["entries"], total=f["entry_capacity"],
                            info=f"K/V {_compact(f['tokens'])}/{_compact(f['token_capacity'])}")

    def warn(self, message: str) -> None:
        self.bar.console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


class JsonProgress(Reporter):
    """--log-json: one JSON object per line on stdout per event, and a `progress` line at most every
    `every` seconds, for batch schedulers. Warnings also go to stderr."""
    every = 10.0

    def __init__(self):
        self.total, self.done, self.resumed = {}, {}, 0  # per phase: its total and how many are done; rows resumed
        self.began = self.last = time.monotonic()

    def emit(self, event: str, **fields) -> None:
        try:
            print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)
        except BrokenPipeError:  # the reader stopped (`| head -1`): the run goes on, its events unread
            stdout_closed()
            console.print("[yellow]warning:[/] stdout was closed; the run goes on without its --log-json events",
                          highlight=False)

    def rates(self) -> dict:
        rows, total = self.done.get("score", 0), self.total.get("score", 0)
        elapsed = time.monotonic() - self.began
        rate = (rows - self.resumed) / elapsed if elapsed > 0 else 0.0
        return {"rows_done": rows, "rows_total": total, "rows_per_s": round(rate, 2),
                "eta_s": round((total - rows) / rate, 1) if rate > 0 else None, "elapsed_s": round(elapsed, 2)}

    def start(self, phase: str, total: int, done: int = 0) -> None:
        self.total[phase], self.done[phase] = total, done
        if phase == "score":
            self.began, self.resumed = time.monotonic(), done

    def advance(self, phase: str, n: int) -> None:
        self.done[phase] = self.done.get(phase, 0) + n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.emit("progress", phase=phase, docs_prefilled=self.done.get("prefill", 0),
                      docs_total=self.total.get("prefill", 0), **self.rates())

    def event(self, name: str, **fields) -> None:
        self.emit(name, **fields, **(self.rates() if name in ("part", "merged") else {}))

    def warn(self, message: str) -> None:
        self.emit("warning", message=message)
        console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def ranks_table(result) -> Table:
    """A torchrun job's figures per rank, then the whole job's."""
    table = Table(title=escape(f"kevscore run · {len(result.ranks)} ranks"), caption=escape(f"output: {result.output}"))
    for name in ("rank", "GPU", "rows", "time s", "load s", "prefill + score s", "rows/s", "part"):
        table.add_column(name, justify="right")
    for s in result.ranks:  # a rank's part: none when it had no rows, reused when a rerun found it complete
        part = "reused" if s.reused else "scored" if s.rows else "none"
        table.add_row(str(s.rank), escape(s.host_rank), f"{s.rows:,}", f"{s.seconds:.2f}", f"{s.load_s:.2f}",
                      f"{s.work_s:.2f}", _per_s(s.rows * (not s.reused), s.seconds), part)
    scored = sum(s.rows for s in result.ranks if not s.reused)
    table.add_row("job", "", f"{result.rows:,}", f"{result.seconds:.2f}", "", "",
                  _per_s(scored, result.seconds), "", style="bold")
    return table


def _per_s(rows: int, seconds: float) -> str:
    """Rows scored a second, or "-" where none were scored."""
    return f"{rows / seconds:,.1f}" if rows and seconds > 0 else "-"


def rounded(figures) -> dict:
    """A dataclass's fields, floats to three decimals (--log-json's `plan` and `done` lines)."""
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in dataclasses.asdict(figures).items()}


def summary_fields(result) -> dict:
    """The run's numbers (the summary table and --log-json's `done` line)."""
    s = result.stats
    scored = s.rows - result.resumed_rows
    return {"output": str(result.output), "model": result.model, "device": result.device, **rounded(s),
            "rows_scored": scored, "rows_resumed": result.resumed_rows, "documents": result.documents,
            "windows": result.windows, "windows_resumed": result.resumed, "load_s": round(result.load_s, 3),
            "wall_s": round(result.wall_s, 3), "rows_per_s": round(scored / s.score_s, 2) if s.score_s > 0 else None,
            "rows_per_s_wall": round(scored / result.wall_s, 2) if result.wall_s > 0 else None,
            "peak_rss_bytes": result.peak_rss, "peak_gpu_bytes": result.peak_gpu,
            "already_complete": result.already_complete,
            **({"errors": str(result.errors), "set_aside": result.set_aside} if result.errors is not None else {}),
            **({"bank": rounded(result.bank)} if result.bank is not None else {}),
            **(result.labels or {})}  # label mass and predictions


class Bars(Progress):
    """rich's Progress, leaving no blank line when it stops with no bar (a run that failed before its phases
    began): on a file or pipe, rich ends its display with one."""

    def stop(self) -> None:
        if self.tasks:
            super().stop()
        else:
            self.live.stop()


def progress_bars(out: Console, disable: bool = False) -> Bars:
    """The live display, for 80 columns: phase, bar, done/total, rate, time left, and a note."""
    whole = Column(no_wrap=True)  # figures are never cut; the note folds instead
    return Bars(TextColumn("{task.description:>7}"), BarColumn(bar_width=10), CountColumn(table_column=whole),
                RateColumn(table_column=whole), EtaColumn(table_column=whole),
                TextColumn("{task.fields[info]}", table_column=Column(overflow="fold")),
                console=out, disable=disable, transient=False)


def key_value_table(title: str | None, rows: dict[str, str | None], name_style: str = "", **options) -> Table:
    """Two columns, names and values (no row for a value of None); a long value (a path, a list) folds onto the
    next line, never cut. `options`: rich's Table options (box=None: no lines)."""
    table = Table(title=escape(title) if title else None, show_header=False, **options)
    table.add_column("name", style=name_style, no_wrap=True)
    table.add_column("value", overflow="fold")
    for name, value in rows.items():
        if value is not None:
            table.add_row(name, value)
    return table


def summary_table(result) -> Table:
    s, f, b, labels = result.stats, summary_fields(result), result.bank, result.labels or {}
    rate = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    resumed = f" ({result.resumed_rows:,} from parts of an earlier run)" if result.resumed_rows else ""
    predicted = bool(labels.get("predictions"))
    rejected = f", {b.rejected:,} rejected" if b is not None and b.rejected else ""
    return key_value_table(f"kevscore run · {result.model} on {result.device}", {
        "documents": f"{result.documents:,}", "distinct prefixes": f"{s.prefixes:,}",
        "prefilled": f"{s.prefilled:,} in {_count(s.waves, 'wave')}",
        "rows": f"{s.rows:,} in {_count(s.batches, 'batch')}" + resumed,
        "windows": f"{result.windows:,}" + (f", {result.resumed:,} resumed" if result.resumed else ""),
        "prefix tokens": f"{s.prefix_tokens:,}", "branch tokens": f"{s.branch_tokens:,}",
        "load + encode": f"{result.load_s:.2f} s", "prefill time": f"{s.prefill_s:.3f} s",
        "scoring time": f"{s.score_s:.3f} s" + (f" ({s.capture_s:.2f} s capturing graphs)" if s.capture_s else ""),
        "read + write": f"{s.read_s:.2f} s + {s.write_s:.2f} s", "wall time": f"{result.wall_s:.2f} s",
        "rows/s": f"{rate(f['rows_per_s'])} scoring, {rate(f['rows_per_s_wall'])} wall",
        "peak host memory": _size(result.peak_rss),
        "peak GPU memory": None if result.peak_gpu is None else _size(result.peak_gpu),
        "out of memory": f"{_count(s.oom_retries, 'batch')} split and retried" if s.oom_retries else None,
        "set aside": None if result.errors is None else f"{result.set_aside:,} rows -> {escape(str(result.errors))}",
        "label mass": f"min {_mass(labels['label_mass_min'])}, median {_mass(labels['label_mass_median'])}"
                      if predicted else None,
        "predictions": escape(", ".join(f"{label} {n:,}" for label, n in labels["predictions"].items()))
                       if predicted else None,
        "output": escape(str(result.output)),
        "bank entries": None if b is None else (f"{b.loaded:,} loaded, {s.prefilled:,} prefilled, {b.saved:,} saved, "
                                                f"{b.evicted:,} evicted{rejected}"),
        "bank bytes": None if b is None else f"{_size(b.read_bytes)} read in {b.load_s:.3f} s, "
                                             f"{_size(b.written_bytes)} written in {b.save_s:.3f} s"})


def _compact(n: int) -> str:
    """12,345 as is; 1,048,576 as 1.05M."""
    return f"{n:,}" if n < 100_000 else f"{n / 1e6:.3g}M"


def _mass(p: float) -> str:
    return f"{p:.4f}" if p >= 1e-3 else f"{p:.2g}"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


def plan_table(plan) -> Table:
    estimated = plan.estimate_s is not None
    gpu = ("without the kernels' compiles and CUDA-graph capture at the start (seconds)"
           if plan.device.startswith("cuda") else "a GPU (--device cuda) is not estimated here")
    return key_value_table(f"kevscore run --dry-run · {plan.model} on {plan.device}", {
        "rows": f"{plan.rows:,}" + (f" ({plan.set_aside:,} set aside)" if plan.set_aside else ""),
        "documents": f"{plan.documents:,} (" + (f"{plan.bank_hits:,} loaded from the bank, " if plan.bank_hits else "")
                     + f"{plan.prefix_tokens:,} tokens to prefill)",
        "windows": f"{plan.windows:,}, {_count(plan.waves, 'wave')} (the bank holds {plan.bank_entries:,} documents)",
        "model load": f"{plan.load_s:.1f} s (with tokenizing every prompt)",
        "calibration": f"{_count(plan.calibration_docs, 'document')}, {plan.calibration_rows} rows: prefill "
                       f"{plan.prefill_tokens_per_s:,.0f} tokens/s, scoring {plan.score_rows_per_s:,.1f} rows/s"
                       if estimated else None,
        "estimate": f"about {_duration(plan.estimate_s)} on {plan.device}" if estimated else None,
        "assumes": f"the whole input runs at the calibrated rates; {gpu}" if estimated else None})


def _count(n: int, word: str) -> str:
    """'1 wave', '2,048 waves', '3 batches'."""
    return f"{n:,} {word if n == 1 else word + ('es' if word.endswith('ch') else 's')}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def provenance_table(record: dict) -> Table:
    """The record in two columns, the figures a reader checks first."""
    opts, model, plan = (record.get(part, {}) for part in ("options", "model", "plan"))

    def file(entry) -> str:
        return "-" if not entry else f"{entry['name']} (sha256 {entry['sha256'][:16]})"

    rows = {"kevscore": str(record.get("kevscore")),
            "input": file(record.get("input")), "documents": file(record.get("documents")),
            "template": file(record.get("template")) if record.get("template") else "the model's chat template",
            "model": f"{model.get('name')} (fingerprint {str(model.get('fingerprint'))[:16]})",
            "device": f"{opts.get('device')}, {record.get('dtype')}, state read "
                      f"{opts.get('state_read', opts.get('path'))}",
            "labels": ", ".join(repr(label) for label in opts.get("labels") or []),
            "rows": f"{plan.get('rows', 0):,} in {_count(plan.get('windows', 0), 'window')}",
            "options": ", ".join(f"{k} {v}" for k, v in opts.items()
                                 if k not in ("device", "dtype", "state_read", "path", "labels")),
            "job": str(record.get("job"))}
    return key_value_table(None, {name: escape(value) for name, value in rows.items()}, "bold", box=None, pad_edge=False)


def _when(t: float | None, short: bool = False) -> str:
    return time.strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def inspect_table(r: dict) -> Table:
    """Entries, least recently used first, for 80 columns: a model column only when the bank holds several."""
    tot = r["totals"]
    models = len(r["models"]) > 1
    table = Table(title="entries (least recently used first)")
    for name, justify in [("key", "left"), *([("model", "left")] if models else []), ("doc ids", "left"),
                          ("tokens", "right"), ("size", "right"), ("last used", "left"), ("status", "left")]:
        wraps = name in ("doc ids", "status")
        table.add_column(name, justify=justify, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis")
    for row in sorted(r["entries"], key=lambda e: (e.get("last_used") or 0, e["key"])):
        ids = ", ".join(row.get("doc_ids") or []) or "-"
        status = row["status"] + ("" if row["indexed"] else " (not indexed)")
        style = "" if row["status"] in ("ok", "unchecked") else "red"
        model = [escape((row.get("model") or "?")[:8])] if models else []
        table.add_row(escape(row["key"][:12]), *model, escape(ids), f"{row.get('tokens') or 0:,}", _size(row["file_bytes"]),
                      _when(row.get("last_used"), short=True), escape(status), style=style)
    table.add_row("total", *([""] if models else []), "", f"{tot['tokens']:,}", _size(tot["file_bytes"]), "", "",
                  style="bold")
    return table


def print_inspect(out: Console, r: dict, detail: bool) -> None:
    tot = r["totals"]
    out.print(f"bank {escape(r['bank'])}", highlight=False, soft_wrap=True)
    out.print(f"format {r['format']} v{r['version']} · {tot['entries']:,} entries, {_size(tot['file_bytes'])} · "
              f"{_size(r['disk']['free_bytes'])} free on disk", highlight=False)
    for fp, m in r["models"].items():
        name, dtype, backend = (escape(str(m["about"].get(k, "?"))) for k in ("name", "dtype", "backend"))
        out.print(f"model {escape(fp[:12])} · {name} · {dtype} {backend} · {m['entries']:,} entries, "
                  f"{_size(m['file_bytes'])}", highlight=False)
    temporary = [f"{len(r['temporary'])} temporary file(s) of an interrupted or running write in tmp/ (never used; the "
                 "next run removes them if their process is gone)"] if r["temporary"] else []
    for note in r["notes"] + temporary:
        out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    if detail:
        row = r["entries"][0]
        fields = ("key", "file", "model", "status", "tokens", "doc_ids", "bytes", "file_bytes", "indexed", "tensors",
                  "crc32", "ids_head")
        out.print(key_value_table(f"entry {row['key']}", {k: escape(str(row[k])) for k in fields if k in row} | {
            "created": _when(row.get("created")), "last used": _when(row.get("last_used"))}))
        return
    out.print(inspect_table(r))
    out.print(f"in all: recurrent state {_size(tot.get('recurrent', 0))}, conv {_size(tot.get('conv', 0))}, "
              f"K/V {_size(tot.get('kv', 0))} (per entry: --entry KEY or --json)", highlight=False)
    if r["verified"]:
        bad = len(r["bad_entries"])
        out.print(f"verify: {tot['entries'] - bad:,} ok, {bad:,} bad", highlight=False, style="red" if bad else "green")


def compare_table(r: dict) -> Table:
    """Per case: rows, each path's median latency (p10-p90 below), their ratio and parity; 80 columns."""
    env = r["environment"]
    where = env.get("gpu") or f"CPU, {env.get('threads')} threads"
    unit, first = (("GPU-event ms", "warm-up incl. graph capture") if r["timer"] == "cuda-events"
                   else ("wall-clock ms", "warm-up"))
    warm = ", ".join(f"{c['name']} {sum(c['warmup_s'].values()):.1f} s" for c in r["cases"])
    hf = [f"{c['name']} {c['summary']['hf_median_ms']:.1f} ms ({c['summary']['hf_over_indexed']:.1f}x indexed)"
          for c in r["cases"] if c.get("hf_ms")]
    fp32 = [f"{c['name']} {c['summary']['fp32_median_ms']:.1f} ms, {len(c['fp32_flipped']):,} of {c['rows']:,} "
            f"predictions flipped, max |dp| {_dp(c['fp32_max_abs_diff'])}" for c in r["cases"] if c.get("fp32_ms")]
    # each baseline's cases, when it ran
    ran = "".join(f"; {base}: {', '.join(cs)}" for base, cs in (("transformers naive", hf), ("fp32", fp32)) if cs)
    table = Table(title=escape(f"kevscore compare · {r['model']} · {where}"), caption_justify="left",
                  caption=f"{unit}: median, p10-p90 below; {first} (not in the latencies): {warm}{ran}")
    for name in ("case", "rows", "gathered", "indexed", "i / g", "parity"):
        words = name in ("case", "parity")
        table.add_column(name, justify="left" if words else "right", no_wrap=not words, overflow="fold")
    for c in r["cases"]:
        s = c["summary"]
        lat = {p: f"{_ms(s[p]['median_ms'])}\n{_ms(s[p]['p10_ms'])}-{_ms(s[p]['p90_ms'])}" for p in ("gathered", "indexed")}
        name = c["name"] + (f"\n+{c['prefilled_in_call']} prefilled" if c["prefilled_in_call"] else "")
        ratio = f"{s['indexed_over_gathered']:.3f}" + ("\n[yellow]noise[/]" if s.get("spread_overlap") else "")
        table.add_row(escape(name), f"{c['rows']:,}", lat["gathered"], lat["indexed"], ratio, _parity(c))
    return table


def _ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _dp(diff: float | None) -> str:
    return "not finite" if diff is None else f"{diff:.3g}"


def _parity(c: dict) -> str:
    bad = ([f"{'/'.join(c['non_finite'])} not finite"] if c.get("non_finite") else []) + (
        [f"max |dp| {c['max_abs_diff']:.3g}"] if c["max_abs_diff"] else []) + (
        [f"{c['flips']} flips"] if c["flips"] else []) + ([] if c["bank_unchanged"] else ["bank changed"])
    return "[red]" + escape(", ".join(bad)) + "[/]" if bad else "ok"
