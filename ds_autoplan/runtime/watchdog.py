"""Start-up watchdog: a rank that has not finished initialising within a bounded time says
where it waits and exits non-zero, instead of hanging silently.

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

After start-up, :class:`StepWatchdog` bounds every training step: both runtimes
tell it the action they execute and the pipeline rank that action waits for; a step that
has not ended within ``DS_AUTOPLAN_STEP_TIMEOUT`` seconds (default :func:`step_timeout`: a
generous multiple of the plan's predicted step time, never under ten minutes) prints, on
every rank, that action and peer and exits non-zero -- a stalled or stopped peer (SIGSTOP,
a wedged device) never makes the others wait silently.  :func:`process_group_timeout` is
the torch.distributed timeout of the groups ds_autoplan creates: longer than both
watchdogs, which fire first with the better message.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import os
import sys
import threading
import time
import traceback

ENV = "DS_AUTOPLAN_INIT_TIMEOUT"
DEFAULT_TIMEOUT = 900.0
EXIT_CODE = 3
STEP_ENV = "DS_AUTOPLAN_STEP_TIMEOUT"
STEP_FLOOR = 600.0          # seconds: a first step also compiles, allocates, warms up
STEP_FACTOR = 20.0          # x the plan's predicted step time
PG_MARGIN = 120.0           # process-group timeout beyond the watchdogs


def init_timeout() -> float:
    """Seconds from ``DS_AUTOPLAN_INIT_TIMEOUT`` (default 900; 0 = no watchdog)."""
    from ..env import env_float
    return env_float(ENV, DEFAULT_TIMEOUT)


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


def step_timeout(predicted_s: float | None = None) -> float:
    """Seconds a training step may take: ``DS_AUTOPLAN_STEP_TIMEOUT`` (0 = no watchdog), else
    :data:`STEP_FACTOR` x the plan's predicted step time, at least :data:`STEP_FLOOR`."""
    from ..env import env_float
    t = env_float(STEP_ENV)
    if t is not None:
        return t
    try:
        pred = float(predicted_s or 0.0)
    except (TypeError, ValueError):
        pred = 0.0
    return max(STEP_FLOOR, STEP_FACTOR * pred) if pred == pred else STEP_FLOOR


def process_group_timeout(predicted_s: float | None = None) -> datetime.timedelta:
    """The torch.distributed timeout of every process group ds_autoplan creates: beyond the
    start-up and step watchdogs (which fire first, naming what they wait for), so a
    collective never gives up before them nor waits forever without them."""
    limit = max(init_timeout(), step_timeout(predicted_s))
    return datetime.timedelta(seconds=(limit or DEFAULT_TIMEOUT) + PG_MARGIN)


class StepWatchdog:
    """Bounds each step: ``with wd.step(): ...`` around it, ``wd.doing(action, peer)`` as it
    goes.  Past ``timeout`` seconds in one step the rank prints, on stderr, the step, the
    action and the pipeline rank (and global rank) it waits for, and the main thread's
    stack, then exits with :data:`EXIT_CODE`.  ``timeout`` <= 0 disables it."""

    def __init__(self, timeout: float, who: str, global_rank_of=None):
        self.timeout, self.who, self.global_rank_of = float(timeout), who, global_rank_of
        self.steps = 0
        self._state = ("starting the step", None)
        self._deadline = None
        self._t0 = 0.0
        self._thread = None

    @contextlib.contextmanager
    def step(self):
        if self.timeout <= 0:
            yield
            return
        self.steps += 1
        self._state = ("starting the step", None)
        self._t0 = time.monotonic()
        self._deadline = self._t0 + self.timeout
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="ds_autoplan-step-watchdog")
            self._thread.start()
        try:
            yield
        finally:
            self._deadline = None

    def doing(self, what, peer: int | None = None) -> None:
        """The rank now executes ``what`` (an action or a phase), which waits for pipeline
        rank ``peer`` (None: nobody in particular)."""
        self._state = (what, peer)

    def message(self) -> str:
        what, peer = self._state
        rank = os.environ.get("RANK", "?")
        head = (f"ds_autoplan: rank {rank}: {self.who} step {self.steps} has not finished after "
                f"{time.monotonic() - self._t0:.0f} s (limit {self.timeout:g} s, set by "
                f"{STEP_ENV}): stuck at {getattr(what, 'short', lambda: what)()}")
        if peer is not None:
            g = self.global_rank_of(peer) if self.global_rank_of is not None else "?"
            head += (f", waiting for pipeline rank {peer} (global rank {g}), which has stopped, "
                     f"failed or is far slower")
        return head + "\nWhere the main thread waits:\n" + _main_stack()

    def _watch(self):
        tick = min(1.0, max(0.05, self.timeout / 20))
        while True:
            time.sleep(tick)
            d = self._deadline
            if d is not None and time.monotonic() > d:
                print(self.message(), file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)


__all__ = ["DEFAULT_TIMEOUT", "ENV", "EXIT_CODE", "STEP_ENV", "StepWatchdog", "build_in_progress",
           "diagnosis", "extension_locks", "extensions_root", "init_timeout",
           "process_group_timeout", "startup_watchdog", "step_timeout"]
