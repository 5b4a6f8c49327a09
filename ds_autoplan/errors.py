"""User-facing error types: bad input is reported as one line and a non-zero exit, never a
traceback (the CLI catches these)."""
from __future__ import annotations

import contextlib
import os
import sys


class UserError(Exception):
    """Bad input: printed as one line, non-zero exit, never a traceback."""


class PlanError(UserError, ValueError):
    """A plan (constructed or read from JSON) that no runtime can execute."""


@contextlib.contextmanager
def one_line_errors(prog: str):
    """A training script's run: a :class:`UserError` inside it (a bad ``DS_AUTOPLAN_*`` value, a
    plan that cannot run) ends the process as the CLI does, with ``prog: error: ...`` on rank
    0's stderr and exit status 2, not a traceback; the process group is torn down and the rank
    ends as :func:`ds_autoplan.runtime.ending.finish` ends it."""
    try:
        yield
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        from .runtime.ending import finish
        finish(2, barrier=False)        # (runtime/ending.py: not the interpreter's teardown)
        raise SystemExit(2) from None


__all__ = ["PlanError", "UserError", "one_line_errors"]
