"""The builder registry: every schedule builder with what callers need to know about it
(placement, stages per rank, options, fewest ranks and micro-batches), so that no caller
switches on a schedule's name."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from ..ir import Schedule, ScheduleError


def _one(d: int) -> int:
    return 1


@dataclass(frozen=True)
class BuilderInfo:
    """One registered builder ``fn(d, n, **options) -> Schedule``."""
    name: str
    fn: Callable[..., Schedule]
    placement: str = "sequential"       # stage -> rank: sequential, v, interleaved, or "option"
    stages_per_rank: int = 1            # model chunks per rank, unless an option sets them
    chunks_option: str | None = None    # the option setting the chunks per rank (interleaved: v)
    stages_of: Callable[[int, dict], int] | None = None   # (d, options) -> stages, "option" placement
    min_d: int = 2                      # fewest ranks
    min_n: Callable[[int], int] = _one  # fewest micro-batches for d ranks
    # place in the list the planner costs unless the user names schedules (None: costed only
    # when named).  The order is kept: each schedule is costed under the best time of those
    # before it (search/pipeline.py choose_schedule), so it decides what is cut early
    search_order: int | None = None

    @property
    def options(self) -> dict[str, Any]:
        """The builder's keyword options and their defaults (from its signature)."""
        params = list(inspect.signature(self.fn).parameters.values())[2:]
        return {p.name: p.default for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def num_stages(self, d: int, **options) -> int:
        """Pipeline stages of the schedule built for ``d`` ranks with ``options``."""
        if self.stages_of is not None:
            return self.stages_of(d, options)
        if self.chunks_option is not None:
            return d * int(options.get(self.chunks_option, self.options[self.chunks_option]))
        return d * self.stages_per_rank

    def stage_placement(self, d: int, **options) -> tuple[int, ...] | None:
        """Stage -> rank map of the schedule this builder makes for ``d`` ranks with
        ``options``, without building it; None where the builder decides it ("option")."""
        from ..ir import interleaved_placement, sequential_placement, v_placement
        S = self.num_stages(d, **options)
        if self.placement == "v" and S == 2 * d:
            return v_placement(d)
        if self.placement == "interleaved" and S % d == 0:
            return interleaved_placement(d, S // d)
        if self.placement == "sequential" and S == d:
            return sequential_placement(d)
        return None

    def check(self, d: int, n: int) -> None:
        """Uniform argument checks with one clear message."""
        if not isinstance(d, int) or d < self.min_d:
            raise ScheduleError(f"{self.name}: needs at least {self.min_d} pipeline "
                                f"stages/devices, got d={d}")
        need = self.min_n(d)
        if not isinstance(n, int) or n < need:
            raise ScheduleError(f"{self.name}: needs at least {need} micro-batches for d={d}, "
                                f"got n={n}")
        if d * n > MAX_LISTED:
            raise ScheduleError(f"{self.name}: d={d} x n={n} micro-batches is more than the "
                                f"{MAX_LISTED} (stage, micro-batch) pairs a schedule lists action "
                                f"by action; use fewer micro-batches (a larger micro-batch size)")


# a built schedule holds ~3 actions per (stage, micro-batch) (~0.5 KB each): 2^22 pairs is a
# few GB; a longer list is a typo, refused before it is built
MAX_LISTED = 1 << 22

REGISTRY: dict[str, BuilderInfo] = {}
BUILDERS: dict[str, Callable[..., Schedule]] = {}


def register(name: str, **info):
    """Register the decorated builder under its CLI name with its :class:`BuilderInfo`
    fields (``placement``, ``stages_per_rank``, ``chunks_option``, ``stages_of``, ``min_d``,
    ``min_n``, ``search_order``: set it for a builder the planner tries by default).

    The name is written here only: the registered function (also when called directly)
    checks ``d`` and ``n`` with :meth:`BuilderInfo.check` before the builder runs, and names
    the schedule the builder returns (builders make it with :func:`draft`)."""
    def deco(fn):
        @functools.wraps(fn)
        def builder(d: int, n: int, *args, **options) -> Schedule:
            entry.check(d, n)
            try:
                sched = fn(d, n, *args, **options)
            except ScheduleError as e:       # every builder's refusal starts with its name
                if str(e).startswith(f"{name}:"):
                    raise
                raise ScheduleError(f"{name}: {e}") from e
            return sched if sched.name == name else replace(sched, name=name)

        entry = BuilderInfo(name, builder, **info)
        REGISTRY[name] = entry
        BUILDERS[name] = builder
        return builder
    return deco


def draft(n: int, placement: Sequence[int], per_rank: Sequence[Sequence[tuple]],
          **meta) -> Schedule:
    """A builder's result before :func:`register` names it: per-rank ``(kind, stage, mb)``
    lists over ``placement`` (:meth:`Schedule.from_keys` without the name)."""
    return Schedule.from_keys("", n, placement, per_rank, **meta)


def check_args(name: str, d: int, n: int) -> None:
    """The registered builder ``name``'s argument checks, for callers that validate before
    building."""
    REGISTRY[name].check(d, n)
