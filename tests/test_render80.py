"""Every table, summary and progress display rendered at 80 columns, with large figures: nothing is cut
(no truncation mark) and no line is wider than 80."""
from __future__ import annotations

import io
import time
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from kevscore.display import (
    EtaColumn,
    RateColumn,
    RichProgress,
    compare_table,
    inspect_table,
    plan_table,
    print_inspect,
    progress_bars,
    ranks_table,
    summary_table,
)
from kevscore.engine.bank_store import BankStats
from kevscore.engine.pipeline import RunStats
from kevscore.job.distributed import DistributedResult, RankStatus
from kevscore.job.dryrun import Plan
from kevscore.job.run import RunResult

WIDTH = 80


def console() -> Console:
    return Console(width=WIDTH, file=io.StringIO(), record=True, color_system=None, legacy_windows=False)


def rendered(*things) -> str:
    out = console()
    for thing in things:
        out.print(thing)
    return out.export_text()


def check(text: str, *figures: str) -> None:
    assert "…" not in text and "..." not in text, text
    assert all(len(line) <= WIDTH for line in text.splitlines()), text
    flat = " ".join(text.replace("│", " ").split())
    for figure in figures:
        assert figure in flat, (figure, text)


def test_run_summary() -> None:
    stats = RunStats(rows=123_456_789, prefixes=9_876_543, prefix_tokens=12_345_678_901, branch_tokens=987_654_321,
                     prefilled=9_876_543, waves=12_345, batches=2_345_678, prefill_s=123_456.789, score_s=98_765.4,
                     oom_retries=12, read_s=1234.5, write_s=2345.6)
    result = RunResult(Path("/data/some/long/directory/name/for/the/scores/questions-2026-12-01.scores.parquet"),
                       stats, 9_876_543, "cuda:0", "/models/Qwen3.5-4B-Instruct-checkpoint", 123.4,
                       bank=BankStats(loaded=1_234_567, saved=8_641_976, read_bytes=123_456_789_012,
                                      written_bytes=987_654_321_098, load_s=1234.5, save_s=2345.6, evicted=99,
                                      rejected=3),
                       errors=Path("/data/some/long/directory/name/questions.errors.parquet"), set_aside=1_234,
                       windows=9_646, resumed=1_234, resumed_rows=12_345_678, wall_s=234_567.8,
                       peak_rss=12_345_678_901, peak_gpu=123_456_789_012,
                       labels={"label_mass_min": 1.2e-9, "label_mass_median": 0.9876, "low_mass_rows": 0,
                               "predictions": {"Yes": 61_728_394, "No": 61_728_395}})
    check(rendered(summary_table(result)), "123,456,789 in 2,345,678 batches", "12,345,678,901",
          "Yes 61,728,394, No 61,728,395", "min 1.2e-09, median 0.9876")


def test_progress_bars() -> None:
    out = console()
    with progress_bars(out) as bar:
        display = RichProgress(bar)
        display.event("start", windows=9_646, windows_done=1_234, rows_done=12_345_678)
        display.start("prefill", 9_876_543, 1_234_567)
        display.start("score", 123_456_789, 12_345_678)
        display.event("window", window=9_644)
        display.event("wave", entries=1_023, entry_capacity=1_024, tokens=1_048_000, token_capacity=1_048_576)
        for _ in range(3):
            time.sleep(0.05)
            display.advance("prefill", 1)
            display.advance("score", 64)
        out.print(bar.get_renderable())
    check(out.export_text(), "1,234,570/9,876,543", "12,345,870/123,456,789", "window 9645/9646",
          "1,023/1,024", "K/V 1.05M/1.05M", "resuming: 1,234 of 9,646 windows (12,345,678 rows)")


def test_rate_below_one_per_second_is_seconds_per_one() -> None:
    def task(done: int, seconds: float, unit: str = "doc") -> SimpleNamespace:
        return SimpleNamespace(fields={"unit": unit}, completed=done, finished_time=None, elapsed=seconds)

    assert str(RateColumn().render(task(1, 4.0))) == "4.0 s/doc"
    assert str(RateColumn().render(task(12_345, 10.0, "row"))) == "1,234.5 rows/s"
    assert str(RateColumn().render(task(0, 4.0))) == ""


def test_a_phases_rate_is_its_rows_over_its_time() -> None:
    """Two batches read back together do not make the rate absurd (rich's own `speed` would), an earlier run's
    rows do not count, and the time left follows the same rate."""
    clock = [0.0]
    bar = progress_bars(console())
    bar.get_time = lambda: clock[0]
    display = RichProgress(bar)
    display.start("score", 1_400, 1_000)  # 1,000 rows done by an earlier run
    clock[0] = 1.0
    display.advance("score", 128)
    clock[0] = 1.0005
    display.advance("score", 72)
    task = bar.tasks[-1]
    assert task.speed > 100_000  # rich's: the last 72 rows over half a millisecond
    assert str(RateColumn().render(task)) == "199.9 rows/s"
    assert str(EtaColumn().render(task)) == "0:00:01"
    clock[0] = 3.0
    display.advance("score", 200)  # done: the rate stays the phase's, not decaying as the clock goes on
    clock[0] = 60.0
    assert (str(RateColumn().render(task)), str(EtaColumn().render(task))) == ("133.3 rows/s", "0:00:00")


def bank_report(models: int) -> dict:
    fps = [f"{m:064x}" for m in range(1, models + 1)]
    entries = [{"key": f"{k:064x}", "model": fps[k % models], "doc_ids": [f"document-{k}-with-a-long-id"] * 2,
                "tokens": 123_456, "bytes": {"recurrent": 53_000_000, "conv": 1_000_000, "kv": 4_000_000_000},
                "file_bytes": 4_054_000_000, "indexed": k % 3 != 0, "last_used": 1.7e9 + k,
                "status": "ok" if k % 2 else "corrupt: CRC-32 of kv is 1234abcd, expected 5678ef01"}
               for k in range(6)]
    return {"bank": "/data/banks/kevbank-shared-by-several-jobs", "format": "kevscore-bank", "version": 1,
            "models": {fp: {"about": {"name": "Qwen3.5-4B", "dtype": "bfloat16", "backend": "triton_ops"},
                            "entries": 3, "file_bytes": 12_162_000_000} for fp in fps},
            "entries": entries, "totals": {"entries": 6, "file_bytes": 24_324_000_000, "tokens": 740_736,
                                           "recurrent": 318_000_000, "conv": 6_000_000, "kv": 24_000_000_000},
            "disk": {"free_bytes": 1_234_567_890_123}, "verified": True, "bad_entries": ["x"] * 3, "notes": [],
            "temporary": []}


def test_bank_inspect_tables() -> None:
    for models in (1, 2):
        report = bank_report(models)
        out = console()
        print_inspect(out, report, detail=False)
        text = out.export_text()
        check(text, "123,456", "4.1 GB", "740,736", "24.3 GB", "not indexed", "K/V 24.0 GB")
        header = rendered(inspect_table(report)).split("┡")[0]
        assert ("model" in header) == (models > 1)


def compare_report() -> dict:
    lat = {"median_ms": 12_345.67, "p10_ms": 11_234.56, "p90_ms": 13_456.78, "rows_per_s": 12_345.6}
    case = {"name": "long-branch", "rows": 12_288, "prefilled_in_call": 1_024, "max_abs_diff": 1.2345e-3, "flips": 17,
            "bank_unchanged": False, "warmup_s": {"gathered": 123.4, "indexed": 234.5}, "hf_ms": [1.0],
            "fp32_ms": [2.0], "fp32_max_abs_diff": 0.01234, "fp32_flipped": [3] * 1_234,
            "summary": {"gathered": lat, "indexed": lat, "indexed_over_gathered": 1.234, "spread_overlap": True,
                        "hf_median_ms": 123_456.7, "hf_over_indexed": 10.0, "fp32_median_ms": 23_456.7,
                        "fp32_over_indexed": 1.9}}
    return {"model": "/models/Qwen3.5-4B-Instruct", "timer": "cuda-events",
            "environment": {"gpu": "NVIDIA H200 NVL 141GB HBM3e"}, "cases": [case] * 7}


def test_compare_table() -> None:
    check(rendered(compare_table(compare_report())), "12,288", "12,346", "11,235-13,457", "1.234",
          "0.00123", "17", "noise", "1,234 of 12,288 predictions flipped", "0.0123")


def test_dry_run_plan() -> None:
    plan = Plan("/models/Qwen3.5-4B-Instruct", "cuda:0", 123_456_789, 1_234, 9_876_543, 12_345_678_901, 9_646,
                12_345, 1_024, 123.4, 4, 64, 12_345.6, 1_234.5, 234_567.8, 8_765_432)
    check(rendered(plan_table(plan)), "123,456,789 (1,234 set aside)", "8,765,432 loaded from the bank, 12,345,678,901",
          "9,646, 12,345 waves",
          "about 65.2 h", "compiles")


def test_ranks_table() -> None:
    """A rank with no rows has no part, a reused part no rate; no "nan" where nothing was scored."""
    ranks = [RankStatus(0, 0, 1.5, host_rank="0 of node 0"), RankStatus(1, 1_234, 2.0, True, host_rank="1 of node 0"),
             RankStatus(2, 2_000, 4.0, host_rank="0 of node 1")]
    text = rendered(ranks_table(DistributedResult(Path("out.parquet"), ranks, 5.0, 3_234)))
    check(text, "0 0 of node 0 0 1.50 0.00 0.00 - none", "1 1 of node 0 1,234 2.00 0.00 0.00 - reused",
          "2 0 of node 1 2,000 4.00 0.00 0.00 500.0 scored", "job 3,234 5.00 400.0", "output: out.parquet")
    assert "nan" not in text
    reran = [RankStatus(r, 1_000, 0.5, True) for r in range(2)]  # an output already whole: nothing scored
    check(rendered(ranks_table(DistributedResult(Path("out.parquet"), reran, 0.6, 2_000))), "job 2,000 0.60 -",
          "output: out.parquet")
