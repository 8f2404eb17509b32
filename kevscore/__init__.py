"""kevscore: score many questions against many documents with Kev (Qwen3.5-architecture) models.

`import kevscore` stays light (no torch): `Scorer` (kevscore.api) is imported on first use."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kevscore.errors import KevscoreError, KevscoreFailure

if TYPE_CHECKING:
    from kevscore.api import Scorer
    from kevscore.job.run import RunResult

__version__ = "0.1.0"
__all__ = ["KevscoreError", "KevscoreFailure", "RunResult", "Scorer", "__version__"]
_LAZY = {"Scorer": "kevscore.api", "RunResult": "kevscore.job.run"}  # name -> the module that defines it


def __getattr__(name: str) -> Any:
    """The API's names, imported when first asked for (they import torch)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'kevscore' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
