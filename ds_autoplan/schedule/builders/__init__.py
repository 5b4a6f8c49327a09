"""Schedule builders: small pure functions ``(d, n, **options) -> Schedule``.

Every builder registers itself under its CLI name with :func:`register`, together with what
callers need to know about it (:class:`BuilderInfo`: placement, stages per rank, options,
fewest ranks and micro-batches); callers use :func:`build` and :func:`builder_info`.
Runtimes never look at the name: it is for humans and reports only.

Adding a schedule -- the name is written once, in ``register``::

    from ..ir import Kind, sequential_placement
    from .registry import draft, register

    @register("all-f-then-bw", min_n=lambda d: 1)
    def all_f_then_bw(d: int, n: int) -> Schedule:
        \"\"\"GPipe without the reversed backward order (an example).\"\"\"
        lists = [[(Kind.F, r, m) for m in range(n)] + [(Kind.BW, r, m) for m in range(n)]
                 for r in range(d)]
        return draft(n, sequential_placement(d), lists)

The registered function checks ``d`` and ``n`` against ``min_d`` / ``min_n`` before the body
runs, prefixes the builder's :class:`ScheduleError` messages with its name and names the
schedule that :func:`draft` left unnamed.  Import the module below so that it registers; the
registry-driven tests (``tests/test_builder_registry.py``, the runtime tests) then cover it
unless they list it, with a reason, among their exclusions.  ``docs/schedules.md`` explains
the IR, the simulator and each family of schedules.
"""
from __future__ import annotations

from ..ir import Schedule, ScheduleError
# importing a builder module registers its builders (in this order: names() lists them so)
from . import classic, vshape, zb, merak, adaptive, dynapipe  # noqa: F401,I001
from .registry import BUILDERS, REGISTRY, BuilderInfo, check_args, register

__all__ = ["BUILDERS", "BuilderInfo", "REGISTRY", "build", "builder_info", "check_args",
           "check_names", "names", "register", "searched_by_default"]


def builder_info(name: str) -> BuilderInfo:
    """The registered builder ``name`` (a clear error for an unknown one)."""
    if name not in REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def build(name: str, d: int, n: int, **options) -> Schedule:
    """Build schedule ``name`` for ``d`` devices and ``n`` micro-batches."""
    info = builder_info(name)
    info.check(d, n)
    return info.fn(d, n, **options)


def names() -> list[str]:
    """The registered builders' names, in registration order."""
    return list(REGISTRY)


def searched_by_default() -> list[str]:
    """The builders the planner costs unless the user names schedules: those registered with
    a ``search_order``, in that order."""
    return sorted((n for n, i in REGISTRY.items() if i.search_order is not None),
                  key=lambda n: REGISTRY[n].search_order)


def check_names(wanted):
    """``wanted`` (schedule names; None passes through) when every name is registered, else
    a :class:`ScheduleError` naming the unknown ones and the registered builders."""
    if wanted is None:
        return None
    bad = [s for s in wanted if s not in REGISTRY]
    if bad:
        raise ScheduleError(f"unknown schedule(s) {', '.join(map(repr, bad))}; choose from "
                            f"{', '.join(REGISTRY)}")
    return list(wanted)
