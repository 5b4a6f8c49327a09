"""The space DeepSpeed's own engine runs for any module (no pipeline): what a Hugging Face
``Trainer``, an Accelerate loop or a plain ``deepspeed.initialize(model=...)`` script can take.

No pipeline (pp = 1), ZeRO 0-3 over the data-parallel ranks, their offloading where the cluster
has host figures (the planner's offload space, cost/offload.py), any micro-batch per rank
dividing the global batch with the gradient accumulation that completes it, and activation
checkpointing all-or-nothing: Hugging Face's ``gradient_checkpointing_enable()`` wraps every
decoder layer, so the per-layer choice of the pipeline planner is not offered; a module without
that switch is planned without recomputation.  Memory is DeepSpeed's accounting
(``runtime='deepspeed'``, cost/memory.py) and time its execution model.

Tensor parallelism is DeepSpeed's AutoTP training (``tensor_parallel.autotp_size``, emitted by
emit/deepspeed.py), where the caller says the module takes it (``autotp``: a Hugging Face model
AutoTP shards by its config): the degrees of the planner's TP (within a node, dividing the
attention and key/value heads), costed as Megatron's TP without sequence parallelism (AutoTP
splits q/k/v/gate/up by columns and o/down by rows, an all-reduce after each row-parallel
layer, as Megatron's layers do; it keeps the word embedding whole, which the cost model splits:
an under-count of ``vocab x hidden x (1 - 1/tp)`` parameters per rank).  Otherwise one model
replica per rank (tp = 1).  No context or expert parallelism: this engine runs neither for a
module by itself.
"""
from __future__ import annotations

from ..spec import SpecError
from ..spec.parallel import Offload
from .space import OFFLOAD_SPACE

# the offloads of model states only: the module's own checkpointing (Hugging Face's) keeps its
# inputs on the device, and DeepSpeed's cpu_checkpointing serves deepspeed.checkpointing only
ENGINE_OFFLOADS = tuple(o for o in OFFLOAD_SPACE if not o.activations)


def search_engine_space(model, cluster, global_batch: int, seq: int | None = None, *,
                        checkpointing: bool = True, autotp: bool = False, fix: dict | None = None,
                        options=None, **changes):
    """The fastest plan of the space above (a :class:`~ds_autoplan.search.SearchResult`):
    searched without recomputation and, where the module offers ``checkpointing``, with every
    layer recomputed; the faster one that fits wins.  ``autotp``: tensor degrees searched
    (AutoTP); a ``tp`` in ``fix`` or the options restricts them.  ``options``/``changes``: the other
    search options (:class:`~ds_autoplan.search.options.SearchOptions`).  A space that cannot fit raises the
    search's own :class:`SpecError` (naming the nearest miss)."""
    from .planner import search
    from .fix import parse_fix
    modes = ("none", "full") if checkpointing else ("none",)
    fix = parse_fix(fix)
    tp = fix.pop("tp", None) or getattr(options, "tp", None) or changes.pop("tp", None)
    if tp not in (None, 1) and not autotp:
        raise SpecError(f"tp={tp}: this module cannot take DeepSpeed's AutoTP (a Hugging Face "
                        "model without adapters can), so its engine runs tp=1")
    if "offload" in fix and Offload.parse(fix["offload"]).activations:
        raise SpecError(f"offload={fix['offload']}: DeepSpeed's engine running a module by itself keeps "
                        "its activations on the device (cpu_checkpointing serves deepspeed.checkpointing "
                        "only, not the module's own checkpointing)")
    for key in ("cp", "ep"):
        if fix.get(key, 1) != 1:
            raise SpecError(f"{key}={fix[key]}: DeepSpeed's engine runs a module without "
                            "context or expert parallelism here")
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
            res = search(model, cluster, global_batch, seq, options, pp=1,
                         tp=(tp or None) if autotp else 1, sequence_parallel="off",
                         fix={**fix, "recompute": mode, "cp": 1, "ep": 1},
                         runtime="deepspeed", execution="deepspeed", offloads=ENGINE_OFFLOADS,
                         wide=False, baselines=False, keep_sim=False, **changes)
        except SpecError as e:
            miss = e
            continue
        if best is None or res.plan.predicted.iteration_time_s < best.plan.predicted.iteration_time_s:
            best = res
    if best is None:
        raise miss
    return best


def engine_runs(plan) -> bool:
    """Whether ``plan`` is one DeepSpeed's engine runs for a module by itself: no pipeline, no
    context or expert parallelism, tensor parallelism (AutoTP) without sequence parallelism."""
    p = plan.parallel
    return p.pp == 1 and p.cp == 1 and p.ep == 1 and not (p.tp > 1 and p.sp)


def recomputes(plan) -> bool:
    """Whether the plan checkpoints activations (every layer, in this space)."""
    return any(x > 0 for x in plan.recompute_per_stage)
