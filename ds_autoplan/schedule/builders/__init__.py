"""Schedule builders: small pure functions ``(d, n, **options) -> Schedule``.

Every builder registers itself under its CLI name with :func:`register`; callers use
:func:`build`.  Runtimes never look at the name: it is for humans and reports only.
"""
from __future__ import annotations

from typing import Callable

from ..ir import Schedule, ScheduleError

BUILDERS: dict[str, Callable[..., Schedule]] = {}
MIN_MICROBATCHES: dict[str, Callable[[int], int]] = {}


def register(name: str, min_n: Callable[[int], int] = lambda d: 1):
    def deco(fn):
        BUILDERS[name] = fn
        MIN_MICROBATCHES[name] = min_n
        return fn
    return deco


def check_args(name: str, d: int, n: int, min_d: int = 2) -> None:
    """Uniform argument checks with one clear message."""
    if not isinstance(d, int) or d < min_d:
        raise ScheduleError(f"{name}: needs at least {min_d} pipeline stages/devices, got d={d}")
    need = MIN_MICROBATCHES.get(name, lambda _d: 1)(d)
    if not isinstance(n, int) or n < need:
        raise ScheduleError(f"{name}: needs at least {need} micro-batches for d={d}, got n={n}")


def build(name: str, d: int, n: int, **options) -> Schedule:
    """Build schedule ``name`` for ``d`` devices and ``n`` micro-batches."""
    _load_all()
    if name not in BUILDERS:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(sorted(BUILDERS))}")
    check_args(name, d, n)
    return BUILDERS[name](d, n, **options)


def names() -> list[str]:
    _load_all()
    return list(BUILDERS)


def _load_all() -> None:
    # import for the side effect of registration; modules are small
    from . import classic  # noqa: F401
    try:
        from . import vshape  # noqa: F401
    except ImportError:  # pragma: no cover - during development
        pass
    for mod in ("zb", "merak", "adaptive", "dynapipe"):
        try:
            __import__(f"{__name__}.{mod}")
        except ImportError as e:  # pragma: no cover
            if f"{__name__}.{mod}" not in str(e):
                raise
