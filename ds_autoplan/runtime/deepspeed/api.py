"""``ds_autoplan.initialize``: ``deepspeed.initialize`` with the plan's partition, schedule and
per-stage recomputation (docs/runtimes.md §1.4 option A, §8.1)."""
from __future__ import annotations

import contextlib
import copy
import json
import os

import torch

from ...emit.deepspeed import runs_plain  # noqa: F401  (ds_autoplan.runtime.deepspeed.api.runs_plain)
from ...errors import PlanError
from ...schedule import Schedule, ScheduleError, build
from ...schedule.passes import plan_schedule
from ..common import accept, check_world
from ..watchdog import process_group_timeout, startup_watchdog


def as_plan(plan):
    """A :class:`ds_autoplan.plan.Plan` from a Plan, dict, JSON path or ``None`` (env
    ``DS_AUTOPLAN_PLAN``, set by ``ds-autoplan launch`` / ``deepspeed --autoplan``)."""
    from ...plan import Plan
    if plan is None:
        from ...env import env_str
        plan = env_str("DS_AUTOPLAN_PLAN")
        if plan is None:
            raise ValueError("no plan given (pass plan=... or launch with ds-autoplan / --autoplan)")
        try:
            return Plan.load(plan)
        except PlanError as e:
            raise PlanError(f"{e} (named by DS_AUTOPLAN_PLAN)") from None
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    return Plan.load(os.fspath(plan))


def config_from_plan(plan, config=None, defaults: bool = True) -> dict:
    """The config ``initialize`` runs: the emitted ``ds_config(plan)`` (what ``ds-autoplan
    plan`` writes to ds_config.json; ``defaults=False``: nothing of it) with the user's
    ``config`` keys merged over it; the plan stays at ``pipeline.autoplan`` and, when it
    recomputes, DeepSpeed's global checkpointing switch stays off (the runtime recomputes per
    stage).  With context parallelism (cp > 1, run as Ulysses) the plan's global batch in
    ``train_batch_size`` becomes global batch · cp: the pipeline engine counts its dp·cp
    data-axis ranks, sequence shards included."""
    from ...emit.deepspeed import ds_config
    cfg = _merge(ds_config(plan) if defaults else {}, config or {})
    if plan.cp > 1 and cfg.get("train_batch_size") == plan.global_batch_size:
        # Ulysses (runtime/deepspeed/ulysses.py): the pipeline engine's data axis holds dp·cp
        # ranks and DeepSpeed counts a micro-batch per data rank, sequence shards included
        cfg["train_batch_size"] = plan.global_batch_size * plan.cp
    cfg.setdefault("pipeline", {})["autoplan"] = plan.to_dict()
    if any(x > 0 for x in plan.recompute_per_stage):
        cfg["pipeline"]["activation_checkpoint_interval"] = 0
    return cfg


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _layers_of(model_or_layers):
    from deepspeed.runtime.pipe.module import PipelineModule
    if isinstance(model_or_layers, PipelineModule):
        return list(model_or_layers._layer_specs), model_or_layers.loss_fn
    if isinstance(model_or_layers, torch.nn.Sequential):
        return list(model_or_layers), None
    return list(model_or_layers), None


@contextlib.contextmanager
def _engine_installed(plain: bool):
    """``deepspeed.initialize`` picks ``deepspeed.PipelineEngine`` for any PipelineModule and
    ``deepspeed.DeepSpeedEngine`` otherwise (deepspeed/__init__.py, 0.19.8): rebind the one it
    takes to ours for the call."""
    import deepspeed
    if plain:
        from .plain import DataParallelEngine as ours
        name = "DeepSpeedEngine"
    else:
        from .engine import AutoplanEngine as ours
        name = "PipelineEngine"
    saved = getattr(deepspeed, name)
    setattr(deepspeed, name, ours)
    try:
        yield
    finally:
        setattr(deepspeed, name, saved)


def check_layout(plan, world: int, pp: int, topology=None) -> None:
    """The plan's processes (the contract both runtimes share: ``check_world``) and its TP:
    DeepSpeed's pipeline grid is pp x dp unless the module's ``topology`` has a model axis,
    so without one a tp > 1 plan would silently run its TP ranks as data-parallel replicas."""
    check_world(plan, world, pp, "ds_autoplan.initialize")
    mp = topology.get_dim("model") if topology is not None and "model" in topology.get_axis_names() \
        else 1
    if plan.tp != mp:
        raise ScheduleError(f"ds_autoplan.initialize: the plan has tp={plan.tp} but the DeepSpeed "
                            f"pipeline's tensor-parallel (model) axis is {mp}: run a tp > 1 plan "
                            f"with the Megatron runtime, plan with --tp 1, or pass "
                            f"module_kwargs={{'topology': PipeModelDataParallelTopology(num_pp="
                            f"{pp}, num_mp={plan.tp}, num_dp={plan.dp})}} with TP-aware layers")


@contextlib.contextmanager
def _batch_explained(plan, module):
    """DeepSpeed's batch assertion (train_batch_size = micro-batch x accumulation x
    data-parallel ranks, runtime/config.py ``_batch_assertion``) raised with what the plan
    and the pipeline say, instead of a bare AssertionError."""
    try:
        yield
    except AssertionError as e:
        if "batch" not in str(e):
            raise
        dp = module._topo.get_dim("data")
        raise ScheduleError(
            f"ds_autoplan.initialize: DeepSpeed's batch check failed ({e}); the plan trains "
            f"global batch {plan.global_batch_size} = micro-batch {plan.micro_batch_size} x "
            f"{plan.num_microbatches} micro-batches x dp {plan.dp}, and this pipeline has "
            f"{dp} data-parallel rank(s): remove train_batch_size / "
            f"train_micro_batch_size_per_gpu / gradient_accumulation_steps from your config "
            f"(the plan sets them) or make them agree") from None


def build_module(model_or_layers, plan, *, schedule: Schedule | None = None, loss_fn=None,
                 track_memory=False, world: int | None = None, **module_kwargs):
    """The :class:`AutoplanPipelineModule` for ``plan`` (must run after init_distributed);
    with ``world``, the plan's layout is checked against it first (:func:`check_layout`)."""
    from .module import AutoplanPipelineModule
    layers, lf = _layers_of(model_or_layers)
    sched = plan_schedule(plan, schedule)      # the plan's R: schedule/passes.py, as Megatron's
    if world is not None:
        check_layout(plan, world, sched.num_ranks, module_kwargs.get("topology"))
    # a list that is invalid or would hang is refused now, not after DeepSpeed has built the
    # engine and its optimizer (seconds); the engine checks it against its stages again
    accept(sched, num_ranks=sched.num_ranks, who="DeepSpeed adapter")
    S = sched.num_stages
    lps = plan.layers_per_stage if len(plan.layers_per_stage) == S else None
    rec = plan.recompute_per_stage if len(plan.recompute_per_stage) == S else None
    if lps is None and plan.layers_per_stage and len(plan.layers_per_stage) != 1:
        raise ValueError(f"plan.layers_per_stage has {len(plan.layers_per_stage)} entries but the "
                         f"schedule has {S} stages")
    module_kwargs.setdefault("partition_method", "uniform")
    return AutoplanPipelineModule(layers, placement=sched.placement, layers_per_stage=lps,
                                  recompute_per_stage=rec, schedule=sched,
                                  loss_fn=loss_fn if loss_fn is not None else lf,
                                  track_memory=track_memory, **module_kwargs)


def initialize(model_or_layers, plan=None, *, schedule: Schedule | str | None = None,
               config=None, loss_fn=None, track_memory: bool = False, module_kwargs=None,
               swap=None, config_defaults: bool = True, **ds_kwargs):
    """Like ``deepspeed.initialize``, for a layer list / ``nn.Sequential`` / ``PipelineModule``
    trained with ``plan`` (a Plan, dict or path).  Returns ``(engine, optimizer,
    training_dataloader, lr_scheduler)`` from ``deepspeed.initialize``.

    ``schedule`` overrides the plan's (a Schedule object or a builder name, built for
    ``plan.pp`` ranks and ``plan.num_microbatches``).  ``config`` (dict or JSON path) is
    merged over ``ds_config(plan)`` (:func:`config_from_plan`: without ``config`` the engine
    runs exactly the emitted ds_config.json); the plan itself is at
    ``config["pipeline"]["autoplan"]`` (DeepSpeed never validates ``pipeline``).
    ``config_defaults=False`` takes nothing from the plan's emitted config beyond ``config``
    (which then holds the plan's keys: ``emit.deepspeed.user_config``), so a user's own
    config keeps DeepSpeed's defaults for what it leaves out.
    ``swap``: per-stage swap policies (``search.memopt.stage_memory_options(...)["swap"]``), see
    :meth:`AutoplanEngine.set_swap_policy`; without it a plan that offloads activations
    (``plan.parallel.offload.activations``) swaps every layer's saved tensors to host memory.

    A plan with ZeRO-2/3 and no pipeline (:func:`runs_plain`) runs in DeepSpeed's plain engine:
    the layers as one module (``plain.StageModule``) in ``plain.DataParallelEngine``, which has
    ``train_batch`` / ``eval_batch`` as ``PipelineEngine`` does.
    """
    import deepspeed
    plan = as_plan(plan)
    if isinstance(schedule, str):
        opts = plan.schedule_options if schedule == plan.schedule else {}
        schedule = build(schedule, plan.pp, plan.num_microbatches, **opts)
    if isinstance(config, (str, os.PathLike)):
        with open(config) as fh:
            config = json.load(fh)
    cfg = config_from_plan(plan, config, defaults=config_defaults)
    with startup_watchdog("DeepSpeed initialisation"):
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend=ds_kwargs.pop("dist_backend", None),
                                       timeout=process_group_timeout(
                                           (plan.predicted or {}).get("iteration_time_s")))
        from ..nodes import check_plan
        check_plan(plan)          # the launch's nodes alike, and laid out as the plan was costed
        module = build_module(model_or_layers, plan, schedule=schedule, loss_fn=loss_fn,
                              track_memory=track_memory,
                              world=torch.distributed.get_world_size(), **(module_kwargs or {}))
        pipe, plain = module, runs_plain(plan)
        if plain:
            if swap:
                raise ValueError("swap policies run in the pipeline engine; this plan (ZeRO-"
                                 f"{plan.zero_stage}, pp=1) runs in DeepSpeed's plain engine")
            from .plain import StageModule
            module = StageModule(module, plan.parallel.offload.activations)
        ds_kwargs.setdefault("model_parameters", [p for p in module.parameters() if p.requires_grad])
        with _engine_installed(plain), _batch_explained(plan, pipe):
            out = deepspeed.initialize(model=module, config=cfg, **ds_kwargs)
        if plain:               # the run's record (the pipeline engine keeps its own)
            from .measure import record_engine
            record_engine(out[0], plan)
    from ..replan import attach
    attach(out[0])          # launch --calibrate: resume from its switch, decide after the record
    if swap:
        out[0].set_swap_policy(swap)
    elif plan.parallel.offload.activations and not plain:     # every layer's saved tensors
        from ..swap import SwapPolicy
        every = SwapPolicy.every_layer(out[0].module)
        out[0].set_swap_policy({s: every for s in out[0].module.local_stages})
    return out
