"""``deepspeed.initialize`` for an unchanged ``PipelineModule`` script, planned (docs/runtimes.md
§1.8, the bootstrap mode).

When the script calls ``deepspeed.initialize(model=PipelineModule(...), ...)``, the hook:

1. reads the user's DeepSpeed config (``config=`` or ``args.deepspeed_config``);
2. gets a plan: the launcher's (``--model`` given: a preset planned before launch), or one for
   the layers this script built: rank 0 profiles them on one micro-batch of ``training_data``
   (:func:`ds_autoplan.profile.layers.profile_layer_list`), plans for the config's
   ``train_batch_size`` and precision, and sends the plan to every rank;
3. sets the plan's parallel, batch and schedule keys in the user's config, leaving the
   optimizer, precision, clipping and logging as written, and reports every replaced value
   (:func:`ds_autoplan.emit.deepspeed.user_config`);
4. trains the script's layers and loss in ds_autoplan's engine (``ds_autoplan.initialize``).

Any other ``nn.Module`` is planned for DeepSpeed's own engine (ZeRO stage, micro-batch and
accumulation, activation checkpointing, AutoTP; clients/module_plan.py) and initialised by DeepSpeed as
the script asked, with the merged config.  What it cannot plan it refuses with one message: no
example input to profile, no batch size, a plan for another layer count.
"""
from __future__ import annotations

import copy
import os
import sys

import torch

from ..errors import UserError
from .module_plan import AutoplanRefused, option, user_config_of


# planned: {id: plan} of the modules a Trainer/Accelerate hook (clients/hf.py) planned and configured
_STATE: dict = {"original": None, "options": {}, "planned": {}}


def install(options: dict) -> None:
    """Wrap ``deepspeed.initialize`` (once) with the launcher's ``options``: ``plan`` (path of a
    plan made before launch), ``cluster``, ``global_batch``, ``pp``, ``tp``, ``schedules``, ``out``."""
    import deepspeed
    if _STATE["original"] is None:
        _STATE["original"] = deepspeed.initialize
    _STATE["options"] = dict(options)
    deepspeed.initialize = autoplan_initialize
    from .hf import install as install_hf      # Trainer / Accelerate, as the script imports them
    install_hf(_STATE)


def autoplan_initialize(args=None, model=None, optimizer=None, model_parameters=None,
                        training_data=None, lr_scheduler=None, collate_fn=None, config=None,
                        config_params=None, **kwargs):
    """``deepspeed.initialize`` with the model planned; same arguments and return value."""
    from deepspeed.runtime.pipe.module import PipelineModule

    from ..runtime.deepspeed.api import initialize
    from ..runtime.deepspeed.module import AutoplanPipelineModule
    from ..runtime.deepspeed.plain import StageModule
    if isinstance(model, (AutoplanPipelineModule, StageModule)):   # ds_autoplan.initialize, planned
        return _STATE["original"](args=args, model=model, optimizer=optimizer,
                                  model_parameters=model_parameters, training_data=training_data,
                                  lr_scheduler=lr_scheduler, collate_fn=collate_fn, config=config,
                                  config_params=config_params, **kwargs)
    if not isinstance(model, PipelineModule):
        _no_switch(type(model).__name__)
        if model is not None and id(model) in _STATE["planned"]:   # the Trainer/Accelerate hook's
            return _recorded(_STATE["original"](
                args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                config=config, config_params=config_params, **kwargs), _STATE["planned"][id(model)])
        if not isinstance(model, torch.nn.Module):
            raise AutoplanRefused(f"the script passes {type(model).__name__} to deepspeed.initialize, "
                                  "not a torch.nn.Module: nothing to plan")
        cfg, plan = _plan_engine_module(args, model, training_data, collate_fn,
                                        config if config is not None else config_params)
        return _recorded(_STATE["original"](
            args=_without_config(args), model=model, optimizer=optimizer,
            model_parameters=model_parameters, training_data=training_data, lr_scheduler=lr_scheduler,
            collate_fn=collate_fn, config=cfg, **kwargs), plan)
    user = user_config_of(args, config if config is not None else config_params)
    plan = _shared_plan(model, user, training_data, collate_fn)
    from ..emit.deepspeed import user_config
    cfg, changes = user_config(plan, user)
    _report(plan, cfg, changes, model)
    if isinstance(model_parameters, (list, tuple)) and any(isinstance(g, dict) for g in model_parameters):
        raise AutoplanRefused("parameter groups (dicts) in model_parameters cannot follow the plan's "
                              "partition; pass the optimizer settings in the DeepSpeed config")
    kw = {k: v for k, v in (("optimizer", optimizer), ("training_data", training_data),
                             ("lr_scheduler", lr_scheduler), ("collate_fn", collate_fn)) if v is not None}
    return initialize(model, plan, config=cfg, config_defaults=False, args=_without_config(args),
                      module_kwargs=_module_kwargs(model), **kw, **kwargs)


def _no_switch(what: str) -> None:
    """Where DeepSpeed's own engine runs the script's module (Trainer, Accelerate, a plain
    module): ``launch --calibrate`` cannot switch it (its checkpoint is DeepSpeed's, of one plan)."""
    from ..runtime.replan import from_env
    if from_env() is not None:
        raise AutoplanRefused(f"--calibrate switches plans through ds_autoplan's plan-independent "
                              f"checkpoint, which DeepSpeed's own engine running {what} does not write: "
                              "launch without --calibrate (or train a PipelineModule)")


def _recorded(initialized: tuple, plan) -> tuple:
    """``deepspeed.initialize``'s return, its engine recording the run (runtime/deepspeed/measure.py)."""
    from ..runtime.deepspeed.measure import record_engine
    record_engine(initialized[0], plan)
    return initialized


def _plan_engine_module(args, model, training_data, collate_fn, config) -> tuple:
    """Plan any module for DeepSpeed's own engine (clients/module_plan.py); the user's config
    with the plan's ZeRO stage and batch split, every replaced value printed, and the plan."""
    from ..emit.deepspeed import ENGINE_KEYS, MERGED_CONFIG, config_precision, user_config
    from ..outputs import json_text
    from ..search.engine_space import recomputes
    from .module_plan import (hf_config, plan_module, say, say_yours, seq_of, shared_plan, write_outputs,
                              yours_note, yours_of)
    user = user_config_of(args, config)
    options = _STATE["options"]

    def make(world, options):
        B = _global_batch(user, world, 1)
        mbs = user.get("train_micro_batch_size_per_gpu")
        yours = yours_of(user, mbs, isinstance(mbs, int) and mbs > 0 and B % (mbs * world) == 0)
        sample, seq = None, None
        if training_data is not None and len(training_data):
            if hf_config(model) is None:
                sample = _sample(training_data, collate_fn, _micro(user))[0]
            else:
                seq = seq_of(training_data[0])
        # AutoTP only where DeepSpeed's own loader batches the data (training_data): it gives a
        # tensor-parallel group the same samples; a script's own sampler may not
        return plan_module(model, global_batch=B, world=world, precision=config_precision(user),
                           options=options, seq=seq, sample=sample, autotp=training_data is not None,
                           yours=yours)
    plan = shared_plan(make, options)
    cfg, changes = user_config(plan, user, ENGINE_KEYS, engine=True)
    write_outputs(plan, {MERGED_CONFIG: json_text(cfg)}, options)
    for line in changes:
        say(f"ds_config {line}")
    say_yours(plan)
    for note in plan.notes:
        if note != yours_note(plan):
            say(f"note: {note}")
    if recomputes(plan):
        model.gradient_checkpointing_enable()
        say("activation checkpointing: called the model's gradient_checkpointing_enable()")
    return cfg, plan


def _micro(user: dict) -> int:
    v = user.get("train_micro_batch_size_per_gpu")
    return int(v) if isinstance(v, int) else 1


# -- the user's side -------------------------------------------------------------------------
def _without_config(args):
    """The script's args without the config path (the merged config is passed instead)."""
    if args is None:
        return None
    a = copy.copy(args)
    for name in ("deepspeed_config", "deepscale_config"):
        if hasattr(a, name):
            setattr(a, name, None)
    return a


def _module_kwargs(m) -> dict:
    """The script's PipelineModule settings that the plan does not decide."""
    return {"seed_layers": m.seed_layers, "seed_fn": m.seed_fn, "base_seed": m.base_seed,
            "activation_checkpoint_func": m.activation_checkpoint_func,
            "checkpointable_layers": m.checkpointable_layers}


def _sample(training_data, collate_fn, mbs: int):
    """One micro-batch of ``training_data`` as DeepSpeed's loader batches it: (inputs, labels)."""
    from torch.utils.data import default_collate
    n = min(mbs, len(training_data))
    batch = (collate_fn or default_collate)([training_data[i] for i in range(n)])
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise AutoplanRefused("training_data must yield (inputs, labels) pairs, as PipelineModule "
                              f"training expects; got a batch of type {type(batch).__name__}")
    return batch[0], batch[1]


def _global_batch(user: dict, world: int, stages: int) -> int:
    """--global-batch, else the config's train_batch_size (or micro-batch x steps x replicas)."""
    if _STATE["options"].get("global_batch"):
        return int(_STATE["options"]["global_batch"])
    if user.get("train_batch_size"):
        return int(user["train_batch_size"])
    mbs, gas = user.get("train_micro_batch_size_per_gpu"), user.get("gradient_accumulation_steps")
    if mbs and gas:
        return int(mbs) * int(gas) * max(1, world // max(1, stages))
    raise AutoplanRefused("no batch size to plan for: set train_batch_size in the DeepSpeed config "
                          "(or --global-batch)")


# -- planning ---------------------------------------------------------------------------------
def plan_pipeline_module(model, user: dict, training_data, collate_fn, world: int, options: dict):
    """The plan for ``model``'s layers (this process profiles them)."""
    from ..emit.deepspeed import config_precision
    from ..plan import Plan
    from ..profile import to_model_spec
    from ..profile.layers import profile_layer_list
    from ..search import SearchOptions, search
    from ..spec import SpecError, load_cluster
    if (options.get("tp") or 1) > 1:
        raise AutoplanRefused(f"{option(options, 'tp', options['tp'])}: a PipelineModule script runs "
                              "in ds_autoplan's pipeline engine, without tensor parallelism")
    if options.get("plan"):
        return Plan.load(options["plan"])
    if training_data is None:
        raise AutoplanRefused(f"cannot profile the script's {len(model._layer_specs)} layers: "
                              "deepspeed.initialize got no training_data to take an example input "
                              "from; pass training_data=, or plan a model description with "
                              "--model (preset, YAML or Hugging Face config.json)")
    B = _global_batch(user, world, model.num_stages)
    name = f"{os.path.basename(sys.argv[0]) or 'script'}:PipelineModule"
    if options.get("profile"):
        prof = _given_profile(options["profile"], model, options)
    else:
        inputs, labels = _sample(training_data, collate_fn, int(user.get("train_micro_batch_size_per_gpu") or 1))
        prof = profile_layer_list(model._layer_specs, inputs, labels, model.loss_fn, name=name)
    if options.get("out") and not options.get("profile"):
        from ..outputs import json_text, write_folder
        write_folder(options["out"], {"profile.json": json_text(prof.to_dict(), indent=1)},
                     complete=False)
    try:
        cluster = load_cluster(options["cluster"])
        res = search(to_model_spec(prof, flops_ref=cluster.flops), cluster, B,
                     options=SearchOptions(precision=config_precision(user), tp=1,
                                           pp=options.get("pp"), schedules=options.get("schedules"),
                                           wide=False, baselines=False, keep_sim=False,
                                           world_size=world,
                                           fix={"offload": options["offload"]} if options.get("offload") else None))
    except SpecError as e:
        given = [option(options, k, options[k]) for k in ("pp", "schedules", "offload") if options.get(k)]
        raise AutoplanRefused(f"planning the script's {len(prof.units)} layers failed: {e}"
                              + (f" (restricted by {', '.join(given)})" if given else "")) from None
    plan = res.plan
    _check_executable(plan, options)
    plan.notes.append("profiled layers: " + ", ".join(u.name for u in prof.units))
    return plan


def _given_profile(path: str, model, options: dict):
    """The profile the user named (``--profile`` / ``DS_AUTOPLAN_PROFILE``: a profile.json an
    earlier launch wrote) instead of measuring the layers again: the same plan for the same
    figures, launch after launch.  Refused in one line when it is not a profile or is of
    other layers (their count and kinds, in order)."""
    from ..profile.layers import layer_name
    from ..profile.profile import Profile, ProfileMismatch
    try:
        prof = Profile.load(path)
    except (OSError, ProfileMismatch) as e:
        raise AutoplanRefused(f"{option(options, 'profile', path)}: {getattr(e, 'strerror', None) or e}") from None
    want = [f"{i}:{layer_name(x)}" for i, x in enumerate(model._layer_specs)]
    got = [u.name for u in prof.units]
    if got != want:
        raise AutoplanRefused(f"{option(options, 'profile', path)} profiles {len(got)} layers "
                              f"({', '.join(got[:3])}, ...), the script's PipelineModule has {len(want)} "
                              f"({', '.join(want[:3])}, ...): profile this script (launch without it)")
    from .module_plan import say
    say(f"profile: the script's {len(got)} layers as {path} measured them "
        f"(on {prof.device.get('name', '?')}), not measured again")
    return prof


def describe(plan) -> str:
    """One line naming a plan: its parallelism, batch split, schedule and partition."""
    return (f"pp={plan.pp} dp={plan.dp} ZeRO-{plan.zero_stage} schedule={plan.schedule} "
            f"micro-batch {plan.micro_batch_size} x {plan.num_microbatches}, layers per stage "
            f"{plan.layers_per_stage}")


def _check_executable(plan, options: dict) -> None:
    """Refuse, naming the plan and the restriction in the user's form, what no DeepSpeed engine
    runs: ZeRO-2/3 with a pipeline (PipelineEngine asserts ZeRO < 2; without a pipeline the
    plain engine runs them, runtime/deepspeed/plain.py)."""
    if plan.pp > 1 and plan.zero_stage > 1:
        raise AutoplanRefused(f"the plan ({describe(plan)}) uses ZeRO-{plan.zero_stage} with a "
                              "pipeline, which DeepSpeed's pipeline engine cannot run; plan it "
                              f"without a pipeline ({option(options, 'pp', 1)})")


def _shared_plan(model, user, training_data, collate_fn):
    """Rank 0 plans; every rank gets the same plan, or the same refusal (never a hang)."""
    from .module_plan import shared_plan
    plan = shared_plan(lambda world, options: plan_pipeline_module(model, user, training_data,
                                                                   collate_fn, world, options),
                       _STATE["options"])
    n = len(model._layer_specs)
    if sum(plan.layers_per_stage) not in (n, n - 2):
        unset = "without --model" if _STATE["options"].get("via") == "launch" else \
            "without DS_AUTOPLAN_MODEL"
        raise AutoplanRefused(f"the plan ({plan.model}: {describe(plan)}) partitions "
                              f"{sum(plan.layers_per_stage)} layers, the script's PipelineModule "
                              f"has {n}: plan this script's model (launch {unset}) or give a "
                              "matching model")
    _check_executable(plan, _STATE["options"])
    return plan


def _report(plan, cfg: dict, changes: list, model) -> None:
    """Rank 0: one summary, the config changes, plan.json and the merged config under ``out``."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    from ..emit.deepspeed import MERGED_CONFIG
    from ..outputs import json_text, text, write_folder
    out = _STATE["options"].get("out") or "ds_autoplan_out"
    try:        # the ranks train from memory: a target changed since the launcher checked it
        write_folder(out, {"plan.json": text(plan.to_json() + "\n"), MERGED_CONFIG: json_text(cfg)},
                     complete=False)                 # is a warning, not a crash of rank 0 alone
    except UserError as e:
        print(f"ds-autoplan: warning: {e}; training goes on without writing them", flush=True)
    from ..emit.deepspeed import runs_plain
    engine = "DeepSpeed's engine (no pipeline)" if runs_plain(plan) else "ds_autoplan's pipeline engine"
    print(f"ds-autoplan: {plan.model} on {plan.cluster}: {describe(plan)}, in {engine} -> "
          f"{os.path.abspath(out)}/plan.json, {MERGED_CONFIG}", flush=True)
    if model.num_stages != plan.pp:
        print(f"ds-autoplan: the script asked for {model.num_stages} pipeline stages; the plan uses "
              f"pp={plan.pp} (restrict it with {option(_STATE['options'], 'pp', model.num_stages)})",
              flush=True)
    for line in changes:
        print(f"ds-autoplan: ds_config {line}", flush=True)
