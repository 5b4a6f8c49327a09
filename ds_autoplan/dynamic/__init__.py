"""Dynamic micro-batching for variable-length data (DynaPipe, seed 004; docs/schedules.md §5).

* :mod:`.cost`       -- t(M) and mem(M) of a padded micro-batch (attention's quadratic term,
  encoder-decoder lengths).
* :mod:`.microbatch` -- the DP (:func:`dynapipe_split`) and the baselines (fixed, token,
  packing).
* :mod:`.planner`    -- per-iteration plan (split → adaptive schedule → lowered per-rank
  lists + shape plan) and the background :class:`Prefetcher`.
* :mod:`.sampler`    -- ``torch`` batch sampler yielding the micro-batches, exact per epoch.
* :mod:`.lengths`    -- the shipped real length distribution and its regeneration script.
* :mod:`.replay`     -- threaded CPU execution of a lowered plan with sleep-calibrated costs.

The adaptive schedule itself is the schedule builder ``"dynapipe"``
(:mod:`ds_autoplan.schedule.builders.dynapipe`).
"""
from ..schedule.builders import dynapipe as _register_dynapipe  # noqa: F401
from .cost import CostModel, pad_len
from .lengths import LengthSampler, load_lengths
from .microbatch import (MicroBatch, MicroBatchPlan, dynapipe_split, fixed_split, packing_split,
                         split, token_split)
from .planner import IterationPlan, IterationPlanner, Prefetcher, stage_costs

__all__ = ["CostModel", "IterationPlan", "IterationPlanner", "LengthSampler", "MicroBatch",
           "MicroBatchPlan", "Prefetcher", "dynapipe_split", "fixed_split", "load_lengths",
           "packing_split", "pad_len", "split", "stage_costs", "token_split"]
