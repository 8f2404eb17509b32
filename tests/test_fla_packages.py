"""Importing our FLA kernels skips flash-linear-attention's package-level imports (kernels/fla_packages.py),
and code that uses `fla` as a whole afterwards still finds all of it."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("fla")

PROBE = """
import importlib.metadata, json, sys
import kevscore.kernels.fla_ops
before = {m: m in sys.modules for m in ("fla.layers", "fla.models", "fla.modules.activations")}
import fla
from fla.ops import chunk_gla
from fla.modules import FusedRMSNormGated
print(json.dumps({"before": before, "version": fla.__version__ == importlib.metadata.version("fla-core"),
                  "whole": [fla.GatedDeltaNet.__name__, chunk_gla.__name__, FusedRMSNormGated.__name__]}))
"""


def test_our_kernels_import_without_fla_models_and_fla_stays_whole():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["before"] == {"fla.layers": False, "fla.models": False, "fla.modules.activations": False}
    assert report["version"] and report["whole"] == ["GatedDeltaNet", "chunk_gla", "FusedRMSNormGated"]
