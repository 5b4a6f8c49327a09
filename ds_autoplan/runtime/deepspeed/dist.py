"""Process-group start-up for the DeepSpeed runtime on CPU (gloo)."""
from __future__ import annotations

import os


def init_distributed(backend: str = "gloo") -> None:
    """``deepspeed.init_distributed`` without the JIT build of DeepSpeed's CPU shared-memory
    allreduce op (minutes on a fresh machine; it only speeds up inference allreduce).  A
    runtime switch, nothing installed is edited; set DS_AUTOPLAN_SHM=1 to keep the op."""
    import deepspeed

    from ..watchdog import startup_watchdog
    if os.environ.get("DS_AUTOPLAN_SHM") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    with startup_watchdog("the process-group start-up"):
        deepspeed.init_distributed(dist_backend=backend)
