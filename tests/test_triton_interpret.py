"""Our Triton kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a subprocess so the
setting applies before the kernels are defined), against the torch ops: CI checks their arithmetic."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
HERE = Path(__file__).parent / "interpret"


@pytest.mark.parametrize("script", ["check_branch_conv.py", "check_branch_attn.py", "check_elementwise.py",
                                    "check_gate.py", "check_branch_wy.py", "check_wy_fp32.py", "check_prefill_wy.py",
                                    "check_swiglu_gemm.py"])
def test_kernel_in_the_interpreter(script):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "max" in res.stdout
