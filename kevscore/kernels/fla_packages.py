"""flash-linear-attention's kernel modules imported without its package-level imports.

`fla`'s `__init__` imports every layer and model (and transformers), `fla.ops`' every op, `fla.ops.utils`'
every utility kernel, `fla.modules`' every module and `fla.ops.gated_delta_rule`'s every form of the rule:
most of the seconds `import fla` takes. These packages are registered unexecuted, so importing one kernel
module runs that module and its own imports only; each package runs its `__init__` the first time code asks
it for a name it does not have yet, so code that uses `fla` as a whole still finds all of it."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from types import ModuleType

PACKAGES = ("fla", "fla.ops", "fla.ops.utils", "fla.modules", "fla.ops.gated_delta_rule")


def _unexecuted(name: str) -> ModuleType:
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)  # __path__ and __spec__ set, the body not run

    def complete(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        del module.__getattr__
        spec.loader.exec_module(module)
        return getattr(module, attr)

    module.__getattr__ = complete
    return module


def defer_package_inits() -> None:
    """Register fla's packages unexecuted, unless fla is already imported (then there is nothing to save)."""
    if "fla" in sys.modules or importlib.util.find_spec("fla") is None:
        return
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:  # not an installed release: import it as it is
        return
    for name in PACKAGES:
        sys.modules[name] = module = _unexecuted(name)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    # fla.utils reads the version from its package at import
    sys.modules["fla"].__version__ = version
