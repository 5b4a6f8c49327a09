"""The space DeepSpeed's own engine runs for any module (no pipeline): what a Hugging Face
``Trainer``, an Accelerate loop or a plain ``deepspeed.initialize(model=...)`` script can take.

One model replica per rank (pp = 1, tp = 1), ZeRO 0-3 over all ranks, their offloading where
the cluster has host figures (the planner's offload space, cost/offload.py), any micro-batch per rank
dividing the global batch with the gradient accumulation that completes it, and activation
checkpointing all-or-nothing: Hugging Face's ``gradient_checkpointing_enable()`` wraps every
decoder layer, so the per-layer choice of the pipeline planner is not offered; a module without
that switch is planned without recomputation.  Memory is DeepSpeed's accounting
(``runtime='deepspeed'``, cost/memory.py) and time its execution model.
[AutoTP training (``tensor_parallel.autotp_size``) is not in this space yet.]
"""
from __future__ import annotations

from ..spec import SpecError


def search_engine_space(model, cluster, global_batch: int, seq: int | None = None, *,
                        checkpointing: bool = True, fix: dict | None = None, options=None, **changes):
    """The fastest plan of the space above (a :class:`~ds_autoplan.search.SearchResult`):
    searched without recomputation and, where the module offers ``checkpointing``, with every
    layer recomputed; the faster one that fits wins.  ``options``/``changes``: the other
    search options (:class:`~ds_autoplan.search.options.SearchOptions`).  A space that cannot fit raises the
    search's own :class:`SpecError` (naming the nearest miss)."""
    from .planner import search
    modes = ("none", "full") if checkpointing else ("none",)
    fix = dict(fix or {})
    if "recompute" in fix:
        want = "full" if fix["recompute"] in ("full", "auto") else fix["recompute"]
        if want not in modes:
            raise SpecError(f"recompute={fix['recompute']} is not available: the module has no "
                            "gradient_checkpointing_enable()" if want == "full" else
                            f"recompute={fix['recompute']}: this engine recomputes all layers or none")
        modes = (want,)
    best, miss = None, None
    for mode in modes:
        try:
            res = search(model, cluster, global_batch, seq, options, pp=1, tp=1,
                         fix={**fix, "recompute": mode}, runtime="deepspeed", execution="deepspeed",
                         wide=False, baselines=False, keep_sim=False, **changes)
        except SpecError as e:
            miss = e
            continue
        if best is None or res.plan.predicted.iteration_time_s < best.plan.predicted.iteration_time_s:
            best = res
    if best is None:
        raise miss
    return best


def recomputes(plan) -> bool:
    """Whether the plan checkpoints activations (every layer, in this space)."""
    return any(x > 0 for x in plan.recompute_per_stage)
