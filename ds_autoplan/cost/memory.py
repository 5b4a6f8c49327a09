"""Model-state bytes as the engines hold them, per runtime and precision.

Bytes per parameter on one rank of a data-parallel group of ``d`` (ZeRO stage ``zero``):

* Megatron-LM with ``--bf16`` keeps fp32 main gradients beside the 2-byte parameters and the
  fp32 master copy + Adam moments: 2 + 4 + 12 = 18; the distributed optimizer (our ZeRO-1)
  shards the 12 optimizer bytes: 6 + 12/d.  In megatron-core 0.16.1 the gradient buffer's dtype
  is ``torch.float if ddp_config.grad_reduce_in_fp32 else param.dtype``
  (``distributed/distributed_data_parallel.py``) and the library default is False (2-byte
  gradients, 16 B); Megatron-LM's training arguments turn it on for bf16, which is what the
  emitted ``pretrain_gpt.py`` flags run, so 18 is charged.
* DeepSpeed 0.19.8 with bf16 (``runtime/engine.py``, ``_do_optimizer_sanity_check``): without
  ZeRO and without pipelines the optimizer is ``FP16_UnfusedOptimizer`` on bf16 (DDP_BFLOAT16):
  2-byte parameters and gradients, fp32 master and Adam moments, 2 + 2 + 12; with pipelines it
  is ``BF16_Optimizer``, which shards the fp32 master and moments over the data-parallel group
  (2 + 2 + 12/d) -- the tables do not know the pipeline degree, so the non-pipeline 16 is kept
  [decision: the larger].  ZeRO-1 (``DeepSpeedZeroOptimizer``): 2 + 2 + 12/d, ZeRO-2 2 + 14/d,
  ZeRO-3 16/d.  fp16 alike.
* fp32: parameter + gradient + Adam moments, 4 + 4 + 8, sharded like the above.

``runtime='any'`` (the default: a plan is emitted for both engines) takes the larger of the two.

``master_remainders`` (the optimizer 'distributed-fused-adam', cost/engines.py): Apex's
DistributedFusedAdam with ``store_param_remainders=True`` keeps, "if model is BF16 and optimizer
is FP32", only the bits needed to rebuild the fp32 master from the bf16 parameter (Apex
``apex/contrib/optimizers/distributed_fused_adam.py``, class docstring) -- a 16-bit remainder
per element of the shard instead of a 4-byte master copy: the optimizer's 12 bytes become 10.
NeMo sets it for its ``distributed_fused_adam`` optimizer whenever the optimizer dtype is fp32
and the O2 model dtype bf16 (``megatron_base_model.py`` ``setup_optimization``: store_params
False, store_param_remainders True).  bf16 only; other precisions are unchanged.
"""
from __future__ import annotations

import math

RUNTIMES = ("any", "megatron", "deepspeed")

# HBM traffic of the optimizer step per locally updated parameter (Megatron's step, the DeepSpeed
# BF16/ZeRO optimizers alike): gradient-norm read of the fp32 gradient (4); Adam reads master,
# gradient, m, v and writes master, m, v (28); the master is copied to the 2-byte model
# parameter (4 + 2); the gradient buffer is zeroed (4).  fp32 training has no copy.
OPT_STEP_BYTES = {"bf16": 42.0, "fp16": 42.0, "fp32": 36.0}
# optimizer bytes per parameter with the master kept as a 16-bit remainder: remainder 2 + Adam
# moments 4 + 4 (Apex DistributedFusedAdam store_param_remainders; module docstring)
MASTER_REMAINDER_OPT_BYTES = 10.0


def _deepspeed(precision: str, zero: int, d: int) -> tuple[float, float, float]:
    if precision == "fp32":
        p, g, o = 4.0, 4.0, 8.0
    else:
        p, g, o = 2.0, 2.0, 12.0
    if zero == 0:
        return p, g, o
    if zero == 1:
        return p, g, o / d
    if zero == 2:
        return p, g / d, o / d
    return p / d, g / d, o / d


def _megatron(precision: str, zero: int, d: int, grad: float | None = None) -> tuple[float, float, float]:
    if zero >= 2:                       # not executable in Megatron: DeepSpeed holds it
        return _deepspeed(precision, zero, d)
    p, g, o = (4.0, 4.0, 8.0) if precision == "fp32" else (2.0, grad or 4.0, 12.0)
    return p, g, (o / d if zero == 1 else o)


def state_bytes(precision: str, zero: int, d: int, runtime: str = "any",
                grad_reduce_bytes: float | None = None,
                master_remainders: bool = False) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per model parameter on one rank.
    ``grad_reduce_bytes``: a gradient-reduction dtype set explicitly (Execution.grad_bytes);
    Megatron's gradient buffer has that dtype (see above), so it replaces the fp32 default.
    ``master_remainders``: the fp32 master kept as a 2-byte remainder (module docstring)."""
    if runtime not in RUNTIMES:
        from ..spec import SpecError
        raise SpecError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if runtime == "megatron":
        p, g, o = _megatron(precision, zero, d, grad_reduce_bytes)
    elif runtime == "deepspeed":
        p, g, o = _deepspeed(precision, zero, d)
    else:
        m, s = _megatron(precision, zero, d), _deepspeed(precision, zero, d)
        p, g, o = m if sum(m) >= sum(s) else s
    if master_remainders and precision == "bf16":
        o *= MASTER_REMAINDER_OPT_BYTES / 12.0      # every bf16 branch above holds 12 / x
    return p, g, o


def local_optimizer_fraction(zero: int, d: int, precision: str, runtime: str = "any") -> float:
    """Share of a rank's parameters whose optimizer state (and Adam step) lives on it."""
    o = state_bytes(precision, zero, d, runtime)[2]
    full = 8.0 if precision == "fp32" else 12.0
    return o / full


HEADROOM_FRACTION = 0.05   # default headroom of a cluster-derived budget [decision]


def usable_budget(cluster, budget_gb: float | None = None, headroom_gb: float | None = None) -> tuple[float, float]:
    """(bytes a plan may use per device, headroom in GB kept free).  The budget is the user's
    ``budget_gb`` (a cap: no default headroom) or the device memory minus the preset's reserve
    (CUDA context, allocator slack), less a headroom the user can set (default 5% of device
    memory: fragmentation, communication buffers and what the engines allocate beyond the
    accounting)."""
    from ..spec import SpecError
    from ..spec.cluster import GB
    if budget_gb is not None and not (math.isfinite(budget_gb) and budget_gb > 0):
        raise SpecError(f"memory budget must be a positive number of GB, got {budget_gb}")
    if headroom_gb is not None and not (math.isfinite(headroom_gb) and headroom_gb >= 0):
        raise SpecError(f"memory headroom must be a number of GB >= 0, got {headroom_gb}")
    base = budget_gb * GB if budget_gb else cluster.budget_bytes
    if headroom_gb is None:
        headroom_gb = 0.0 if budget_gb else HEADROOM_FRACTION * cluster.memory_gb
    if not math.isfinite(base):     # 1e308 GB: beyond a float's range once in bytes
        raise SpecError(f"memory budget {budget_gb or cluster.memory_gb:g} GB is too large to "
                        "count in bytes")
    E = base - headroom_gb * GB
    if E <= 0:
        raise SpecError(f"memory headroom {headroom_gb:g} GB leaves no budget (budget before headroom "
                        f"{base / GB:.1f} GB)")
    return E, float(headroom_gb)
