"""Start-up watchdog: a rank that has not finished initialising within a bounded time says
where it waits and exits non-zero, instead of hanging silently (issue 13, item 7).

The usual culprit: DeepSpeed JIT-builds a C++ op (e.g. its CPU shared-memory comm op) with
``torch.utils.cpp_extension.load``, which serialises builds with a ``lock`` file in the op's
build folder (``torch/utils/file_baton.py``: create with O_EXCL, *wait while the file
exists*).  A process killed during the build leaves the file, and every later run waits on
it forever.  While a build really runs, its ninja/compiler processes work inside that folder;
the watchdog then keeps waiting, so it never kills a rank that builds (and neither do the
launchers, see :func:`build_in_progress`).

    with startup_watchdog("DeepSpeed initialisation"):
        deepspeed.initialize(...)

``DS_AUTOPLAN_INIT_TIMEOUT`` (seconds, default 900; 0 disables) bounds the wait.
"""
from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
import time
import traceback

ENV = "DS_AUTOPLAN_INIT_TIMEOUT"
DEFAULT_TIMEOUT = 900.0
EXIT_CODE = 3


def init_timeout() -> float:
    """Seconds from ``DS_AUTOPLAN_INIT_TIMEOUT`` (default 900; 0 = no watchdog)."""
    raw = os.environ.get(ENV, "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds") from None


def extensions_root() -> str:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR``, else the user cache
    folder (``torch.utils.cpp_extension.get_default_build_root``; ops sit one level deeper,
    under ``py311_cpu``-style folders)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return os.path.realpath(root)
    from torch.utils.cpp_extension import get_default_build_root
    return get_default_build_root()


def extension_locks(root: str | None = None) -> list[str]:
    """Build ``lock`` files under the extensions root (any op, any python/device folder)."""
    root = root or extensions_root()
    return sorted(glob.glob(os.path.join(root, "*", "lock")) +
                  glob.glob(os.path.join(root, "*", "*", "lock")))


def build_in_progress(root: str | None = None) -> list[int]:
    """Pids of processes working inside an extension build folder (a live ninja/compiler
    run; Linux ``/proc``).  Empty when nothing builds: a lock then is stale."""
    root = os.path.join(root or extensions_root(), "")
    pids = []
    for cwd in glob.glob("/proc/[0-9]*/cwd"):
        try:
            if os.path.join(os.readlink(cwd), "").startswith(root):
                pids.append(int(cwd.split("/")[2]))
        except OSError:
            continue
    return pids


def _main_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)\n"


def diagnosis(what: str, waited: float, limit: float, locks: list[str]) -> str:
    """The message a rank prints when the watchdog fires."""
    rank = os.environ.get("RANK", "?")
    head = (f"ds_autoplan: rank {rank} has not finished {what} after {waited:.0f} s "
            f"(limit {limit:g} s, set by {ENV}).\n")
    if locks:
        items = "".join(f"  {p}\n" for p in locks)
        head += ("It waits on a torch extension build lock left by an interrupted DeepSpeed "
                 f"op build:\n{items}No build is running (no process works in "
                 f"{extensions_root()}): delete the lock file(s) and run again, e.g.\n"
                 + "".join(f"  rm {p}\n" for p in locks))
    else:
        head += ("No extension build lock found; other ranks may not have started, or the "
                 "rendezvous (MASTER_ADDR/MASTER_PORT) cannot be reached.\n")
    return head + "Where the main thread waits:\n" + _main_stack()


@contextlib.contextmanager
def startup_watchdog(what: str = "initialisation", timeout: float | None = None):
    """Run the body under a watchdog: past ``timeout`` seconds (default
    :func:`init_timeout`) without leaving the body, print :func:`diagnosis` to stderr and
    exit the process with :data:`EXIT_CODE` -- unless an extension build is running, which
    is waited for (checked again every ``timeout`` seconds)."""
    timeout = init_timeout() if timeout is None else float(timeout)
    if timeout <= 0:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()

    def watch():
        while not done.wait(timeout):
            pids = build_in_progress()
            if pids:
                print(f"ds_autoplan: {what} waits for a torch extension build (pids {pids}); "
                      "not interrupting it", file=sys.stderr, flush=True)
                continue
            print(diagnosis(what, time.monotonic() - t0, timeout, extension_locks()),
                  file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)

    threading.Thread(target=watch, name="ds_autoplan-startup-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


__all__ = ["DEFAULT_TIMEOUT", "ENV", "EXIT_CODE", "build_in_progress", "diagnosis",
           "extension_locks", "extensions_root", "init_timeout", "startup_watchdog"]
