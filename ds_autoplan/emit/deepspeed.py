"""Plan -> ds_config.json (docs/runtimes.md §3), validated by DeepSpeed's own config classes.

``ds_config(plan)`` is the one Plan -> DeepSpeed config path: ``ds-autoplan plan`` writes it
and ``ds_autoplan.initialize`` runs it (merged with the user's own keys, if any)."""
from __future__ import annotations

import contextlib
import copy

from ..plan import Plan


def runs_plain(plan) -> bool:
    """Whether ``plan`` runs in DeepSpeed's plain engine: ZeRO-2/3 without a pipeline
    (``PipelineEngine`` asserts ZeRO < 2)."""
    return plan.pp == 1 and plan.zero_stage > 1


def ds_config(plan: Plan, engine: bool = False) -> dict:
    """The DeepSpeed config of ``plan``.  ZeRO 2/3 only without pipeline parallelism
    (PipelineEngine asserts ZeRO < 2).  The plan itself (partition, schedule, per-stage
    recompute: what DeepSpeed has no key for) is ``pipeline.autoplan``; DeepSpeed keeps the
    ``pipeline`` section as given and the engine reads it back from there.
    ``pipeline.activation_checkpoint_interval`` is 0: DeepSpeed's switch is global, the
    ds_autoplan runtime recomputes per stage (``recompute_per_stage``).  ``engine``: the config
    of DeepSpeed's own engine running a module by itself (search/engine_space.py), whose tensor
    parallelism is AutoTP (``tensor_parallel.autotp_size``)."""
    par = plan.parallel
    if par.pp > 1 and par.zero > 1:
        raise ValueError(f"ZeRO stage {par.zero} cannot run with pipeline parallelism "
                         f"(pp={par.pp}) in DeepSpeed")
    cfg = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": par.num_microbatches,
        "zero_optimization": {"stage": par.zero},
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        # cpu_checkpointing: DeepSpeed's checkpoint function keeps its inputs in host memory
        # (docs/offload.md §2: read by deepspeed.checkpointing.configure, not by the engines)
        "activation_checkpointing": {"partition_activations": False,
                                     "contiguous_memory_optimization": False,
                                     "cpu_checkpointing": par.offload.activations},
        "pipeline": {"activation_checkpoint_interval": 0, "stages": par.pp,
                     "partition": "autoplan", "autoplan": plan.to_dict()},
    }
    if plan.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif plan.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if par.cp > 1:
        # DeepSpeed-Ulysses (deepspeed.sequence.layer.DistributedAttention): DeepSpeedConfig
        # reads this key only to size the data-parallel world when no mpu is given; the
        # engine's degree is that of the sequence-parallel process group (docs/planner.md §2.7)
        cfg["sequence_parallel_size"] = par.cp
    if par.zero >= 1:
        cfg["zero_optimization"].update({"overlap_comm": True, "contiguous_gradients": True})
    if par.offload.states:
        cfg["zero_optimization"].update(offload_section(plan))
    if engine and par.tp > 1:
        # DeepSpeed's AutoTP training (search/engine_space.py).  train_batch_size is left for
        # DeepSpeed to derive: its config counts every rank as data-parallel without an mpu
        # (micro x steps x world) but, under ZeRO-3, zero.Init parses the config again with the
        # TP groups (micro x steps x dp); a number fits one of the two (0.19.8, measured)
        cfg["tensor_parallel"] = {"autotp_size": par.tp}
        del cfg["train_batch_size"]
    return cfg


# where an NVMe offload swaps to: DeepSpeed needs a path on the node's local NVMe (the
# ZeRO-Infinity tutorial's example); the report tells the user to set it
NVME_PATH = "/local_nvme"
# sub-groups a ZeRO-3 partition is split into when only a ratio of it is offloaded: DeepSpeed
# 0.19.8 offloads the sub-groups i >= int((1 - ratio) n) (stage3.py), so n sets the step of the
# ratio (1/20: 5%) [decision]
RATIO_SUB_GROUPS = 20


def offload_section(plan: Plan) -> dict:
    """The ``zero_optimization`` keys of the plan's offload (docs/offload.md §4): the optimizer
    (``device``, pinned buffers, Twin-Flow's ``ratio`` with a ``sub_group_size`` that makes it
    apply) and ZeRO-3's parameters (``offload_param``); NVMe through :data:`NVME_PATH`."""
    off = plan.parallel.offload
    out = {}
    where = {"device": off.device, "pin_memory": True}
    if off.device == "nvme":
        where["nvme_path"] = NVME_PATH
    if off.optimizer:
        out["offload_optimizer"] = dict(where)
        if off.optimizer < 1:
            out["offload_optimizer"]["ratio"] = off.optimizer
            n = _partition_params(plan)
            if n:
                out["sub_group_size"] = max(1, -(-n // RATIO_SUB_GROUPS))
    if off.params:
        out["offload_param"] = dict(where)
    return out


def _partition_params(plan: Plan) -> int:
    """Parameters of one rank's ZeRO partition (the model's total over tp x pp x dp; 0 where
    the model is not a preset)."""
    from ..spec import SpecError
    from ..spec.model import load_model
    try:
        m = load_model(plan.model, plan.seq_len or None)
    except (SpecError, OSError):
        return 0
    return int(m.total_params // (plan.tp * plan.pp * plan.dp))


# the file name of the config a launch merges from the script's own config and the plan (under
# `ds-autoplan launch --out` / `deepspeed --autoplan`): never the script's ds_config.json
MERGED_CONFIG = "ds_config.autoplan.json"

# what a plan decides in a DeepSpeed config: parallelism, batch, schedule (dotted paths)
BATCH_ZERO_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "zero_optimization.stage", "zero_optimization.offload_optimizer",
                   "zero_optimization.offload_param", "zero_optimization.sub_group_size")
PLAN_KEYS = BATCH_ZERO_KEYS + ("pipeline.activation_checkpoint_interval", "pipeline.stages",
                               "pipeline.partition", "pipeline.autoplan",
                               "activation_checkpointing.cpu_checkpointing")
# what a plan decides for DeepSpeed's own engine (any module, no pipeline): batch, ZeRO,
# offload, AutoTP
ENGINE_KEYS = BATCH_ZERO_KEYS + ("tensor_parallel.autotp_size",)
_MISSING = object()


def config_precision(cfg: dict) -> str:
    """'bf16', 'fp16' or 'fp32': what a DeepSpeed config trains in."""
    for p in ("bf16", "fp16"):      # "auto" (a Hugging Face stack fills it): not enabled here
        if isinstance(cfg.get(p), dict) and cfg[p].get("enabled") in (True, 1):
            return p
    return "fp32"


def config_value(cfg: dict, key: str, default=_MISSING):
    """The value at the dotted ``key`` of a DeepSpeed config (``default`` where it is not set)."""
    for k in key.split("."):
        if not isinstance(cfg, dict) or k not in cfg:
            return default
        cfg = cfg[k]
    return cfg


def user_config(plan: Plan, user: dict, keys=PLAN_KEYS, engine: bool = False) -> tuple[dict, list[str]]:
    """A user's DeepSpeed config with the plan's ``keys`` (default :data:`PLAN_KEYS`) set and
    everything else (optimizer, scheduler, precision, clipping, logging) left as the user wrote it.  Returns
    ``(config, changes)``: one line per key whose user value the plan replaced, and a line when
    the plan was costed for another precision than the config trains in.  ``engine``: as in
    :func:`ds_config` (with :data:`ENGINE_KEYS`)."""
    full, out, changes = ds_config(plan, engine), copy.deepcopy(user), []
    for key in keys:
        *parents, leaf = key.split(".")
        src = config_value(full, ".".join(parents)) if parents else full
        src = src if isinstance(src, dict) else {}
        if leaf not in src and config_value(out, key) is _MISSING:
            continue                  # neither the plan's key nor the user's
        if src.get(leaf) is False and config_value(out, key) is _MISSING:
            continue                  # a switch the plan leaves off: not added to the user's config
        dst = out
        for k in parents:
            if not isinstance(dst.get(k), dict):
                dst[k] = {}
            dst = dst[k]
        old = dst.get(leaf, _MISSING)
        if leaf not in src:           # a key the plan leaves out: an offload or a TP degree it
            #                           does not use is not the user's either, nor a batch size
            #                           it leaves DeepSpeed to derive; a sub-group size stays theirs
            if old is not _MISSING and leaf != "sub_group_size":
                changes.append(f"{key}: {old!r} -> removed (the plan does not set it)")
                del dst[leaf]
            continue
        if old is not _MISSING and old != src[leaf]:
            changes.append(f"{key}: {old!r} -> {src[leaf]!r}")
        dst[leaf] = copy.deepcopy(src[leaf])
    if config_precision(user) != plan.precision:
        changes.append(f"precision: the plan was costed for {plan.precision}; the config trains in "
                       f"{config_precision(user)} (kept)")
    return out, changes


class _FakeMPU:
    """Just enough of an mpu for DeepSpeedConfig's batch-size check (docs/runtimes.md §3)."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


def validate(cfg: dict, plan: Plan):
    """Parse ``cfg`` with ``deepspeed.runtime.config.DeepSpeedConfig`` for the plan's
    data-parallel size (no process group needed), then the engine-time rules the parser
    does not check.  Returns the DeepSpeedConfig; raises on any violation."""
    from unittest import mock

    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(mock.patch.object(dist, "get_rank", lambda *a, **k: 0))
        stack.enter_context(mock.patch.object(dist, "get_world_size", lambda *a, **k: plan.dp))
        parsed = DeepSpeedConfig(cfg, mpu=_FakeMPU(plan.dp))
    if plan.pp > 1 and parsed.zero_optimization_stage >= 2:
        raise ValueError("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism")
    if parsed.train_batch_size != parsed.train_micro_batch_size_per_gpu * \
            parsed.gradient_accumulation_steps * plan.dp:
        raise ValueError("batch triple does not match the data-parallel size")
    return parsed
