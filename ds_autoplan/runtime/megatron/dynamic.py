"""DynaPipe iteration plans (ds_autoplan.dynamic) in our Megatron forward_backward_func.

One optimizer step = one :class:`~ds_autoplan.dynamic.IterationPlan`: its own micro-batch
count, a shape (mbs, padded length) per micro-batch and a lowered schedule::

    fb = ds_autoplan.runtime.megatron.ScheduleRunner(None)          # schedule comes with every step
    for plan in sampler.iter_plans():                       # or sampler.pop_plan()
        batches = [next(loader_it) for _ in range(plan.num_microbatches)]
        w = loss_weights([(lab != -100).sum() for _, lab in batches])   # loss stage
        fb(forward_step_func=..., data_iterator=iter(batches), model=chunks,
           microbatch_weights=w, **step_kwargs(plan))
        optimizer.step()

Loss weights: Megatron divides each micro-batch's loss by ``num_microbatches``; with
micro-batches of unequal token counts that is not the loss of the whole step.
``microbatch_weights`` replaces it by the micro-batch's share of the step's tokens (or
samples), so the gradient equals the one of the unpipelined model on all the step's samples
at once.  Alternative with Megatron's own machinery: ``config.calculate_per_token_loss=True``
and a loss function returning ``(loss_sum, num_tokens, report)``; Megatron's
``finalize_model_grads`` (with its DDP) then divides by the step's token count, which the
executor accumulates and passes as Megatron's schedules do.
"""
from __future__ import annotations

from ...dynamic.step import check_same_plan, loss_shares as loss_weights  # noqa: F401


def step_kwargs(plan, group=None) -> dict:
    """Keywords of our forward_backward_func for one iteration plan: its lowered schedule,
    micro-batch count and shape plan (``seq_length``/``micro_batch_size``: the largest, as
    Megatron's signature needs them; unused when shapes are given).  With ``group`` (the
    pipeline group) it first checks that all its ranks hold this plan."""
    if group is not None:
        check_same_plan(plan, group)
    shapes = [(int(b), L if not isinstance(L, (tuple, list)) else tuple(L)) for b, L in plan.shapes]
    seq = max(L if isinstance(L, int) else L[0] for _, L in shapes)
    dec = max(L[1] for _, L in shapes) if shapes and not isinstance(shapes[0][1], int) else None
    return dict(schedule=plan.lowered, num_microbatches=plan.num_microbatches,
                microbatch_shapes=shapes, seq_length=seq,
                micro_batch_size=max(b for b, _ in shapes), decoder_seq_length=dec)

