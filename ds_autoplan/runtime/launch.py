"""The one launcher of local CPU ranks (gloo), for tests, benchmarks and the profiler.

Launcher side:

* :func:`spawn` starts ``python <argv>`` on ``world`` ranks with the environment the
  ``deepspeed`` launcher sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and returns
  every rank's exit code and output;
* :func:`results` spawns and collects the ``AUTOPLAN_RESULT {json}`` lines the ranks print;
* :func:`launch` runs a list of JSON-able cases, each naming its function (``"fn":
  "pkg.mod:func"`` or ``"path/to/file.py:func"``), in one process group (imports are paid
  once) and returns each rank's list of results.

Worker side: :func:`report_runs` prints each job's result as one ``AUTOPLAN_RESULT`` line;
``python -m ds_autoplan.runtime.launch CASES.json`` is the worker of :func:`launch`.

When one rank fails the others get ``grace`` seconds (their sockets error out), then are
killed; every rank still running at the deadline is killed -- but never while a torch
extension builds (a killed build leaves a lock that hangs every later run, see
:mod:`ds_autoplan.runtime.watchdog`).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import reaper

RESULT = "AUTOPLAN_RESULT "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world: int, port: int, extra: dict | None) -> dict:
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                **(extra or {}))


def _wait(procs, timeout: float, grace: float) -> None:
    """Wait for every process; kill the rest ``grace`` s after the first failure or at the
    deadline, unless an extension build is running then."""
    from .watchdog import build_in_progress
    deadline, first_fail = time.time() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
            first_fail = now
        if (now > deadline or (first_fail is not None and now > first_fail + grace)) \
                and not build_in_progress():
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
        time.sleep(0.05)


def spawn(argv: list[str], world: int, timeout: float = 300.0, grace: float = 60.0,
          env: dict | None = None, prebuild: bool = True) -> list[tuple[int, str]]:
    """Run ``python <argv>`` on ``world`` ranks; return ``[(returncode, output)]`` per rank.
    A rank still running at the deadline is killed (returncode -9).  With ``prebuild`` the
    DeepSpeed op the ranks would JIT-build is built here first, with no deadline."""
    if prebuild:
        prebuild_ops({**os.environ, **(env or {})})
    port = free_port()
    procs, logs = [], []
    try:
        for r in range(world):       # each rank leads a process group and dies with this one
            logs.append(tempfile.TemporaryFile(mode="w+"))
            procs.append(subprocess.Popen(reaper.rank_command(argv), env=_rank_env(r, world, port, env),
                                          stdin=subprocess.DEVNULL, stdout=logs[-1],
                                          stderr=subprocess.STDOUT, text=True))
        _wait(procs, timeout, grace)
    finally:                         # also on an exception here (Ctrl-C): no rank runs on
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            reaper.sweep(p.pid)      # what a rank started and left (SIGKILLed or not)
    out = []
    for p, f in zip(procs, logs):
        f.seek(0)
        out.append((p.returncode, f.read()))
        f.close()
    return out


def prebuild_ops(env, *, adam: bool = False) -> None:
    """Build, once and in this process, the DeepSpeed CPU ops the ranks would JIT-build: the
    shared-memory comm op when they keep it (``DS_AUTOPLAN_SHM=1``, see
    :mod:`ds_autoplan.runtime.deepspeed.dist`) and, with ``adam``, the ``fused_adam`` op that a
    config's ``"optimizer": {"type": "Adam"}`` loads and the ``cpu_adam`` op the same config loads
    under ``offload_optimizer`` (DeepSpeedCPUAdam).  A rank killed mid-build leaves a lock
    every later run hangs on, so builds happen here, outside any kill timeout."""
    from ..env import env_flag
    if env_flag("DS_AUTOPLAN_SHM", env):
        from deepspeed.comm.torch import build_shm_op
        with lock_watch("deepspeed_shm_comm"):
            build_shm_op()
    if adam:
        from deepspeed.accelerator import get_accelerator
        for op, builder in (("fused_adam", "FusedAdamBuilder"), ("cpu_adam", "CPUAdamBuilder")):
            with lock_watch(op):
                get_accelerator().create_op_builder(builder).load()


@contextlib.contextmanager
def lock_watch(op: str, after: float = 30.0):
    """Around an op's JIT build: torch waits without a word, for ever, while the op's build
    folder holds a ``lock`` file, and a build killed midway leaves it behind.  If the lock is
    still there ``after`` seconds in and no build runs (:func:`.watchdog.build_in_progress`,
    as the ranks' start-up watchdog decides it), say once on stderr which file it is."""
    from torch.utils.cpp_extension import _get_build_directory

    from .watchdog import build_in_progress
    lock = os.path.join(_get_build_directory(op, verbose=False), "lock")
    done = threading.Event()

    def warn():
        if not done.wait(after) and os.path.exists(lock) and not build_in_progress():
            print(f"ds-autoplan: DeepSpeed's {op} op build has waited {after:g} s on {lock}, "
                  "left by an interrupted build (no build is running): remove that file.",
                  file=sys.stderr, flush=True)

    watcher = threading.Thread(target=warn, daemon=True)
    watcher.start()
    try:
        yield lock
    finally:
        done.set()


def report_runs(jobs) -> None:
    """Worker side: run each job (a callable returning a JSON-able dict) and print it as one
    ``AUTOPLAN_RESULT {json}`` line; then barrier and tear the process group down."""
    import torch.distributed as dist
    try:
        for job in jobs:
            print(RESULT + json.dumps(job()), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def per_rank_results(argv: list[str], world: int, **kw) -> list[list[dict]]:
    """Launcher side: :func:`spawn` ``argv``; every rank's result dicts, per rank.  A failed
    rank raises with the end of every rank's output."""
    outs = spawn(argv, world, **kw)
    if any(rc != 0 for rc, _ in outs):
        bad = next(r for r, (rc, _) in enumerate(outs) if rc != 0)
        texts = [f"--- rank {r} (rc {rc}) ---\n{out[-4000:]}" for r, (rc, out) in enumerate(outs)]
        raise RuntimeError(f"multi-process run failed (rank {bad}):\n" + "\n".join(texts))
    return [[json.loads(ln[len(RESULT):]) for ln in out.splitlines() if ln.startswith(RESULT)]
            for _, out in outs]


def results(argv: list[str], world: int, **kw) -> list[dict]:
    """:func:`per_rank_results`, all ranks' rows in one list."""
    return [row for rows in per_rank_results(argv, world, **kw) for row in rows]


def launch(world: int, cases: list, timeout: float = 240.0, grace: float = 0.0,
           env: dict | None = None) -> list:
    """Run ``cases`` (JSON-able dicts with ``"fn": "module:func"`` or ``"file.py:func"``) on
    ``world`` ranks in one gloo process group; returns per-rank lists of the results.  A rank
    that fails ends the run (the others are killed after ``grace`` seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cases.json")
        with open(path, "w") as f:
            json.dump(cases, f)
        return per_rank_results(["-m", __name__, path], world, timeout=timeout, grace=grace,
                                env=env)


def import_fn(path: str):
    """``package.module:fn`` or ``path/to/file.py:fn`` (a file is loaded once per process)."""
    import importlib
    import importlib.util
    mod, _, name = path.rpartition(":")
    if not mod.endswith(".py"):
        return getattr(importlib.import_module(mod), name)
    key = "_dsap_cases_" + str(abs(hash(os.path.abspath(mod))))
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, mod)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return getattr(sys.modules[key], name)


def _worker(cases_path: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if os.environ.get("DSAP_DEBUG"):
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DSAP_DEBUG"]), exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    with open(cases_path) as f:
        cases = json.load(f)
    report_runs((lambda c=c: import_fn(c["fn"])(c)) for c in cases)


def _exit(code: int) -> None:
    """Leave at once (os._exit skips atexit), first ending this rank's multiprocessing
    children as atexit would (multiprocessing.util's exit function): the finalizers of
    priority >= 0, e.g. the shutdown of the Manager Megatron's dist_checkpointing writer
    starts, whose server then exits by itself and removes its pymp-* folder and listener
    socket (a terminated one leaves them in the temporary folder), then the children still
    running are stopped.  Not its finalizers of negative priority, which may wait (a queue's
    feeder thread)."""
    import multiprocessing
    from multiprocessing import util
    util._run_finalizers(0)
    for child in multiprocessing.active_children():
        child.terminate()
    from .common import trace
    trace.flush()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    import traceback
    import warnings
    warnings.filterwarnings("ignore")
    try:
        _worker(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        _exit(1)             # at once: the peers' sockets close and they error out
    _exit(0)
