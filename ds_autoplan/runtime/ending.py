"""How a rank ends once its script is done: :func:`finish`.

Python 3.11 ends a thread that takes the GIL while the interpreter finalizes with
``pthread_exit``.  gloo's worker threads (``pt_gloo_runloop``, C++) take the GIL when they let
go of the last reference to a tensor Python made (a collective's input, freed by Python after
its ``wait`` returned); that happens in a destructor, which may not unwind, so the process
aborts: "terminate called without an active exception", SIGABRT, the launcher's exit status
250 after a run that trained to its end (pytorch/pytorch#179291 describes the mechanism).
``destroy_process_group`` does not stop those threads for a group Python still refers to
(DeepSpeed's and Megatron's data- and pipeline-parallel groups stay referenced by their
modules): measured, ``pt_gloo_runloop`` threads of such a group live on after it and end only
when the last reference goes.  A barrier before it narrows the window (the worker is usually
done by then) but does not close it: a worker the OS has not run for a while still holds the
release, and the test suite saw it (a DeepSpeed ZeRO-1 run saving its checkpoint, rank 1,
after ``barrier`` and ``destroy_process_group``).  So a rank that is done does not finalize: it
runs what ``exit`` would run while the interpreter is fully alive (the ``atexit`` handlers,
multiprocessing's finalizers among them), flushes its output and leaves with ``os._exit``.
"""
from __future__ import annotations

import contextlib
import os
import sys

from ..errors import UserError


def tear_down(barrier: bool = True) -> None:
    """The process group, torn down (after a barrier: every rank is done) if there is one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def leave(code: int = 0) -> None:
    """Leave the process with status ``code`` without the interpreter's finalization (module
    docstring): the ``atexit`` handlers run first, then stdout and stderr are flushed.  While a
    non-daemon thread still runs, return instead: the caller exits normally, waiting for it as
    Python would."""
    import atexit
    import threading
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # closed, or a closed pipe
            pass
    os._exit(code)


def finish(code: int = 0, barrier: bool = True) -> None:
    """End this rank once its script is done: :func:`tear_down`, then :func:`leave`; the end of
    every example script and of ds_autoplan's bootstrap."""
    tear_down(barrier)
    leave(code)
    sys.exit(code)


@contextlib.contextmanager
def one_line_errors(prog: str):
    """A training script's run: a :class:`UserError` inside it (a bad ``DS_AUTOPLAN_*`` value, a
    plan that cannot run) ends the process as the CLI does, with ``prog: error: ...`` on rank
    0's stderr and exit status 2, not a traceback; the process group is torn down and the rank
    ends as :func:`finish` ends it."""
    try:
        yield
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        finish(2, barrier=False)


__all__ = ["finish", "leave", "one_line_errors", "tear_down"]
