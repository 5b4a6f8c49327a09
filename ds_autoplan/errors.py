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
    0's stderr and exit status 2, not a traceback; the process group is torn down first (a
    live gloo group aborts the process at exit)."""
    try:
        yield
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(2) from None


__all__ = ["PlanError", "UserError", "one_line_errors"]
