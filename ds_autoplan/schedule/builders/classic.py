"""GPipe, 1F1B and interleaved 1F1B (fused backward BW)."""
from __future__ import annotations

from ..ir import Kind, Schedule, ScheduleError, interleaved_placement, sequential_placement
from .registry import draft, register

F, BW = Kind.F, Kind.BW


@register("gpipe")
def gpipe(d: int, n: int) -> Schedule:
    """All forwards, then all backwards in reverse micro-batch order (GPipe)."""
    lists = [[(F, r, m) for m in range(n)] + [(BW, r, m) for m in reversed(range(n))]
             for r in range(d)]
    return draft(n, sequential_placement(d), lists)


def one_f_one_b_order(d: int, n: int, rank: int) -> list[tuple]:
    """PipeDream-flush / Megatron 1F1B order of one rank: d-r-1 warm-up forwards,
    then alternate F and BW, then the cool-down backwards."""
    warm = min(d - rank - 1, n)
    keys = [(F, rank, m) for m in range(warm)]
    nf, nb = warm, 0
    while nf < n:
        keys.append((F, rank, nf)); nf += 1
        keys.append((BW, rank, nb)); nb += 1
    keys += [(BW, rank, m) for m in range(nb, n)]
    return keys


@register("1f1b", search_order=0)
def one_f_one_b(d: int, n: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule), fused backward BW."""
    return draft(n, sequential_placement(d), [one_f_one_b_order(d, n, r) for r in range(d)])


def interleaved_table(n: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in the order Megatron-core's interleaved schedule runs the
    forwards: groups of ``group`` micro-batches go through chunk 0, then chunk 1, ...
    (megatron.core.pipeline_parallel.schedules.get_schedule_table)."""
    table = []
    for lo in range(0, n, group):
        hi = n if lo + group >= n else lo + group
        table += [(m, c) for c in range(v) for m in range(lo, hi)]
    return table


@register("interleaved", placement="interleaved", chunks_option="v", min_n=lambda d: d,
          search_order=1)
def interleaved(d: int, n: int, v: int = 2, group: int | None = None) -> Schedule:
    """Interleaved 1F1B with ``v`` model chunks per rank (stage = chunk·d + rank)."""
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"interleaved: chunks v must be >= 1, got {v}")
    if group is None:
        # Megatron-core needs the last group to be empty or >= d (else it raises: the
        # pipeline would stall); pick the smallest valid microbatch_group_size_per_vp_stage
        group = next(g for g in range(d, n + 1) if n % g == 0 or n % g >= d)
    elif not d <= group <= n or 0 < n % group < d:
        raise ScheduleError(f"interleaved: group size {group} must lie in [d={d}, n={n}] and "
                            f"leave a last group of 0 or >= d micro-batches (Megatron-core rule)")
    table = interleaved_table(n, v, group)
    total = n * v
    lists = []
    for r in range(d):
        fwd = [(F, c * d + r, m) for (m, c) in table]
        bwd = [(BW, (v - 1 - c) * d + r, m) for (m, c) in table]
        # Megatron's warm-up (get_pp_rank_microbatches), then one F before each BW
        warm = min((d - r - 1) * 2 + (v - 1) * group, total) if v > 1 else min(d - r - 1, total)
        keys = fwd[:warm]
        for i, bk in enumerate(bwd):
            if warm + i < total:
                keys.append(fwd[warm + i])
            keys.append(bk)
        lists.append(keys)
    return draft(n, interleaved_placement(d, v), lists, chunks=v,
                 microbatch_group_size_per_vp_stage=group)
