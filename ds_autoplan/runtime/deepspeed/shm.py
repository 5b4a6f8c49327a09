"""The shared-memory files of DeepSpeed's CPU allreduce op, removed when no process uses them.

deepspeed 0.19.8's ``deepspeed_shm_comm`` op (ops/csrc/cpu/comm/shm.cpp, ``shm_initialize``)
creates one POSIX shared-memory file per rank, ``/dev/shm/deepspeed_allreduce_buffer_{uid}_
{MASTER_ADDR}_{MASTER_PORT}_{rank}`` (69 MB each on x86-64), maps it for the process's life and
never unlinks it: every CPU launch that loads the op leaves world-size x 69 MB of RAM behind
until the machine restarts (measured here: 19 GB after a day of test runs, and the next 4-rank
run was killed by the OOM killer).  A rank unlinks its own file at exit (:func:`unlink_at_exit`;
the peers have mapped it since start-up, so their mappings stay valid), and the launcher and the
test session remove the files no live process maps (:func:`sweep`: those of killed ranks)."""
from __future__ import annotations

import atexit
import contextlib
import os

SHM_DIR = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer"


def own_name(env=None) -> str | None:
    """This rank's file name, from the variables the op reads (None outside a launch)."""
    env = os.environ if env is None else env
    addr, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT"), env.get("RANK")
    if not (addr and port and rank):
        return None
    return f"{PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_at_exit(env=None) -> None:
    """Remove this rank's file when the process exits normally."""
    name = own_name(env)
    if name:
        atexit.register(_unlink, os.path.join(SHM_DIR, name))


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _mapped(prefix: str) -> set[str]:
    """Names under ``prefix`` that some live process maps (``/proc/PID/maps``)."""
    names = set()
    with contextlib.suppress(OSError):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                    names.update(line.rsplit("/", 1)[-1].split(" (deleted)")[0].strip()
                                 for line in fh if prefix in line)
            except OSError:        # gone meanwhile, or not ours to read
                continue
    return names


def leftovers(shm_dir: str = SHM_DIR, port: int | None = None) -> list[str]:
    """This user's op files in ``shm_dir`` that no live process maps (left behind); with
    ``port``, only those of the launch on that master port.  A rank's file exists unmapped for
    a moment while the op starts (created, 69 MB written, then mapped): a launch that ends
    sweeps its own files only, never those of another launch starting beside it (whose ranks
    would wait for the removed file for ever)."""
    prefix = f"{PREFIX}_{os.getuid()}_"
    try:
        ours = [n for n in os.listdir(shm_dir) if n.startswith(prefix)
                and (port is None or n.split("_")[-2] == str(port))]
    except OSError:                # no /dev/shm (not Linux)
        return []
    if not ours:
        return []
    live = _mapped(prefix)
    return [n for n in ours if n not in live]


def sweep(shm_dir: str = SHM_DIR, port: int | None = None) -> list[str]:
    """Remove :func:`leftovers` (of the launch on ``port``); the names removed."""
    gone = leftovers(shm_dir, port)
    for n in gone:
        _unlink(os.path.join(shm_dir, n))
    return gone
