"""Session set-up for the whole suite.

DeepSpeed's CPU ops (the shared-memory comm op every CPU rank loads, ``fused_adam`` for configs
that ask for Adam) are JIT-built into the torch extensions folder under a lock; a rank killed
mid-build by a test's timeout leaves the lock behind and every later run hangs on it.  So they
are built once here, at session start, before any test's clock (pytest-timeout) runs.

They are built into this environment (``<venv>/torch_extensions``, unless
``TORCH_EXTENSIONS_DIR`` says otherwise; the test's ranks inherit it): torch keys its
extension cache by op name only, and the build files name the DeepSpeed install's own source
paths, so two virtual environments sharing ``~/.cache/torch_extensions`` rebuild each other's
ops (minutes each) whenever they alternate."""
import os
import sys


def pytest_sessionstart(session):
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:     # the tests that need it skip
        return
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    from ds_autoplan.runtime.launch import prebuild_ops
    prebuild_ops({**os.environ, "DS_AUTOPLAN_SHM": "1"}, adam=True)
