"""No process a rank started outlives the rank, even when the rank is SIGKILLed (docs/
reliability.md, "Ranks leave no processes behind").

A killed process's children are re-parented to init and keep running: a ``multiprocessing``
server (Megatron's dist_checkpointing starts a spawn ``Manager``), data-loader workers, a
compile pool -- each holding host (and device) memory until the node reboots.  Two ways to end
them, both by process group (children stay in their parent's group unless they leave it):

* a launcher that starts a rank in a process group of its own sweeps the group once the rank
  has ended (:func:`sweep`): ``runtime.launch.spawn`` (tests, benchmarks, the profiler) and
  the forked cases of the test harness; torchrun does the same for its workers (``killpg``);
* a rank started by a launcher that does not (DeepSpeed's per-node launcher, under
  ``deepspeed --autoplan`` and ``ds-autoplan launch``) calls :func:`die_with_me` first: it
  becomes the leader of a new process group and forks a small watcher that kills the group
  the moment the rank dies (``PR_SET_PDEATHSIG``), whatever ended it; and the rank itself is
  killed when its launcher dies (``ds_autoplan.runtime.launch.spawn`` starts its ranks so,
  :func:`rank_command`: a test session killed by a timeout leaves no rank training).
"""
from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def sweep(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal every process left in process group ``pgid`` (nothing if none is left)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _prctl(option: int, arg: int) -> bool:
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_me(parent: int | None = None) -> bool:
    """Make this process's descendants end when it ends, however it ends: it becomes the leader
    of a new process group, and a forked watcher process (in a group of its own) kills that
    group when this process dies.  With ``parent`` (this process's parent's pid, its launcher)
    this process is also killed when the launcher dies.  Not done (False) where this process
    already leads its group (its launcher sweeps it: torchrun), off Linux, or when stdin is a
    terminal (a background group cannot read it: ``pdb`` in a rank would stop)."""
    if not sys.platform.startswith("linux") or os.getpgid(0) == os.getpid():
        return False
    try:
        if sys.stdin is not None and sys.stdin.isatty():
            return False
    except ValueError:             # stdin closed
        pass
    me = os.getpid()
    try:
        os.setpgid(0, 0)
    except OSError:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        _watch(me)
    if parent is not None and die_with_parent() and os.getppid() != parent:
        os._exit(1)                # the launcher died before the signal was set
    return True


def die_with_parent() -> bool:
    """This process is SIGKILLed when its parent (the thread that started it) dies."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _watch(rank: int) -> None:
    """The watcher: its own group, told by the kernel when ``rank`` dies (SIGTERM), then kills
    the rank's group and leaves at once (nothing of the rank's Python state runs here)."""
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):          # hold none of the rank's pipes, sockets or files open
            os.dup2(null, fd)
        os.closerange(3, 1 << 16)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: None)
        if _prctl(PR_SET_PDEATHSIG, signal.SIGTERM) and os.getppid() == rank:
            signal.pause()
        sweep(rank)
    finally:
        os._exit(0)


def rank_command(argv: list[str]) -> list[str]:
    """The command that runs ``python argv`` as a rank of this launcher: it dies with this
    process, and what it starts ends with it (``python -m ds_autoplan.runtime.reaper PID ...``
    calls :func:`die_with_me` and then execs Python with ``argv``)."""
    return [sys.executable, "-m", __name__, str(os.getpid()), *argv]


if __name__ == "__main__":
    die_with_me(parent=int(sys.argv[1]))
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
