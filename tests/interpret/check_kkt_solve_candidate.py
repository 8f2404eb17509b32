"""Run under TRITON_INTERPRET=1: benchmarks/kkt_solve_candidate.py's kernel (a candidate for FLA's kkt + solve)
against the torch reference on the CPU."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kkt_solve_candidate  # noqa: E402

worst = kkt_solve_candidate.check()
print(f"max relative error {worst:.3g}")
assert worst < 1e-5, worst
