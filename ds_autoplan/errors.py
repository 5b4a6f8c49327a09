"""User-facing error types: bad input is reported as one line and a non-zero exit, never a
traceback (the CLI catches these)."""
from __future__ import annotations


class UserError(Exception):
    """Bad input: printed as one line, non-zero exit, never a traceback."""


__all__ = ["UserError"]
