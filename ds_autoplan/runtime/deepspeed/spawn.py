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
          env: dict | None = None) -> list[tuple[int, str]]:
    """Run ``python <argv>`` on ``world`` ranks; return ``[(returncode, output)]`` per rank.
    A rank still running at the deadline is killed (returncode -9)."""
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
        if now > deadline or (first_fail is not None and now > first_fail + grace):
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
