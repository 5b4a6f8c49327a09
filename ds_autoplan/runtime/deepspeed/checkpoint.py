"""Save / resume a DeepSpeed pipeline run under any other plan (issue 13, item 6).

    save_checkpoint(engine, "ckpt")        # every rank, after train_batch
    engine_b, *_ = ds_autoplan.initialize(layers, plan_b, ...)   # another schedule, pp, dp, ZeRO
    load_checkpoint(engine_b, "ckpt")      # every rank, before training

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

from ..checkpoint import CheckpointError, read_meta, state_path, write_meta

MASTER = "fp32"      # key of the fp32 master weight in a parameter's saved state


def _zero_optimizer(engine):
    """DeepSpeed's ZeRO-1/2 optimizer, or None for a plain torch optimizer (ZeRO-0, fp32)."""
    opt = engine.optimizer
    if isinstance(opt, torch.optim.Optimizer):
        return None
    if hasattr(opt, "single_partition_of_fp32_groups") and hasattr(opt, "bit16_groups"):
        return opt
    raise CheckpointError(f"optimizer {type(opt).__name__} is not supported by ds_autoplan "
                          "checkpoints yet (fp32 with ZeRO 0/1/2 is)")


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


def save_checkpoint(engine, save_dir, step: int | None = None, plan=None) -> None:
    """Write ``engine``'s weights, fp32 masters and optimizer state, keyed by global layer, and
    the plan it runs (call on every rank)."""
    mod = engine.module
    if not hasattr(mod, "local_layers"):
        raise CheckpointError("save_checkpoint needs an engine from ds_autoplan.initialize")
    os.makedirs(save_dir, exist_ok=True)
    mod.save_state_dict(save_dir, checkpoint_engine=engine.checkpoint_engine)   # DeepSpeed's files
    zero = _zero_optimizer(engine)
    keys, scalars = _state_keys(zero) if zero is not None else ([], {})
    per_layer: dict = {}
    for i, name, p in _params(engine):
        per_layer.setdefault(i, {})[name] = _saved_state(engine, zero, p, keys, scalars)
    if engine.grid.data_parallel_id == 0:
        for i, states in per_layer.items():
            torch.save(states, state_path(save_dir, i))
    if dist.get_rank() == 0:
        write_meta(save_dir, framework="deepspeed", step=engine.global_steps if step is None else step,
                   plan=plan if plan is not None else engine._config.pipeline.get("autoplan"),
                   num_layers=len(mod._layer_specs), optimizer=engine.optimizer)
    dist.barrier()


def _restore_zero(zero, saved, params) -> None:
    """Create the ZeRO optimizer's flat state, link its per-parameter fragments (as DeepSpeed
    does after its first step) and fill every fragment from the full saved tensors."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    sample = next(iter(saved.values()))
    keys = [k for k, v in sample.items() if k != MASTER and torch.is_tensor(v) and v.dim() > 0]
    scalars = {k: v for k, v in sample.items() if k != MASTER and k not in keys}
    for flat in zero.single_partition_of_fp32_groups:
        st = zero.optimizer.state[flat]
        st.update({k: torch.zeros_like(flat) for k in keys})
        st.update(_copied(scalars))
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    for key_, p in params:
        safe_set_full_fp32_param(p, saved[key_][MASTER])
        for k in keys:
            safe_set_full_optimizer_state(p, saved[key_][k], k)


def load_checkpoint(engine, load_dir) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` under any plan for the same model
    into ``engine`` (call on every rank, before training).  Returns the checkpoint's metadata
    (``meta["plan"]`` is the plan it was saved under)."""
    mod = engine.module
    meta = read_meta(load_dir, framework="deepspeed", num_layers=len(mod._layer_specs))
    mod.load_state_dir(load_dir, checkpoint_engine=engine.checkpoint_engine)    # strict: same model
    saved, params = {}, []
    for i, name, p in _params(engine):
        if i not in saved:
            saved[i] = torch.load(state_path(load_dir, i), weights_only=False)
        if name not in saved[i]:
            raise CheckpointError(f"{load_dir}: layer {i} has no state for parameter {name!r}")
        params.append(((i, name), p))
    flat_saved = {(i, n): s for i, states in saved.items() for n, s in states.items()}
    zero = _zero_optimizer(engine)
    if zero is not None:
        _restore_zero(zero, flat_saved, params)
    else:
        for key_, p in params:
            st = flat_saved[key_]
            with torch.no_grad():
                p.copy_(st[MASTER])
            engine.optimizer.state[p] = _copied({k: v for k, v in st.items() if k != MASTER})
    engine.global_steps = meta["step"]
    dist.barrier()
    return meta


__all__ = ["load_checkpoint", "save_checkpoint"]
