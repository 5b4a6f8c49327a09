"""DawnPiper's binary pipeline partitioning over the fine-grained chain of a profile
(docs/dawnpiper.md §4-6; seed 002 §4, Algorithm 1), with :func:`memopt.mem_opt` as the
per-stage memory optimisation.  The walk itself is :func:`bipartition.binary_partition`,
shared with the planner's block-level ``ds_autoplan.search.partition.dawnpiper``; this one
cuts at profile units (fx nodes).

Theorem 4.1: for two adjacent stages the best cut lies between the compute-balanced cut
``rho_cb`` and the memory-balanced cut ``rho_mb``; candidates are visited from ``rho_cb``
toward ``rho_mb`` and the walk stops at the first cut that needs no memory optimisation.
"""
from __future__ import annotations

from dataclasses import dataclass

from .bipartition import INF, binary_partition
from .memopt import KEEP, StagePolicy, _Stage, mem_opt
from ..profile.profile import Profile



@dataclass
class Partition:
    """DawnPiper's result: unit bounds and keep/recompute/swap policy per stage, and the bottleneck
    time (inf if no cut fits)."""
    bounds: list[tuple[int, int]]      # [lo, hi) units per stage
    policies: list[StagePolicy]
    bottleneck_s: float                # max_x (T_x + T_x^moo), inf if infeasible

    @property
    def units_per_stage(self) -> list[int]:
        """Profile units per stage."""
        return [hi - lo for lo, hi in self.bounds]

    @property
    def recompute_per_stage(self) -> list[float]:
        """Per stage, the fraction of its units recomputed."""
        return [p.recompute_fraction for p in self.policies]


def dawnpiper_partition(prof: Profile, copies: list[int], cap: float, **memopt_kw) -> Partition:
    """Cut ``prof.units`` into ``len(copies)`` stages (stage x keeps ``copies[x]`` activation
    copies, e.g. :func:`memopt.inflight_copies`) minimising the slowest stage's time including
    its memory optimisation, with every stage's ``mem_x <= cap``."""
    N, S = prof.num_units, len(copies)
    if S < 1 or N < S:
        from ..errors import UserError
        raise UserError(f"cannot cut {N} units into {S} stages")

    def stage(lo, hi, x) -> _Stage:
        return _Stage(prof, lo, hi, copies[x], 1.0, memopt_kw.get("state_factor", 4.0))

    def time_of(lo, hi):
        st = stage(lo, hi, 0)
        return st.TF + st.TB

    def mem_of(lo, hi, L, R):
        """Mean per-stage footprint if stages L..R shared [lo, hi) evenly (§3.3 terms)."""
        st = stage(lo, hi, L)
        A = st.mem([KEEP] * (hi - lo)) - st.W
        k = sum(copies[L:R + 1]) / (R - L + 1)
        return (st.W + k * A / st.k) / (R - L + 1)

    def balanced(lo, hi, L, mid, R, f):
        """Cut c minimising the larger per-stage share of f on either side (§5.2)."""
        nl, nr = mid - L + 1, R - mid
        cs = range(lo + nl, hi - nr + 1)
        return min(cs, key=lambda c: max(f(lo, c, L, mid), f(c, hi, mid + 1, R)))

    def candidates(lo, hi, L, mid, R):
        cb = balanced(lo, hi, L, mid, R,
                      lambda a, b, l, r: time_of(a, b) / (r - l + 1))
        mb = balanced(lo, hi, L, mid, R, mem_of)
        step = 1 if mb >= cb else -1
        return list(range(cb, mb + step, step))          # from rho_cb toward rho_mb

    def stage_cost(lo, hi, x):
        pol = mem_opt(prof, lo, hi, cap, copies[x], stage=x, **memopt_kw)
        return (pol.time_s + pol.extra_s if pol.feasible else INF), pol, bool(pol.recompute or pol.swap)

    t, bounds, pols = binary_partition(N, S, stage_cost, candidates, widen=True)
    return Partition(list(bounds), list(pols), t)


def partition_report(prof: Profile, stages: int, cap: float, *, schedule: str = "1f1b",
                     microbatches: int | None = None, **memopt_kw) -> dict:
    """:func:`dawnpiper_partition` for ``stages`` pipeline ranks of ``schedule`` (activation
    copies per stage from the simulator, :func:`memopt.inflight_copies`), as a JSON-ready
    report: cuts (``units_per_stage``; at block granularity the units are the runtime's layer
    list, so it is a Plan's ``layers_per_stage``), ``bottleneck_s`` and
    :func:`memopt.stage_memory_options` (``recompute_per_stage``, ``swap_bytes_per_stage``,
    the per-stage ``swap`` policy, ...) plus every stage's full policy.  ``memopt_kw`` go to
    :func:`memopt.mem_opt` (``per_tensor=True``: keep / recompute / swap per saved tensor)."""
    from ..schedule import build
    from .memopt import inflight_copies, stage_memory_options
    n = microbatches or 2 * stages
    copies = inflight_copies(build(schedule, stages, n))
    res = dawnpiper_partition(prof, copies, cap, **memopt_kw)
    return {"model": prof.model, "granularity": prof.granularity, "schedule": schedule,
            "num_microbatches": n, "copies": copies, "cap_bytes": cap if cap < INF else None,
            "per_tensor": bool(memopt_kw.get("per_tensor")),
            "unit_names": [u.name for u in prof.units],
            "units_per_stage": res.units_per_stage, "feasible": res.bottleneck_s < INF,
            "bottleneck_s": res.bottleneck_s if res.bottleneck_s < INF else None,
            **stage_memory_options(res.policies), "policies": [p.to_dict() for p in res.policies]}
