"""Save / resume a DeepSpeed pipeline run under any other plan.

    engine.save_checkpoint("ckpt", client_state={"epoch": 3})    # every rank, after train_batch
    engine_b, *_ = ds_autoplan.initialize(layers, plan_b, ...)   # another schedule, pp, dp, ZeRO
    path, client_state = engine_b.load_checkpoint("ckpt")         # every rank, before training

The engine's methods keep DeepSpeed's signature and layout (``ckpt/<tag>/``, ``ckpt/latest``,
:func:`engine_save` / :func:`engine_load`); :func:`save_checkpoint` / :func:`load_checkpoint`
read and write one folder.

DeepSpeed 0.19.8's own pieces are used where they are plan-independent:
* weights: ``PipelineModule.save_state_dict`` / ``load_state_dir`` already write one file per
  *global* layer (``layer_XX-model_00-model_states.pt``), on data-parallel rank 0;
* optimizer state: DeepSpeed's own ``mp_rank_*``/``zero_pp_rank_*`` files are positional
  (parameter groups of the saving rank) -- the "parameter group that doesn't match the size of
  optimizer's group" error of a V-Half -> 1F1B resume.  Its *universal checkpoint* is keyed by
  parameter name but needs the offline ``ds_to_universal`` conversion and a ZeRO (>= 1) or bf16
  optimizer to load; ZeRO-0 runs have none.  So the state is written per global layer by us,
  through DeepSpeed's per-parameter fragment API (``deepspeed.utils.safe_get_full_*`` /
  ``safe_set_full_*``: the full fp32 master and optimizer state of one parameter, gathered
  across the ZeRO partitions), next to DeepSpeed's layer files
  (:func:`ds_autoplan.runtime.checkpoint.state_path`).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from deepspeed.utils import logger

from ..checkpoint import (META, CheckpointError, apply_rank_state, load_scheduler,
                          load_train_state, rank_state_source, read_meta, read_rank_state,
                          restore_param_groups, save_rank_state, save_train_state, state_path,
                          write_meta)
from ..checkpoint_files import (SafeFiles, agree, read_latest, resolve, safe_load, save_atomically,
                                torch_save, verify_before_load, write_latest)

MASTER = "fp32"      # key of the fp32 master weight in a parameter's saved state


def _zero_optimizer(engine):
    """DeepSpeed's ZeRO-1/2 optimizer or its BF16_Optimizer (bf16 under ZeRO-0/1: fp32 masters
    kept as flat partitions, linked to the parameters like ZeRO's), or None for a plain torch
    optimizer (ZeRO-0, fp32)."""
    opt = engine.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        return None
    if _flat_masters(opt) is not None:
        return opt
    raise CheckpointError(f"optimizer {type(opt).__name__} is not supported by ds_autoplan "
                          "checkpoints yet (fp32 with ZeRO 0/1/2 and bf16 with ZeRO 0/1 are)")


def _flat_masters(opt):
    """The flat fp32 master partitions, one per parameter group: ZeRO-1/2's
    ``single_partition_of_fp32_groups``, BF16_Optimizer's ``fp32_groups_flat_partition``."""
    if hasattr(opt, "single_partition_of_fp32_groups") and hasattr(opt, "bit16_groups"):
        return opt.single_partition_of_fp32_groups
    if hasattr(opt, "fp32_groups_flat_partition") and hasattr(opt, "bf16_groups"):
        return opt.fp32_groups_flat_partition
    return None


def _params(engine):
    """``(global layer, name, parameter)`` of this rank's layers, in layer order."""
    return [(i, n, p) for i, layer in engine.module.local_layers()
            if isinstance(layer, torch.nn.Module) for n, p in layer.named_parameters()]


def _state_keys(zero) -> tuple[list, dict]:
    """(per-element state keys, scalar state such as Adam's ``step``) of a ZeRO optimizer;
    the same on every data-parallel rank."""
    keys, scalars = set(), {}
    for st in zero.optimizer.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                keys.add(k)
            else:
                scalars[k] = v
    return sorted(keys), scalars


def _saved_state(engine, zero, p, keys, scalars) -> dict:
    """One parameter's full fp32 master and optimizer state (collective over the dp group
    under ZeRO: every data-parallel rank calls it in the same order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if zero is None:
        return {MASTER: p.detach().clone(), **_copied(engine.optimizer.state.get(p, {}))}
    return {MASTER: safe_get_full_fp32_param(p), **_copied(scalars),
            **{k: safe_get_full_optimizer_state(p, k) for k in keys}}


def _copied(state: dict) -> dict:
    """Own copies: a state tensor shared between parameters (ZeRO's one ``step`` per flat
    group) would be advanced once per parameter by torch's optimizers after loading."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def save_checkpoint(engine, save_dir, step: int | None = None, plan=None, client_state=None) -> None:
    """Write ``engine``'s weights, fp32 masters and optimizer state, keyed by global layer, its
    learning-rate scheduler, step counters, random generators (per rank) and ``client_state``
    (each rank its own), and the plan it runs (call on every rank).  ``save_dir`` appears
    complete or not at all, and an existing one stays intact until the new copy is complete
    (:func:`ds_autoplan.runtime.checkpoint_files.save_atomically`)."""
    mod = engine.module
    if not hasattr(mod, "local_layers"):
        raise CheckpointError("save_checkpoint needs an engine from ds_autoplan.initialize")
    zero = _zero_optimizer(engine)           # refuses an unsupported optimizer before writing
    keys, scalars = _state_keys(zero) if zero is not None else ([], {})
    per_layer: dict = {}
    for i, name, p in _params(engine):       # collective under ZeRO: before any file is written
        per_layer.setdefault(i, {})[name] = _saved_state(engine, zero, p, keys, scalars)

    def write(folder):
        mod.save_state_dict(folder, checkpoint_engine=SafeFiles(engine.checkpoint_engine))
        if engine.grid.data_parallel_id == 0:
            for i, states in per_layer.items():
                torch_save(states, state_path(folder, i))
        save_rank_state(folder, client_state)
        if dist.get_rank() == 0:
            save_train_state(folder, scheduler=engine.lr_scheduler, optimizer=engine.optimizer)
            write_meta(folder, framework="deepspeed",
                       step=engine.global_steps if step is None else step,
                       plan=plan if plan is not None else engine._config.pipeline.get("autoplan"),
                       num_layers=len(mod._layer_specs), optimizer=engine.optimizer,
                       scheduler=engine.lr_scheduler,
                       counters={"global_samples": engine.global_samples,
                                 "skipped_steps": engine.skipped_steps})
    save_atomically(save_dir, write)


def _restore_zero(zero, saved, params, with_state: bool) -> None:
    """Fill every parameter's fp32 master fragment from the full saved tensors and, with
    ``with_state``, create the ZeRO optimizer's flat state, link its per-parameter fragments
    (as DeepSpeed does after its first step) and fill them too."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    sample = next(iter(saved.values()))
    keys = []
    if with_state:
        keys = [k for k, v in sample.items() if k != MASTER and torch.is_tensor(v) and v.dim() > 0]
        scalars = {k: v for k, v in sample.items() if k != MASTER and k not in keys}
        for flat in _flat_masters(zero):
            st = zero.optimizer.state[flat]
            st.update({k: torch.zeros_like(flat) for k in keys})
            st.update(_copied(scalars))
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    for key_, p in params:
        safe_set_full_fp32_param(p, saved[key_][MASTER])
        for k in keys:
            safe_set_full_optimizer_state(p, saved[key_][k], k)


def _restore_plain(optimizer, saved, params, with_state: bool) -> None:
    """ZeRO-0: the parameters are the fp32 masters; the optimizer state is per parameter."""
    for key_, p in params:
        st = saved[key_]
        with torch.no_grad():
            p.copy_(st[MASTER])
        if with_state:
            optimizer.state[p] = _copied({k: v for k, v in st.items() if k != MASTER})


def _read_states(engine, load_dir) -> dict:
    """This rank's saved per-layer states, ``{(layer, name): state}``."""
    saved = {}
    for i, name, _ in _params(engine):
        if i not in saved:
            saved[i] = safe_load(state_path(load_dir, i))
        if not isinstance(saved[i], dict) or name not in saved[i]:
            raise CheckpointError(f"{state_path(load_dir, i)}: no state for parameter {name!r} "
                                  f"of layer {i}")
    return {(i, n): s for i, states in saved.items() for n, s in states.items()}


def _read_weights(mod, load_dir) -> dict:
    """The layer files DeepSpeed's ``load_state_dir`` will ask for (every local chunk), read
    now with :func:`safe_load`."""
    out = {}

    def read():
        for idx, layer in enumerate(mod.forward_funcs):
            if not hasattr(layer, "load_state_dict"):
                continue
            paths = mod.ckpt_layer_path_list(load_dir, idx)
            if not paths:
                raise CheckpointError(f"{load_dir}: no weights file for layer "
                                      f"{idx + mod._local_start} (layer_{idx + mod._local_start:02d}"
                                      "-*model_states.pt)")
            out.update((path, safe_load(path)) for path in paths)
    mod._each_chunk(read)
    return out


def _read_all(engine, load_dir, meta, module_only: bool) -> dict:
    """Every file this rank's load needs, read without running code before anything is
    applied: all ranks agree on success first, so one bad file stops every rank with the
    same line instead of leaving the others waiting in a collective."""
    exc, out = None, {}
    try:
        out["weights"] = _read_weights(engine.module, load_dir)
        out["states"] = _read_states(engine, load_dir)
        if not module_only:
            out["train"] = load_train_state(load_dir)
            out["rng_from_rank"] = rank_state_source(meta)
            out["rank"] = read_rank_state(load_dir, out["rng_from_rank"])
    except CheckpointError as e:
        exc = e
    agree(exc, f"cannot load {load_dir}")
    return out


def _params_of(engine) -> list:
    """``[((layer, name), parameter)]`` of this rank."""
    return [((i, name), p) for i, name, p in _params(engine)]


def _restore_training(engine, files, meta, optimizer_states: bool, lr_scheduler_states: bool,
                      load_dir) -> dict:
    """Parameter-group hyperparameters (with the optimizer state, as DeepSpeed's
    ``optimizer.load_state_dict`` restores them), scheduler, step counters and this rank's
    state (generators; returns its ``client_state``)."""
    train = files["train"]
    if optimizer_states:
        restore_param_groups(engine.optimizer, train["param_groups"], load_dir)
    if lr_scheduler_states:
        load_scheduler(engine.lr_scheduler, train, load_dir)
    counters = meta.get("counters") or {}
    engine.global_steps = meta["step"]
    engine.global_samples = counters.get("global_samples", meta["step"] * engine.train_batch_size())
    engine.skipped_steps = counters.get("skipped_steps", 0)
    meta["rng_from_rank"] = files["rng_from_rank"]
    return apply_rank_state(files["rank"])


def load_checkpoint(engine, load_dir, *, optimizer_states: bool = True,
                    lr_scheduler_states: bool = True, module_only: bool = False) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` under any plan for the same model
    into ``engine`` (call on every rank, before training).  Returns the checkpoint's metadata
    (``meta["plan"]``: the plan it was saved under; ``meta["client_state"]``).

    Weights, fp32 masters, optimizer state, the learning-rate scheduler (with the parameter
    groups' lr as it left them) and the step counters (``global_steps``, ``global_samples``,
    ``skipped_steps``) continue exactly under any plan.  Random generators: each rank continues
    saved rank ``rank % saved world size`` (:func:`ds_autoplan.runtime.checkpoint.rank_state_source`):
    dropout is reproduced exactly under the same plan only.  ``module_only``: weights and fp32
    masters only (a warm start: no optimizer, scheduler, counters or generators)."""
    mod = engine.module
    load_dir = resolve(load_dir)
    meta = read_meta(load_dir, framework="deepspeed", num_layers=len(mod._layer_specs))
    zero = _zero_optimizer(engine)
    verify_before_load(load_dir)
    files = _read_all(engine, load_dir, meta, module_only)
    mod.load_state_dir(load_dir, checkpoint_engine=SafeFiles(engine.checkpoint_engine,
                                                              files["weights"]))   # strict: same model
    params = _params_of(engine)
    with_state = optimizer_states and not module_only
    if zero is not None:
        _restore_zero(zero, files["states"], params, with_state)
    else:
        _restore_plain(engine.optimizer, files["states"], params, with_state)
    meta["client_state"] = {} if module_only else \
        _restore_training(engine, files, meta, optimizer_states, lr_scheduler_states, load_dir)
    dist.barrier()
    return meta


# -- DeepSpeed's engine API: tag sub-folders and the ``latest`` file -------------------------

def engine_save(engine, save_dir, tag=None, client_state=None, save_latest=True,
                exclude_frozen_parameters=False) -> bool:
    """``AutoplanEngine.save_checkpoint``: DeepSpeed's signature and folder layout
    (``save_dir/<tag>``, default tag ``global_step<N>``, ``save_dir/latest`` naming it), the
    checkpoint in it plan-independent (:func:`save_checkpoint`)."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    if exclude_frozen_parameters:
        raise CheckpointError("exclude_frozen_parameters=True is not supported by ds_autoplan "
                              "checkpoints: every parameter is saved")
    if engine.checkpoint_engine.is_decoupled():
        raise CheckpointError(f"{type(engine.checkpoint_engine).__name__} (a decoupled, "
                              "asynchronous checkpoint engine) is not supported by ds_autoplan "
                              "checkpoints; use DeepSpeed's default checkpoint engine")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    engine._checkpoint_tag_validation(tag)      # DeepSpeed's: the same tag on every rank
    if tag in ("", ".", "..") or os.sep in tag:
        raise CheckpointError(f"checkpoint tag {tag!r}: a tag is one folder name (no {os.sep!r})")
    save_checkpoint(engine, os.path.join(save_dir, tag), client_state=client_state)
    exc = None
    if save_latest and dist.get_rank() == 0:
        try:                                    # only once the tag is complete, atomically
            write_latest(save_dir, tag)
        except OSError as e:
            exc = CheckpointError(f"cannot write {os.path.join(save_dir, 'latest')}: {e}")
    agree(exc, "saving the checkpoint's latest file failed")
    return True


def _tagged_dir(load_dir, tag):
    """The folder ``engine_load`` reads: ``load_dir/tag``, else the tag in ``load_dir/latest``,
    else ``load_dir`` itself when :func:`save_checkpoint` wrote it; None when there is none."""
    if tag is not None:
        return resolve(os.path.join(load_dir, str(tag)))
    tag = read_latest(load_dir)
    if tag is not None:
        path = resolve(os.path.join(load_dir, tag))
        if not os.path.isdir(path):
            raise CheckpointError(f"{os.path.join(load_dir, 'latest')} names {tag!r}, which is not "
                                  f"a checkpoint folder in {load_dir}")
        return path
    return load_dir if os.path.isfile(os.path.join(load_dir, META)) else None


def _refuse_native(path) -> None:
    """A folder DeepSpeed's own ``save_checkpoint`` wrote (``mp_rank_*``) is positional."""
    if not os.path.isfile(os.path.join(path, META)) and os.path.isdir(path) \
            and any(f.startswith("mp_rank_") for f in os.listdir(path)):
        raise CheckpointError(f"{path} is a checkpoint of DeepSpeed's own engine: its optimizer "
                              "state is stored by position in the saving plan's parameter groups "
                              "and cannot be loaded under a ds_autoplan plan; save it with the "
                              "engine ds_autoplan.initialize returns")


def engine_load(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """``AutoplanEngine.load_checkpoint``: DeepSpeed's signature and return value
    ``(load_path, client_state)``, ``(None, None)`` with a warning when ``load_dir`` has no
    ``latest`` file and no tag is given (as DeepSpeed), under any plan (:func:`load_checkpoint`)."""
    if custom_load_fn is not None:
        raise CheckpointError("custom_load_fn is not supported by ds_autoplan checkpoints")
    if not load_module_strict:
        raise CheckpointError("load_module_strict=False is not supported by ds_autoplan "
                              "checkpoints: the checkpoint must be of the same model")
    path = _tagged_dir(load_dir, tag)
    if path is None:
        logger.warning(f"Unable to find latest file at {os.path.join(load_dir, 'latest')}, if "
                       "trying to load latest checkpoint please ensure this file exists or pass "
                       "an explicit checkpoint tag when loading a checkpoint.")
        return None, None
    _refuse_native(path)
    meta = load_checkpoint(engine, path, optimizer_states=load_optimizer_states,
                           lr_scheduler_states=load_lr_scheduler_states, module_only=load_module_only)
    return path, meta["client_state"]


__all__ = ["engine_load", "engine_save", "load_checkpoint", "save_checkpoint"]
