"""Start ``world`` local CPU ranks of a Python module or script with the environment the
``deepspeed`` launcher sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), with a
timeout; when one rank fails the others get a grace period, then are killed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], world: int, timeout: float = 300.0, grace: float = 60.0,
          env: dict | None = None, prebuild: bool = True) -> list[tuple[int, str]]:
    """Run ``python <argv>`` on ``world`` ranks; return ``[(returncode, output)]`` per rank.
    A rank still running at the deadline is killed (returncode -9), but never while a torch
    extension builds (a killed build leaves a lock that hangs later runs); with ``prebuild``
    the DeepSpeed ops the ranks would JIT-build are built here first, without a deadline."""
    from ..watchdog import build_in_progress
    if prebuild:
        prebuild_ops({**os.environ, **(env or {})})
    port = free_port()
    procs, logs = [], []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **(env or {}))
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, stdout=logs[-1],
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + timeout
    first_fail = None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if first_fail is None and any(p.poll() not in (None, 0) for p in procs):
            first_fail = now
        if (now > deadline or (first_fail is not None and now > first_fail + grace)) \
                and not build_in_progress():
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    out = []
    for p, f in zip(procs, logs):
        rc = p.wait()
        f.seek(0)
        out.append((rc, f.read()))
        f.close()
    return out


def prebuild_ops(env) -> None:
    """Build DeepSpeed's CPU shared-memory comm op once, in this process, when the ranks would
    build it (``DS_AUTOPLAN_SHM=1``, see :mod:`.dist`)."""
    if env.get("DS_AUTOPLAN_SHM") == "1":
        from deepspeed.comm.torch import build_shm_op
        build_shm_op()


RESULT = "AUTOPLAN_RESULT "


def report_runs(jobs) -> None:
    """Worker side: run each job (a callable returning a JSON-able dict) and print it as one
    ``AUTOPLAN_RESULT {json}`` line; then barrier and tear the process group down."""
    import json

    import torch.distributed as dist
    try:
        for job in jobs:
            print(RESULT + json.dumps(job()), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def results(argv: list[str], world: int, **kw) -> list[dict]:
    """Launcher side: :func:`spawn` ``argv`` and return every rank's result dicts; a failed
    rank raises with the end of its output."""
    import json
    rows = []
    for r, (rc, out) in enumerate(spawn(argv, world, **kw)):
        if rc != 0:
            raise RuntimeError(f"rank {r} exited with {rc}:\n{out[-4000:]}")
        rows += [json.loads(ln[len(RESULT):]) for ln in out.splitlines() if ln.startswith(RESULT)]
    return rows
