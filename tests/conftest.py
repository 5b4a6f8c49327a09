"""Session set-up for the whole suite.

DeepSpeed's CPU ops (the shared-memory comm op every CPU rank loads, ``fused_adam`` for configs
that ask for Adam) are JIT-built into the torch extensions folder under a lock; a rank killed
mid-build by a test's timeout leaves the lock behind and every later run hangs on it.  So they
are built once here, at session start, before any test's clock (pytest-timeout) runs.

They are built into this environment (``<venv>/torch_extensions``, unless
``TORCH_EXTENSIONS_DIR`` says otherwise; the test's ranks inherit it): torch keys its
extension cache by op name only, and the build files name the DeepSpeed install's own source
paths, so two virtual environments sharing ``~/.cache/torch_extensions`` rebuild each other's
ops (minutes each) whenever they alternate.

DeepSpeed's op loader asks py-cpuinfo for the build flags each time it loads an op (seconds
per call: a fresh Python that times the clock), in every rank of every launch.  The answer is
asked once here and given to this process and to every process a test starts
(tests/ranksite, first on their PYTHONPATH); see tests/ranksite/cached_cpuinfo.py.

The session has a temporary folder of its own, the TMPDIR of this process and of every process
a test starts, removed at the end: what they leave in a temporary folder (multiprocessing's
pymp-* folders of a killed Manager server, torchrun's torchelastic_* logs) does not stay in
/tmp.  pytest's own tmp_path folders stay where pytest keeps them (its last 3 sessions)."""
import os
import shutil
import sys
import tempfile

RANKSITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranksite")


def _session_tmp(config) -> str:
    """The session's temporary folder, made TMPDIR here and for every process started."""
    config._tmp_path_factory.getbasetemp()      # pytest's, fixed before TMPDIR moves
    folder = tempfile.mkdtemp(prefix="ds-autoplan-tests-")
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    return folder


def _cache_cpuinfo(folder: str) -> None:
    """py-cpuinfo's answer in a session file, named by $DS_AUTOPLAN_TEST_CPUINFO."""
    try:
        import cpuinfo
    except ImportError:
        return
    path = os.path.join(folder, "cpuinfo.json")
    with open(path, "w") as f:
        f.write(cpuinfo.get_cpu_info_json())
    os.environ["DS_AUTOPLAN_TEST_CPUINFO"] = path
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (RANKSITE, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, RANKSITE)
    import cached_cpuinfo
    cached_cpuinfo.install()


def pytest_sessionstart(session):
    import importlib.util
    session.config._ds_autoplan_tmp = _session_tmp(session.config)
    if importlib.util.find_spec("deepspeed") is None:     # the tests that need it skip
        return
    _cache_cpuinfo(session.config._ds_autoplan_tmp)
    from ds_autoplan.runtime.deepspeed.shm import sweep
    sweep()      # ... and by earlier sessions (each is RAM until removed)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    from ds_autoplan.runtime.launch import prebuild_ops
    prebuild_ops({**os.environ, "DS_AUTOPLAN_SHM": "1"}, adam=True)


def pytest_sessionfinish(session):
    from ds_autoplan.runtime.deepspeed.shm import sweep
    sweep()      # DeepSpeed's CPU allreduce files left by ranks the tests killed
    folder = getattr(session.config, "_ds_autoplan_tmp", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
