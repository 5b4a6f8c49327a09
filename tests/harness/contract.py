"""Workers of tests/test_executor_contract.py: one plan, or one hand-written action list
with its plan, in each runtime.

:func:`deepspeed_case` (the DeepSpeed adapter) and :func:`megatron_case` are the launcher's
cases, run one after the other in one process group.  A run is ``{"plan": plan dict, "sched":
schedule dict or null}`` (null: the plan's own, as the runtime builds it).  Each trains one
step of a tiny GPT from the same weights as a non-pipelined reference and reports the
largest gradient error, the measured peak saved-activation bytes, the simulator's peak from
the costs measured on micro-batch 0 (runtime.common.memory.stage_costs) and the rank's action
list as the runtime ran it.
"""
from __future__ import annotations

import copy

import torch

N_BLOCKS, MBS, SEQ = 8, 2, 8


def _sim_peak(sched, by_action, rank) -> float:
    from ds_autoplan.runtime.common.memory import stage_costs
    from ds_autoplan.schedule import simulate
    return simulate(sched, stage_costs(sched, by_action, rank)).peak_memory[rank]


def plan_dict(sched_name: str, num_ranks: int, num_stages: int, n: int, recompute=None) -> dict:
    """The fp32 plan of these workers: N_BLOCKS split evenly over ``num_stages`` stages."""
    return {"pp": num_ranks, "dp": 1, "zero_stage": 0, "micro_batch_size": MBS,
            "num_microbatches": n, "global_batch_size": MBS * n, "precision": "fp32",
            "schedule": sched_name, "layers_per_stage": [N_BLOCKS // num_stages] * num_stages,
            "recompute_per_stage": list(recompute or [0.0] * num_stages)}


def _row(rank, sched, err, scale, peak, sim, by_action):
    """``sched``: the lowered schedule the runtime ran."""
    return {"rank": rank, "schedule": sched.name, "grad_err": err, "grad_max": scale,
            "peak": peak, "sim_peak": sim,
            "recomputes": sum(1 for (k, _, _) in by_action if k.value == "R"),
            "actions": [a.short() for a in sched.ranks[rank]]}


# ----------------------------------------------------------------------------- DeepSpeed
def _ds_one(plan, sched, layers0, batches, rank):
    from ds_autoplan.models.tiny_gpt import gpt_loss
    from ds_autoplan.runtime.deepspeed import api
    cfg = {"steps_per_print": 10 ** 9, "gradient_clipping": 0.0}
    engine, *_ = api.initialize([copy.deepcopy(m) for m in layers0], plan, schedule=sched,
                                loss_fn=gpt_loss, config=cfg, track_memory=True,
                                optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    mod = engine.module
    local = [(lo + i, f) for (lo, _), fs in zip(mod.chunk_bounds, mod.chunk_funcs) for i, f in enumerate(fs)]
    before = {i: [p.detach().clone() for p in f.parameters()] for i, f in local}
    engine.train_batch(iter(batches))
    err = scale = 0.0
    for i, f in local:        # SGD with lr 1: the step is the gradient
        for p0, p, g_ref in zip(before[i], f.parameters(), _ref_grads(layers0, batches)[i]):
            err = max(err, float((p0 - p.detach() - g_ref).abs().max()))
            scale = max(scale, float(g_ref.abs().max()))
    by = engine.ap_memory.by_action
    return _row(rank, engine.ap_schedule, err, scale, engine.memtracker.peak,
                _sim_peak(engine.ap_schedule, by, engine.stage_id), by)


_REF: dict = {}


def _ref_grads(layers0, batches):
    """The non-pipelined gradients (every run's model and micro-batches are the same: kept
    per micro-batch count)."""
    from ds_autoplan.models.tiny_gpt import gpt_loss
    if len(batches) not in _REF:
        model = torch.nn.Sequential(*copy.deepcopy(layers0))
        for x, y in batches:
            (gpt_loss(model(x), y) / len(batches)).backward()
        _REF[len(batches)] = [[p.grad.clone() for p in m.parameters()] for m in model]
    return _REF[len(batches)]


def deepspeed_case(case) -> dict:
    """One run (``{"plan": ..., "sched": ...}``) in the DeepSpeed adapter, on the launcher's
    gloo group: the tiny GPT from seed 0 and micro-batches 0 .. n - 1, as every run has."""
    from ds_autoplan.models.tiny_gpt import TinyGPT, example_batch
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from ds_autoplan.schedule import Schedule
    init_distributed()            # DeepSpeed's comm on the launcher's group
    plan, sched = case["plan"], case["sched"] and Schedule.from_dict(case["sched"])
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, hidden=16, num_layers=N_BLOCKS, num_heads=2, seq_len=SEQ)
    batches = [example_batch(model.cfg, MBS, seed=m) for m in range(plan["num_microbatches"])]
    return _ds_one(plan, sched, model.layers(), batches, torch.distributed.get_rank())


# ----------------------------------------------------------------------------- Megatron
def megatron_case(case) -> dict:
    """One plan (``case["sched"]``: a hand-written list for it, else the plan's own) on
    Megatron's GPTModel chunks vs Megatron's no-pipelining run."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as ms

    from ds_autoplan.models import megatron_gpt as G
    from ds_autoplan.runtime.megatron import get_forward_backward_func, initialize
    from ds_autoplan.runtime.megatron.shim import cpu_shim
    from ds_autoplan.runtime.memtrack import MemTracker
    from ds_autoplan.schedule import Schedule

    from ds_autoplan.plan import Plan
    ps.destroy_model_parallel()
    sched = Schedule.from_dict(case["sched"]) if case.get("sched") else None
    plan = Plan.from_dict(case["plan"])
    setup = initialize(plan, schedule=sched)
    ref = G.build_reference(sum(plan.layers_per_stage))
    chunks = G.build_chunks(setup)
    G.copy_weights(ref, chunks, setup, plan.layers_per_stage)
    tracker = MemTracker(exclude=[p for m in chunks for p in m.parameters()])
    fb = get_forward_backward_func(plan, schedule=sched, tracker=tracker)
    n = plan.num_microbatches
    with cpu_shim(remap_cuda_factories=True):
        ms.forward_backward_no_pipelining(forward_step_func=G.forward_step, data_iterator=G.data_iter(0),
                                          model=[ref], num_microbatches=n, seq_length=G.SEQ,
                                          micro_batch_size=G.MBS)
    its = [G.data_iter(0) for _ in chunks]
    fb(forward_step_func=G.forward_step, data_iterator=its if len(chunks) > 1 else its[0],
       model=chunks, num_microbatches=n, seq_length=G.SEQ, micro_batch_size=G.MBS)
    rp, err, scale = dict(ref.named_parameters()), 0.0, 0.0
    for c, m in enumerate(chunks):
        off = G.stage_offset(plan.layers_per_stage, setup.stages[c])
        for name, p in m.named_parameters():
            g_ref = rp[G.global_name(name, off)].grad
            err = max(err, float((p.grad - g_ref).abs().max()))
            scale = max(scale, float(g_ref.abs().max()))
    by = fb.memory.by_action
    return _row(setup.pp_rank, fb.schedule, err, scale, fb.peak_bytes,
                _sim_peak(fb.schedule, by, setup.pp_rank), by)

