"""DynaPipe's dynamic micro-batches in the DeepSpeed runtime (seed 004; docs/schedules.md §5).

Each optimizer step runs one :class:`ds_autoplan.dynamic.IterationPlan`: its own number of
micro-batches, each with its own (mbs, padded length), and its own lowered schedule::

    engine, *_ = ds_autoplan.initialize(layers, static_plan(pp=2), loss_fn=gpt_loss, ...)
    sampler = DynamicBatchSampler(lengths, global_batch, IterationPlanner(cost, 2), ...)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate())
    for plan, data in steps(engine, sampler, loader):     # one DynaPipe plan per step
        loss = train_batch(engine, plan, data, hidden=cfg.hidden)

(DeepSpeed's own ``deepspeed_io`` loader has a fixed batch size and takes a ``sampler``, not
a ``batch_sampler``; the torch loader above feeds ``train_batch``'s data iterator.)

* Schedule: ``plan.lowered`` (every rank's F/BW and send/recv order, proven deadlock-free
  by the simulator) replaces the engine's action list for the step; DeepSpeed's
  ``gradient_accumulation_steps`` is set to the plan's micro-batch count.
* Per-step state goes in as one ``runtime.common.StepState`` (``engine.set_step``, the same
  contract as the Megatron adapter): schedule, shapes and loss weights of the step.
* Shapes (§5.6): the receiver allocates ``(mbs, padded len, hidden)`` from ``plan.shapes``
  -- no shape handshake; the sender checks its tensors against the same plan.
* Loss weights: micro-batch k's loss (a mean over its tokens or samples) is weighted by its
  share of the step's tokens/samples over all data-parallel replicas, not by
  1/num_microbatches, so the step's gradient is the one of the unpipelined model on all of
  the step's samples at once.  DeepSpeed still divides by gradient_accumulation_steps and
  averages over data-parallel replicas; the factor undoes both.
* DeepSpeed does the rest: gradient reduction, ZeRO-0/1 and the optimizer step.

Limits: the placement is fixed at initialize (every plan's placement must equal the
module's; :func:`static_plan` gives the sequential one DynaPipe plans use); a stage
boundary carries one tensor ``[mbs, len, hidden]`` unless ``shapes`` is given (encoder-
decoder lengths need it); every pipeline rank must hold the same plan (``check=True``
compares a digest once per step); ``eval_batch`` keeps the static shape handshake;
DeepSpeed's ``global_samples`` counts ``train_micro_batch_size_per_gpu`` per micro-batch,
not the plan's samples; tested in fp32 (bf16/fp16 take the activation dtype from the
module's parameters, untested).
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterator, Sequence

import torch

from ...dynamic.step import check_same_plan, loss_shares
from ..common import StepState


def static_plan(pp: int, *, dp: int = 1, layers_per_stage=None, zero_stage: int = 0,
                precision: str = "fp32", recompute_per_stage=None):
    """The :class:`~ds_autoplan.plan.Plan` to ``initialize`` an engine for dynamic steps: the
    partition and a sequential 1F1B placement; micro-batch size and count are nominal (1, 1)
    and every step brings its own."""
    from ...plan import Plan
    return Plan(pp=pp, dp=dp, zero_stage=zero_stage, micro_batch_size=1, num_microbatches=1,
                global_batch_size=dp, precision=precision, schedule="1f1b", schedule_options={},
                layers_per_stage=list(layers_per_stage or []),
                recompute_per_stage=list(recompute_per_stage or [0.0] * pp))


def _labels(batch):
    return batch[1] if isinstance(batch, (tuple, list)) else batch


def _weight_of(batch, weight, ignore_index) -> float:
    y = _labels(batch)
    if callable(weight):
        return float(weight(batch))
    if weight == "tokens":
        return float((y != ignore_index).sum()) if not y.is_floating_point() else float(y[..., 0].numel())
    if weight == "samples":
        return float(y.shape[0])
    raise ValueError(f"weight must be 'tokens', 'samples', a callable or a list, got {weight!r}")


def loss_weights(engine, batches, weight="tokens", ignore_index: int = -100) -> list[float]:
    """Per micro-batch share ``w_k / Σ w`` of the step over all data-parallel replicas (on the
    loss rank), the ``StepState.loss_weights`` of the step."""
    if isinstance(weight, Sequence) and not isinstance(weight, str):
        w = [float(x) for x in weight]
    else:
        w = [_weight_of(b, weight, ignore_index) for b in batches]
    group = engine.grid.get_data_parallel_group() if engine.dp_world_size > 1 else None
    return loss_shares(w, group)


def loss_factors(engine, batches, weight="tokens", ignore_index: int = -100) -> list[float]:
    """Per micro-batch factor ``c_k = n · loss_shares(w)_k`` on the loss rank: with
    DeepSpeed's division by gradient_accumulation_steps (n) and the data-parallel average,
    micro-batch k's gradient counts with its share ``w_k / Σ w`` of the step."""
    w = loss_weights(engine, batches, weight, ignore_index)
    return [len(w) * x for x in w]


def gpt_shapes(hidden: int, dtype: torch.dtype) -> Callable:
    """Shape plan of a decoder-only stack: the activation entering any stage > 0 is one
    ``[mbs, padded len, hidden]`` tensor."""
    def shapes(stage, shape):
        mbs, L = shape
        if not isinstance(L, int):
            raise ValueError("encoder-decoder lengths need an explicit shapes= function")
        return True, [(dtype, (int(mbs), int(L), int(hidden)))]
    return shapes


def train_batch(engine, plan, data_iter: Iterator | None = None, *, hidden: int | None = None,
                shapes: Callable | None = None, weight="tokens", ignore_index: int = -100,
                check: bool = True):
    """One optimizer step of ``engine`` (an :class:`AutoplanEngine`) on iteration plan
    ``plan``: ``plan.num_microbatches`` batches ``(inputs, labels)`` of shapes
    ``plan.shapes`` are read from ``data_iter`` on the ranks that load data (first stage and
    loss stage).  ``shapes(stage, (mbs, len)) -> (is_tensor, [(dtype, shape)])`` is the
    activation entering ``stage`` (default :func:`gpt_shapes` with ``hidden``).  ``weight``:
    'tokens' (labels != ignore_index), 'samples', a callable on the batch or a list of
    per-micro-batch weights.  Returns DeepSpeed's aggregated loss (the weighted step loss)."""
    if check:
        check_same_plan(plan, engine.grid.get_pipe_parallel_group())
    if shapes is None:
        if hidden is None:
            raise ValueError("give hidden= (the activation width) or shapes=")
        dtype = next(engine.module.parameters()).dtype
        shapes = gpt_shapes(hidden, dtype)
    batches = None
    loads = loads_data(engine)
    if loads:
        it = data_iter if data_iter is not None else engine.data_iterator
        batches = [next(it) for _ in range(plan.num_microbatches)]
        for k, b in enumerate(batches):
            x = b[0] if isinstance(b, (tuple, list)) else b
            if tuple(x.shape[:2]) != tuple(plan.shapes[k]):
                raise ValueError(f"step {plan.step}: micro-batch {k} from the loader has shape "
                                 f"{tuple(x.shape)}, the plan says {tuple(plan.shapes[k])} "
                                 f"(same pad_to in collate and cost model?)")
    w = loss_weights(engine, batches, weight, ignore_index) if engine.is_last_stage() else None
    engine.set_step(StepState(plan.lowered, plan.shapes, w), shapes=shapes)
    return engine.train_batch(iter(batches) if loads else None)


def loads_data(engine) -> bool:
    """Whether this rank reads batches (it holds the first stage or the loss)."""
    return engine.placement[0] == engine.stage_id or engine.is_last_stage()


def steps(engine, sampler, loader=None):
    """``(plan, data_iter)`` per optimizer step.  Ranks that load data iterate ``loader``
    (a ``DataLoader`` over ``sampler`` as batch sampler) and take each step's plan with
    ``sampler.pop_plan()``; the other ranks only plan (``sampler.iter_plans()``, the same
    deterministic planner; :func:`train_batch` checks that the plans agree)."""
    if loader is None or not loads_data(engine):
        for plan in sampler.iter_plans():
            yield plan, None
        return
    it = iter(loader)
    for first in it:
        yield sampler.pop_plan(), itertools.chain([first], it)
