"""Merak's shifted critical path (SCP) 1F1B with stage-aware recomputation
(Lai et al., "Merak", TPDS 2023, §5.1; docs/merak.md §5).

Actions F, R (recompute-forward), BW.  R needs only its own F, so placing R(k) right
before BW(k) in the list lets it run inside the wait for the gradient ("early recompute",
GPipe's idea, §5.1 fig. 3b).  SCP additionally (docs/merak.md §5.2): the last stage
does not recompute, the penultimate rank pulls a third forward ahead of its first backward,
and its first two recomputes are re-seated (R0 before the pulled F2, R1 right after BW0).
Unit costs F = R = 1, BW = 2: makespan 4m + 3(s-2) instead of 4m + 3(s-1).
"""
from __future__ import annotations

from ..ir import Kind, Schedule, ScheduleError, sequential_placement
from .registry import draft, register

F, R, BW = Kind.F, Kind.R, Kind.BW


def _recompute_flags(d: int, recompute) -> list[float]:
    if recompute is None:        # SCP default: every stage but the last recomputes (§5.2 step 2)
        return [1.0] * (d - 1) + [0.0]
    try:
        vals = [float(x) for x in recompute]
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"merak-scp: recompute must be a list of {d} bools/fractions") from e
    if len(vals) != d or any(not 0.0 <= v <= 1.0 for v in vals):
        raise ScheduleError(f"merak-scp: recompute needs {d} values in [0, 1], got {recompute!r}")
    return vals


@register("merak-scp")
def merak_scp(d: int, n: int, recompute=None, shifted: bool = True) -> Schedule:
    """SCP order (docs/merak.md §5.3).  ``recompute``: per stage, a bool or the
    fraction of its layers recomputed (> 0 → the stage gets R actions; R's duration comes
    from the costs).  ``shifted=False``: plain 1F1B with each R just before its BW."""
    rec = _recompute_flags(d, recompute)
    scp = bool(shifted) and n >= 3

    def r_(i, k):
        return [(R, i, k)] if rec[i] > 0 else []

    lists = []
    for i in range(d):
        if scp and i == d - 2:    # penultimate: pulled F2, re-seated R0 / R1 (§5.2 steps 3-4)
            keys = [(F, i, 0), (F, i, 1), *r_(i, 0), (F, i, 2), (BW, i, 0), *r_(i, 1), (BW, i, 1)]
            nf, start = 3, 2
        else:                     # 1F1B warm-up (d-i-1 forwards) with early recompute
            nf = min(d - i - 1, n)
            keys, start = [(F, i, m) for m in range(nf)], 0
        for k in range(start, n):
            if nf < n:
                keys.append((F, i, nf)); nf += 1
            keys += [*r_(i, k), (BW, i, k)]
        lists.append(keys)
    note = {} if scp or not shifted else \
        {"warning": "merak-scp: n < 3, fell back to 1F1B + early recompute"}
    return draft(n, sequential_placement(d), lists, recompute=rec, shifted=scp, **note)
