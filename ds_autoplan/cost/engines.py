"""What each engine overlaps and what it serialises: one execution model per
engine, read from the installed libraries, that the cost model (cost/model.py) and the closed
form (cost/iteration.py) apply.

* ``deepspeed`` -- DeepSpeed 0.19.8's PipelineEngine running its own TrainSchedule
  (runtime/pipe/schedule.py): every step exchanges activations / gradients with both
  neighbours through blocking ``p2p.send``/``p2p.recv`` (runtime/pipe/p2p.py: ``dist.send``,
  ``async_op`` refused) *before* its compute, so neighbouring stages advance in lock step and a
  step lasts as long as the slowest stage's forward or backward in it (:func:`lockstep_time`).
  After the last step (the flush): ReduceTiedGrads (``all_reduce`` of the tied embedding grads
  between the first and last stage), ReduceGrads (``_exec_reduce_grads``: with bf16 the
  BF16_Optimizer's ``buffered_allreduce_fallback`` -- a full all-reduce of the gradients over
  the data-parallel group even though the optimizer is ZeRO-1-sharded; fp16 ZeRO-1
  ``reduce_gradients`` reduces each partition to its owner), then OptimizerStep and the ZeRO-1
  parameter all-gather.  Nothing overlaps the backward.  Every TP rank sends the whole
  activation (no Megatron scatter/gather).  DeepSpeed has no TP of its own: Megatron-DeepSpeed's
  layers are taken without the backward TP overlap [decision: the 2021-22 forks the published
  runs used].
* ``megatron-core`` -- Megatron-LM on megatron-core 0.16.1: gradients reduced in fp32 for bf16
  (training/arguments.py: ``accumulate_allreduce_grads_in_fp32`` is set for bf16 unless
  ``--grad-reduce-in-bf16``); ``--overlap-grad-reduce`` (DistributedDataParallelConfig,
  default False) overlaps the bucketed reduction with the last micro-batch's backward;
  ``--overlap-param-gather`` the distributed optimizer's parameter all-gather with the next
  forward; the backward all-reduce of the column-parallel input gradient runs beside their
  weight-gradient GEMMs (``async_grad_allreduce`` in tensor_parallel/layers.py); tied
  embedding grads all-reduced between first and last stage (finalize_model_grads).
  Pipeline schedules with batched isend/irecv: the planner's own 1F1B / interleaved timing.
* ``megatron-2021`` -- Megatron-LM as in Narayanan et al. 2021: gradients all-reduced after the
  backward in the parameter dtype, no TP communication overlap.
* ``fsdp`` -- PyTorch FSDP FULL_SHARD (ZeRO-3): each layer's parameter all-gather is issued
  before the previous layer's compute finishes (forward and backward prefetch), the gradient
  reduce-scatter runs in the backward hooks; only what compute cannot cover is exposed.
* Versions: Megatron-LM before megatron-core's DistributedDataParallel (2021, Narayanan et al.)
  had no gradient/parameter overlap and no TP overlap (``megatron-2021``); the DeepSpeed the
  BLOOM run used (its bf16 branch, bigscience tr11 README) already had the BF16_Optimizer that
  accumulates fp32 gradients unsharded and reduces them whole after the flush, as 0.19.8 does.
* Kernels and optimizer of the software stack (an execution attribute too: the same engine
  ran with other kernels in other years).  ``attention``: the attention-kernel generation
  ('fa1', 'fa2', 'cudnn'; data/gpus.yaml ``attention_kernels``; None: the GPU kind's
  default).  ``optimizer``: 'fused' (one multi-tensor/fused AdamW kernel: Megatron's and
  DeepSpeed's FusedAdam, torch's fused AdamW; memory.OPT_STEP_BYTES) or 'eager' (a per-tensor
  loop of eager torch ops, Composer's DecoupledAdamW.adamw, plus the gradient-norm clipping
  llm-foundry's yamls enable: every op reads and writes whole fp32 tensors, EAGER_STEP_BYTES)
  or 'distributed-fused-adam' (NeMo's name for Apex's DistributedFusedAdam, which NeMo runs with
  store_param_remainders for bf16 models: a fused step whose fp32 master is kept as a 16-bit
  remainder beside the bf16 parameter, 10 optimizer bytes per parameter instead of 12,
  memory.state_bytes; its step is costed as the fused one's).
* ``any`` -- the engine-neutral model the planner has always used (reductions after the
  backward in the parameter dtype, TP overlap on): what a plan emitted for either runtime does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

OVERLAPS = ("grad-reduce", "param-gather", "tp-comm")
ATTENTION_KERNELS = ("fa1", "fa2", "cudnn")
OPTIMIZERS = ("fused", "eager", "distributed-fused-adam")
MOE_DISPATCH = ("fused", "unfused")
GRAD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
# HBM bytes per fp32-state parameter of Composer's DecoupledAdamW.adamw (composer/optim/
# decoupled_weight_decay.py), op by op, read + write: param.mul_ 8, exp_avg.mul_ 8, .add_(grad)
# 12, exp_avg_sq.mul_ 8, .addcmul_(grad, grad) 16, .sqrt() 8, / sqrt(bc2) 8, .add_(eps) 8,
# param.addcdiv_ 16 = 92 counted; measured 89-90 at the copy bandwidth on the lent H100
# (bench/gpu_stack.py, 0.83e9 / 1.61e9 parameters in 32 / 40 tensors; torch's fused AdamW 33);
# plus gradient-norm clipping (FSDP clip_grad_norm_: norm read 4, scale read+write 8) 12 counted
EAGER_STEP_BYTES = 90.0 + 12.0
# The local (one-GPU) work of megatron-core 2024's alltoall token dispatcher around its
# all-to-alls, as torch ops without fusion (token_dispatcher.py of the 0.8/0.9 releases: the
# router's fp32 softmax, top-k and the capacity top-k over the tokens, the sequence-to-hidden
# re-layouts, the permute index_select, the all-gather / reduce-scatter over the last dimension's
# cat/split copies, the probability-weighted unpermute; megatron-core 0.16.1 offers
# --moe-permute-fusion for these), forward + backward: measured 2.00 ms per MoE layer on the
# lent H100 for 8192 token copies of 1536 elements (Grok-1 at TP 4, one local expert;
# 2.33 ms with 2-4 local experts: their transpose copies) -- bench/gpu_moe_local.py,
# bench/data/gpu_moe_h100.json.  Kept as bytes per copied element at the kind's streaming rate
# (2.00e-3 s x 3015 GB/s / (8192 x 1536)); the kernels are index- and launch-bound, so another
# kind's figure scales with its HBM rate [decision].
UNFUSED_DISPATCH_BYTES = 479.0


@dataclass(frozen=True)
class Execution:
    """What one engine overlaps and serialises in a step (gradient reduction, parameter gather, TP
    communication, the wire dtype of gradients, ZeRO-1's reduction, p2p and tied-weight
    handling): the execution model a plan records and ``cost --execution/--overlap`` set."""
    name: str
    grad_overlap: bool = False          # DP gradient reduction beside the last backward
    param_gather_overlap: bool = False  # ZeRO-1/2 parameter all-gather beside the next forward
    tp_overlap: bool = True             # backward TP all-reduce beside the column-parallel wgrad
    grad_bytes: float | None = None     # bytes per gradient element on the wire (None: parameter dtype)
    full_allreduce: bool = False        # ZeRO-1 reduces with a whole all-reduce (DeepSpeed BF16_Optimizer)
    p2p_split: bool | None = None       # True: Megatron scatter/gather (X/t per TP rank); None: the runtime's
    zero3_prefetch: bool = False        # ZeRO-3 forward all-gather hidden behind the previous layer
    lockstep: bool = False              # DeepSpeed TrainSchedule: neighbours advance in lock step
    tied_reduce: bool = False           # tied embedding grads all-reduced between first and last stage
    attention: str | None = None        # attention-kernel generation (None: the GPU kind's default)
    optimizer: str = "fused"            # 'fused', 'eager' (per-tensor eager AdamW loop + clipping)
                                        # or 'distributed-fused-adam' (fused, 2-byte master remainders)
    moe_dispatch: str = "fused"         # 'unfused': megatron-core 2024's torch-op token dispatch

    def with_overlap(self, flags) -> "Execution":
        """The same engine with the overlap switches named in ``flags`` ('grad-reduce',
        'param-gather', 'tp-comm', each optionally prefixed 'no-') set."""
        kw = {}
        for f in flags:
            on = not f.startswith("no-")
            key = f[3:] if not on else f
            if key not in OVERLAPS:
                from ..spec import SpecError
                raise SpecError(f"unknown overlap {f!r}; choose from {', '.join(OVERLAPS)} (or no-...)")
            kw[{"grad-reduce": "grad_overlap", "param-gather": "param_gather_overlap",
                "tp-comm": "tp_overlap"}[key]] = on
        return replace(self, **kw)

    def label(self) -> str:
        """Name and the overlaps switched on, for plan lines and reports."""
        on = [n for n, a in zip(OVERLAPS, ("grad_overlap", "param_gather_overlap", "tp_overlap"))
              if getattr(self, a)]
        extra = "".join(f"; {k} {v}" for k, v in (("attention", self.attention),
                                                    ("optimizer", None if self.optimizer == "fused" else self.optimizer),
                                                    ("MoE dispatch", None if self.moe_dispatch == "fused" else self.moe_dispatch),
                                                    ("gradients reduced in", _dtype_name(self.grad_bytes))) if v)
        return f"{self.name} (overlap: {', '.join(on) or 'none'}{extra})"

    def step_bytes(self, precision: str) -> float:
        """HBM bytes per locally updated parameter of the optimizer step."""
        from .memory import OPT_STEP_BYTES
        return EAGER_STEP_BYTES if self.optimizer == "eager" else OPT_STEP_BYTES[precision]

    @property
    def master_remainders(self) -> bool:
        """The optimizer keeps the fp32 master as a 16-bit remainder (memory.state_bytes)."""
        return self.optimizer == "distributed-fused-adam"


def _dtype_name(b: float | None) -> str | None:
    return None if b is None else {4: "fp32", 2: "bf16/fp16"}.get(b, f"{b} B")


ENGINES = {
    "any": Execution("any"),
    "megatron-core": Execution("megatron-core", grad_bytes=None, p2p_split=True, tied_reduce=True),
    "megatron-2021": Execution("megatron-2021", tp_overlap=False, p2p_split=True, tied_reduce=True),
    "deepspeed": Execution("deepspeed", tp_overlap=False, full_allreduce=True, p2p_split=False,
                           lockstep=True, tied_reduce=True),
    "fsdp": Execution("fsdp", grad_overlap=True, zero3_prefetch=True, p2p_split=False),
}


def get_execution(name: str | None, overlap=None, grad_reduce_dtype: str | None = None,
                  attention: str | None = None, optimizer: str | None = None,
                  moe_dispatch: str | None = None) -> Execution:
    """The execution model ``name`` (None: 'any') with ``overlap`` switches ('a,b' or a list),
    the gradient-reduction dtype on the wire ('fp32', 'bf16', 'fp16'; None: the engine's), the
    attention-kernel generation, the optimizer implementation and the MoE token dispatch
    ('fused' or 'unfused': UNFUSED_DISPATCH_BYTES) (module docstring)."""
    from ..spec import SpecError
    key = name or "any"
    if key not in ENGINES:
        raise SpecError(f"unknown execution model {key!r}; choose from {', '.join(ENGINES)}")
    e = ENGINES[key]
    if overlap:
        flags = [f.strip() for f in overlap.split(",")] if isinstance(overlap, str) else list(overlap)
        e = e.with_overlap([f for f in flags if f])
    for v, known, what in ((grad_reduce_dtype, GRAD_DTYPES, "gradient-reduction dtype"),
                           (attention, ATTENTION_KERNELS, "attention kernel"), (optimizer, OPTIMIZERS, "optimizer"),
                           (moe_dispatch, MOE_DISPATCH, "MoE token dispatch")):
        if v is not None and v not in known:
            raise SpecError(f"unknown {what} {v!r}; choose from {', '.join(known)}")
    if grad_reduce_dtype:
        e = replace(e, grad_bytes=GRAD_DTYPES[grad_reduce_dtype])
    return replace(e, attention=attention or e.attention, optimizer=optimizer or e.optimizer,
                   moe_dispatch=moe_dispatch or e.moe_dispatch)


def grad_bytes(e: Execution, precision: str, cb: int) -> float:
    """Bytes per gradient element in the data-parallel reduction: Megatron-LM reduces bf16
    models' gradients in fp32 (see the module docstring), the others in the parameter dtype."""
    if e.grad_bytes is not None:
        return e.grad_bytes
    return 4 if e.name == "megatron-core" and precision == "bf16" else cb


@lru_cache(maxsize=None)
def trainschedule_steps(m: int, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSpeed TrainSchedule's step map (runtime/pipe/schedule.py, ``_step_to_micro_batch``)
    for the 2(m + P - 1) steps x P stages: (forward step?, micro-batch valid?, previous step's
    micro-batch valid?); a micro-batch id outside [0, m) idles."""
    k = np.arange(2 * (m + P - 1))[:, None]
    s = np.arange(P)[None, :]
    even_k, even_s = k % 2 == 0, s % 2 == 0
    fwd = np.broadcast_to(even_k == even_s, (len(k), P))
    mb_f = np.where(even_k, k // 2, (k - 1) // 2) - s // 2
    mb_b = np.where(even_k, k // 2 - P + (s + 1) // 2, (k - 1) // 2 - P + 1 + s // 2)
    mb = np.where(fwd, mb_f, mb_b)
    valid = (mb >= 0) & (mb < m)
    prev = np.vstack([np.zeros((1, P), bool), valid[:-1]])
    return fwd, valid, prev


def lockstep_time(f: np.ndarray, b: np.ndarray, x: np.ndarray, m: int) -> float:
    """Seconds of DeepSpeed's TrainSchedule over P stages with per-micro-batch forward ``f[s]``,
    backward ``b[s]`` and p2p transfer ``x[s]`` (stage s to s+1).  Each step first exchanges
    with one neighbour through blocking send/recv (a forward step with the previous stage:
    SendGrad + RecvActivation; a backward step with the next: RecvGrad + SendActivation), so it
    starts when both have finished the step before; then computes.  Discrete-event recurrence
    over the steps (exact for this schedule)."""
    P = len(f)
    if P == 1:
        return m * float(f[0] + b[0])
    fwd, valid, prev = trainschedule_steps(m, P)
    idx = np.arange(P)
    partner = np.where(fwd, idx - 1, idx + 1)                       # [steps, P]
    has_nb = (partner >= 0) & (partner < P)
    comm = has_nb & (valid | prev)
    # the two transfers of a step (send of the previous result, receive of this one) are
    # separate blocking calls: their times add
    n = has_nb * (valid.astype(int) + prev.astype(int))
    link = n * np.where(fwd, x[np.clip(idx - 1, 0, P - 1)], x[np.clip(idx, 0, P - 1)])
    work = np.where(valid, np.where(fwd, f[None, :], b[None, :]), 0.0)
    end = np.zeros(P)
    for k in range(len(work)):
        pk = np.clip(partner[k], 0, P - 1)
        start = np.where(comm[k], np.maximum(end, end[pk]) + link[k], end)
        end = start + work[k]
    return float(end.max())


def error_band(name: str | None, cluster=None) -> dict | None:
    """The expected error of a prediction under execution model ``name``: on a cluster that
    ``ds-autoplan calibrate`` fitted to runs on it, that calibration's largest residual over
    its runs (``source: calibration``); else the leave-one-source-out band
    bench/published_runs.py --write stored (data/calibration.json) for that engine, else over
    all engines; None when no band is stored."""
    if cluster is not None and getattr(cluster, "calibration_error", None) is not None:
        e = float(cluster.calibration_error)
        return {"median_abs": e, "max_abs": e, "rows": int(cluster.calibration_runs or 0),
                "over": cluster.name, "source": "calibration"}
    from .compute import calibration
    b = calibration().get("bands", {})
    out = b.get(name or "any") or b.get("all")
    return dict(out, over=name if name in b else "all") if out else None


def band_text(b: dict | None) -> str:
    """One line: the expected error band ``b`` of a prediction (:func:`error_band`)."""
    if not b:
        return "expected error: unknown (no cross-validated band stored)"
    if b.get("source") == "calibration":
        return (f"expected error +-{100 * b['max_abs']:.1f}% (this cluster's calibration: the largest "
                f"residual over its {b['rows']} run(s) on {b['over']}; a plan unlike those runs can miss "
                "by more, docs/calibration.md)")
    lean = b.get("median_signed", 0.0)
    side = (f"; the runs took {100 * abs(lean):.0f}% {'longer' if lean > 0 else 'less'} than predicted, median"
            if abs(lean) >= 0.02 else "")
    return (f"expected error +-{100 * b['median_abs']:.0f}% (median), up to +-{100 * b['max_abs']:.0f}% "
            f"(leave-one-source-out over {b['rows']} published runs, {b['over']}{side})")
