"""What a runtime does with an :class:`~ds_autoplan.dynamic.IterationPlan` each step,
whichever engine runs it (DeepSpeed or Megatron): make sure every pipeline rank holds the same
plan, and weight each micro-batch's loss by its share of the step's tokens (or samples).

torch is imported here only when called: the planning side of :mod:`ds_autoplan.dynamic`
runs in background workers without it.
"""
from __future__ import annotations

import hashlib

from ..schedule import ScheduleError


def plan_digest(plan) -> int:
    """62-bit digest of what all pipeline ranks must agree on: shapes and lowered lists."""
    text = repr([(int(b), L if isinstance(L, int) else tuple(L)) for b, L in plan.shapes])
    return int.from_bytes(hashlib.sha256((text + plan.lowered.to_text()).encode()).digest()[:8],
                          "little") >> 2


def _device(group) -> str:
    import torch.distributed as dist
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def check_same_plan(plan, group) -> None:
    """Raise ScheduleError on every rank of ``group`` (the pipeline group) unless all of them
    hold the same plan (one all-reduce of two integers); a mismatch would otherwise mean
    wrongly sized receives or a hang."""
    import torch
    import torch.distributed as dist
    h = plan_digest(plan)
    x = torch.tensor([h, -h], dtype=torch.long, device=_device(group))
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    if int(x[0]) != h or int(x[1]) != -h:
        raise ScheduleError(f"step {plan.step}: pipeline ranks hold different iteration plans "
                            f"(same lengths, seed and planner on every rank?)")


def loss_shares(counts, dp_group=None) -> list[float]:
    """``w_m = dp · c_m / Σ c`` for per-micro-batch counts ``c_m`` (tokens that carry loss, or
    samples), the sum taken over the data-parallel group ``dp_group`` (whose gradient average
    is undone by the factor dp).  With these weights ``Σ_m w_m · mean_m`` is the mean over all
    of the step's tokens (samples) on all replicas."""
    import torch
    import torch.distributed as dist
    c = torch.tensor([float(x) for x in counts], dtype=torch.float64)
    total, dp = c.sum(), 1
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dp = dist.get_world_size(dp_group)
        total = total.to(_device(dp_group))
        dist.all_reduce(total, group=dp_group)
    if float(total) <= 0:
        raise ValueError("no tokens/samples carry loss in this step")
    return [float(x) * dp / float(total) for x in c]
