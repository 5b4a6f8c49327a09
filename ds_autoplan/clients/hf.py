"""``deepspeed --autoplan`` for Hugging Face ``Trainer`` and Accelerate scripts (docs/huggingface.md).

Both stacks fix the micro-batch and the accumulation before DeepSpeed sees the model: the
``Trainer`` builds its data loader from ``TrainingArguments`` and checks the DeepSpeed config
against them when the arguments are made; Accelerate's ``prepare`` batches the data loaders and
fills the config's ``auto`` fields from them, then calls ``deepspeed.initialize``.  So the plan
is made where the model and the batch first meet:

* ``Trainer(model, args, ...)``: before its ``__init__`` runs, the model is planned for
  ``args``' global batch (``per_device_train_batch_size x gradient_accumulation_steps x world``),
  the plan's values are set in ``args`` (``per_device_train_batch_size``,
  ``gradient_accumulation_steps``, ``gradient_checkpointing``) and in the DeepSpeed config
  (ZeRO stage; batch keys the user wrote as numbers; ``auto`` ones stay for the Trainer to fill),
  and the arguments' DeepSpeed set-up is made again from them, as ``TrainingArguments`` makes it;
* ``Accelerator.prepare(model, optimizer, dataloader, ...)`` under DeepSpeed: the model is
  planned for the loader's batch x accumulation x world, the loader re-batched to the plan's
  micro-batch, the accumulation (always: Accelerate reads a number there over its own) and the
  ZeRO stage set in the plugin's config, and checkpointing
  switched on with the model's ``gradient_checkpointing_enable()``.

Every replaced value is printed; the user's optimizer, scheduler and precision stay.  The module
then reaches ``deepspeed.initialize`` already planned and goes through unchanged.

Several CPU ranks: Accelerate (1.15, ``PartialState._prepare_backend``) finds a distributed
backend only for accelerators (CUDA, XPU, NPU, ...) or with ``cpu=True``, which turns DeepSpeed
off (``AcceleratorState``: DeepSpeed only ``and not cpu``); a CPU-only rank launched by DeepSpeed
therefore counts a world of 1.  On a host without CUDA the hook gives those ranks the backend
DeepSpeed's CPU accelerator communicates with (gloo, or ccl), as Accelerate's own multi-CPU
mode does, and DeepSpeed stays on.

The hooks are installed when the script imports the modules (an import hook), so a script that
uses neither pays nothing.
"""
from __future__ import annotations

import copy
import importlib.abc
import importlib.util
import os
import sys

from .module_plan import AutoplanRefused, say, say_yours, yours_of

_HOOKED: dict = {"active": {}, "seen": set()}


def install(state: dict) -> None:
    """Patch ``Trainer.__init__``, ``Accelerator.prepare`` and (without CUDA) Accelerate's
    backend choice as their modules are imported; ``state``: the deepspeed hook's (options,
    the ids of the planned modules)."""
    _HOOKED["state"] = state
    _activate(_PATCHES)


def install_cpu_ranks() -> None:
    """Only the several-CPU-ranks fix (module docstring), for a script run without
    ``--autoplan`` on CPU ranks: ``import ds_autoplan.clients.hf as h; h.install_cpu_ranks()``
    before Accelerate or transformers is imported (docs/huggingface.md)."""
    _activate({"accelerate.state": _patch_state})


def _activate(patches: dict) -> None:
    _HOOKED["active"].update(patches)
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Runs the patch of an active module right after the module executes."""

    def find_spec(self, name, path, target=None):
        if name not in _HOOKED["active"] or name in _HOOKED["seen"]:
            return None
        _HOOKED["seen"].add(name)                 # the real finders answer, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            _HOOKED["active"][name](module)
        spec.loader.exec_module = patched
        return spec


# -- several CPU ranks --------------------------------------------------------------------------
def _patch_state(mod) -> None:
    import torch
    if torch.cuda.is_available() or getattr(mod.PartialState, "_ds_autoplan", False):
        return
    from accelerate.utils import DistributedType
    original = mod.PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        b, kind = original(self, cpu, sagemaker_dp, backend)
        if b is None and kind == DistributedType.NO and not cpu and \
                int(os.environ.get("LOCAL_RANK", -1)) != -1 and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            from deepspeed.accelerator import get_accelerator
            return get_accelerator().communication_backend_name(), DistributedType.MULTI_CPU
        return b, kind
    mod.PartialState._prepare_backend = _prepare_backend
    mod.PartialState._ds_autoplan = True


# -- Trainer --------------------------------------------------------------------------------------
def _patch_trainer(mod) -> None:
    cls = mod.Trainer
    if getattr(cls.__init__, "_ds_autoplan", False):
        return
    original = cls.__init__

    def __init__(self, model=None, args=None, *a, **kw):
        if model is not None and args is not None and getattr(args, "deepspeed", None) and \
                id(model) not in _HOOKED["state"]["planned"]:
            data = kw.get("train_dataset", a[1] if len(a) > 1 else None)
            plan_trainer(model, args, data)
        original(self, model, args, *a, **kw)
    __init__._ds_autoplan = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__


def plan_trainer(model, args, train_dataset) -> None:
    """Plan ``model`` for the Trainer's ``args`` and set the plan's values (module docstring)."""
    from ..emit.deepspeed import MERGED_CONFIG, config_precision
    from ..emit.hf import args_line, training_args
    from ..outputs import json_text
    from .module_plan import out_dir, plan_module, seq_of, shared_plan, user_config_of, write_outputs
    state = _HOOKED["state"]
    options = state["options"]
    filled = args.hf_deepspeed_config.config          # the user's config, `auto` filled from args
    world = args.world_size
    dp = world // max(1, int(_get(filled, "tensor_parallel.autotp_size") or 1))   # the user's AutoTP
    B = options.get("global_batch") or \
        args.per_device_train_batch_size * args.gradient_accumulation_steps * dp
    seq = seq_of(_first(train_dataset))
    mbs, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    yours = yours_of(filled, mbs, mbs * gas * dp == B, recompute=bool(args.gradient_checkpointing))
    plan = shared_plan(lambda w, opts: plan_module(model, global_batch=int(B), world=w,
                                                   precision=config_precision(filled), options=opts,
                                                   seq=seq, yours=yours), options)
    say_yours(plan)
    user = user_config_of(None, copy.deepcopy(args.deepspeed))
    cfg = _set_plan_keys(plan, user, "ds_config")
    values = training_args(plan)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing"):
        if getattr(args, key) != values[key]:
            say(f"TrainingArguments.{key}: {getattr(args, key)!r} -> {values[key]!r}")
            setattr(args, key, values[key])
    # the arguments' DeepSpeed set-up, made again from the changed values as TrainingArguments'
    # __post_init__ makes it (its fill-and-match checks included)
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    args.deepspeed = cfg
    args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(cfg)
    args.hf_deepspeed_config.trainer_config_process(args)
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)
    write_outputs(plan, {MERGED_CONFIG: json_text(cfg), "training_args.json": json_text(values)}, options)
    say(f"by hand: {args_line(plan, os.path.join(out_dir(options), MERGED_CONFIG))}")
    state["planned"][id(model)] = plan


def _first(data):
    try:
        return data[0] if data is not None and len(data) else None
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


def _set_plan_keys(plan, user: dict, where: str, always=()) -> dict:
    """``user`` with the plan's engine keys set where the user wrote a value (``auto`` ones stay
    for the stack to fill, but those in ``always``), each replaced value printed."""
    from ..emit.deepspeed import ENGINE_KEYS, user_config
    keys = [k for k in ENGINE_KEYS if k in always or _get(user, k) != "auto"]
    cfg, changes = user_config(plan, user, keys, engine=True)
    for line in changes:
        say(f"{where} {line}")
    return cfg


def _get(cfg: dict, key: str):
    from ..emit.deepspeed import config_value
    return config_value(cfg, key, None)


# -- Accelerate -------------------------------------------------------------------------------------
def _patch_accelerator(mod) -> None:
    cls = mod.Accelerator
    if getattr(cls.prepare, "_ds_autoplan", False):
        return
    original = cls.prepare

    def prepare(self, *args, **kw):
        from accelerate.utils import DistributedType
        if self.state.distributed_type == DistributedType.DEEPSPEED:
            args = plan_accelerate(self, list(args))
        return original(self, *args, **kw)
    prepare._ds_autoplan = True
    prepare.__wrapped__ = original
    cls.prepare = prepare


def plan_accelerate(acc, objs: list) -> list:
    """Plan the module among ``objs`` for the loader's batch and set the plan's values (module
    docstring); returns the objects with the loaders re-batched."""
    import torch
    from torch.utils.data import DataLoader

    from ..emit.deepspeed import MERGED_CONFIG, config_precision
    from ..emit.hf import training_args
    from ..outputs import json_text
    from ..search.engine_space import recomputes
    from .module_plan import plan_module, seq_of, shared_plan, write_outputs
    state = _HOOKED["state"]
    models = [o for o in objs if isinstance(o, torch.nn.Module) and id(o) not in state["planned"]]
    if not models:
        return objs
    if len(models) > 1:
        raise AutoplanRefused(f"Accelerator.prepare got {len(models)} models; --autoplan plans one")
    model = models[0]
    loaders = [o for o in objs if isinstance(o, DataLoader)]
    plugin = acc.state.deepspeed_plugin
    conf = plugin.deepspeed_config
    mbs = _get(conf, "train_micro_batch_size_per_gpu")
    if not isinstance(mbs, int):
        mbs = loaders[0].batch_size if loaders and loaders[0].batch_size else None
    if mbs is None:
        raise AutoplanRefused("no micro-batch to plan for: pass the training DataLoader to "
                            "Accelerator.prepare with the model, or set train_micro_batch_size_per_gpu")
    gas = _get(conf, "gradient_accumulation_steps")
    gas = gas if isinstance(gas, int) else acc.gradient_accumulation_steps
    world = acc.num_processes
    B = state["options"].get("global_batch") or mbs * gas * world
    seq = seq_of(_first(loaders[0].dataset)) if loaders else None
    # no AutoTP: Accelerate's DataLoader preparation is not verified to give a tensor-parallel
    # group the same batches (docs/huggingface.md)
    yours = yours_of(conf, mbs, mbs * gas * world == B)
    plan = shared_plan(lambda w, opts: plan_module(model, global_batch=int(B), world=w,
                                                   precision=config_precision(conf), options=opts,
                                                   seq=seq, autotp=False, yours=yours), state["options"])
    say_yours(plan)
    # Accelerate takes a number in the config over its own accumulation ('auto': its own)
    cfg = _set_plan_keys(plan, conf, "ds_config", always=("gradient_accumulation_steps",))
    conf.clear()                # in place: the plugin's HfDeepSpeedConfig holds this dict
    conf.update(cfg)
    out = []
    for o in objs:
        if isinstance(o, DataLoader) and o.batch_size not in (None, plan.micro_batch_size):
            say(f"DataLoader batch_size: {o.batch_size} -> {plan.micro_batch_size}")
            o = DataLoader(o.dataset, batch_size=plan.micro_batch_size, sampler=o.sampler,
                           num_workers=o.num_workers, collate_fn=o.collate_fn, pin_memory=o.pin_memory,
                           drop_last=o.drop_last, timeout=o.timeout, worker_init_fn=o.worker_init_fn,
                           generator=o.generator)
        out.append(o)
    if recomputes(plan):
        model.gradient_checkpointing_enable()
        say("activation checkpointing: called the model's gradient_checkpointing_enable()")
    write_outputs(plan, {MERGED_CONFIG: json_text(cfg), "training_args.json": json_text(training_args(plan))},
                  state["options"])
    state["planned"][id(model)] = plan
    return out


_PATCHES = {"accelerate.state": _patch_state, "transformers.trainer": _patch_trainer,
            "accelerate.accelerator": _patch_accelerator}
