"""``DS_AUTOPLAN_*`` environment variables, each read through one helper that names the
variable when its value is wrong (a :class:`EnvError`: one line, never a traceback).

    from ds_autoplan.env import env_int
    pp = env_int("DS_AUTOPLAN_PP")              # None when unset or empty
"""
from __future__ import annotations

import math
import os
from typing import Mapping

from .errors import UserError


class EnvError(UserError, ValueError):
    """A ``DS_AUTOPLAN_*`` variable whose value cannot be used."""


def _raw(name: str, env: Mapping | None) -> str | None:
    v = (os.environ if env is None else env).get(name)
    return v.strip() if v is not None and v.strip() else None


def env_str(name: str, default: str | None = None, env: Mapping | None = None) -> str | None:
    """The variable's text (surrounding blanks dropped), ``default`` when unset or empty."""
    v = _raw(name, env)
    return default if v is None else v


def _number(name: str, default, env, cast, minimum, what: str):
    v = _raw(name, env)
    if v is None:
        return default
    try:
        x = cast(v)
    except ValueError:
        raise EnvError(f"{name}={v!r} is not {what}") from None
    if not (math.isfinite(x) and x >= minimum):
        raise EnvError(f"{name}={v!r} must be {what} of at least {minimum:g}")
    return x


def env_int(name: str, default: int | None = None, env: Mapping | None = None, *,
            minimum: int = 1) -> int | None:
    """A whole number >= ``minimum``, ``default`` when unset or empty."""
    return _number(name, default, env, int, minimum, "a whole number")


def env_float(name: str, default: float | None = None, env: Mapping | None = None, *,
              minimum: float = 0.0) -> float | None:
    """A finite number >= ``minimum``, ``default`` when unset or empty."""
    return _number(name, default, env, float, minimum, "a finite number")


def env_list(name: str, env: Mapping | None = None) -> list[str] | None:
    """Comma-separated names (blanks and empty items dropped), None when unset or empty."""
    v = _raw(name, env)
    if v is None:
        return None
    items = [s.strip() for s in v.split(",") if s.strip()]
    if not items:
        raise EnvError(f"{name}={v!r} names nothing")
    return items


def env_flag(name: str, env: Mapping | None = None) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (unset: False)."""
    v = _raw(name, env)
    if v is None:
        return False
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={v!r} is not a switch; use 1 or 0")


__all__ = ["EnvError", "env_flag", "env_float", "env_int", "env_list", "env_str"]
