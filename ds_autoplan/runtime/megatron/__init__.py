"""megatron-core 0.16.1 hooks: ds_autoplan schedules as Megatron's ``forward_backward_func``,
plan → parallel setup, a CPU shim and split-backward linear layers.

    setup = ds_autoplan.runtime.megatron.initialize(plan)          # initialize_model_parallel + overrides
    fb = ds_autoplan.runtime.megatron.get_forward_backward_func(plan)
    losses = fb(forward_step_func=..., data_iterator=..., model=chunks, num_microbatches=...,
                seq_length=..., micro_batch_size=...)     # same keywords as Megatron's
    ds_autoplan.runtime.megatron.install(plan)                     # or: patch Megatron's dispatcher
    fb = ds_autoplan.runtime.megatron.ScheduleRunner(None, plan=plan)   # DynaPipe: schedule per step, see .dynamic
    fb(..., microbatch_weights=loss_weights(counts), **step_kwargs(iteration_plan))
"""
from __future__ import annotations

from .executor import SIGNATURE, ScheduleRunner
from .dynamic import check_same_plan, loss_weights, step_kwargs
from .swap import swap_forward_step
from .setup import (MegatronSetup, StageLayerLayout, initialize, layout_string, megatron_args,
                    plan_overrides,
                    stage_layer_lists)
from .shim import cpu_shim
from .splitgrad import SplitColumnParallelLinear, SplitRowParallelLinear, split_backward_spec


def get_forward_backward_func(plan=None, *, schedule=None, costs=None, tracker=None) -> ScheduleRunner:
    """A callable with the keyword signature of megatron-core's schedule functions that runs
    ``plan``'s schedule (or ``schedule``, any valid action list; it is lowered with ``costs``)
    with the plan's recomputation as R actions (``schedule.passes.plan_schedule``, the path
    the DeepSpeed adapter takes too), also in the schedules that come with a step."""
    if schedule is None and plan is None:
        raise ValueError("give a plan or a schedule")
    return ScheduleRunner(schedule, costs, tracker, plan=plan)


def install(plan=None, *, schedule=None, costs=None, wrap=None):
    """Make megatron-core's ``get_forward_backward_func`` return our function (patches the
    attribute in ``megatron.core.pipeline_parallel``, ``...schedules`` and, if imported,
    ``megatron.training.training``); ``wrap(fb)``, if given, is returned instead of ``fb``.
    Returns a function that undoes it."""
    import sys

    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core.pipeline_parallel import schedules

    fb = get_forward_backward_func(plan, schedule=schedule, costs=costs)
    if wrap is not None:
        fb = wrap(fb)

    def get_fb(*_a, **_k):
        return fb
    mods = [pp_pkg, schedules] + [m for m in (sys.modules.get("megatron.training.training"),) if m]
    saved = [(m, m.get_forward_backward_func) for m in mods if hasattr(m, "get_forward_backward_func")]
    for m, _ in saved:
        m.get_forward_backward_func = get_fb

    def undo():
        for m, f in saved:
            m.get_forward_backward_func = f
    return undo


__all__ = ["MegatronSetup", "SIGNATURE", "ScheduleRunner",
           "SplitColumnParallelLinear", "SplitRowParallelLinear", "StageLayerLayout", "cpu_shim",
           "check_same_plan", "get_forward_backward_func", "initialize", "install", "layout_string",
           "loss_weights", "megatron_args", "plan_overrides", "split_backward_spec",
           "stage_layer_lists", "step_kwargs", "swap_forward_step"]
