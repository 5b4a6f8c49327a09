"""User-facing error types: bad input is reported as one line and a non-zero exit, never a
traceback (the CLI catches these)."""
from __future__ import annotations


class UserError(Exception):
    """Bad input: printed as one line, non-zero exit, never a traceback."""


class PlanError(UserError, ValueError):
    """A plan (constructed or read from JSON) that no runtime can execute."""


__all__ = ["PlanError", "UserError"]
