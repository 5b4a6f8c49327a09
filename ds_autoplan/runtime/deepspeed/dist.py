"""Process-group start-up for the DeepSpeed runtime on CPU (gloo)."""
from __future__ import annotations



def init_distributed(backend: str = "gloo") -> None:
    """``deepspeed.init_distributed`` without the JIT build of DeepSpeed's CPU shared-memory
    allreduce op (minutes on a fresh machine; it only speeds up inference allreduce).  A
    runtime switch, nothing installed is edited; set DS_AUTOPLAN_SHM=1 to keep the op."""
    import deepspeed

    from ..watchdog import process_group_timeout, startup_watchdog
    from ...env import env_flag
    if not env_flag("DS_AUTOPLAN_SHM"):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    with startup_watchdog("the process-group start-up"):
        deepspeed.init_distributed(dist_backend=backend, timeout=process_group_timeout())
