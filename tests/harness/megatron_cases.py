"""Megatron test cases on gloo ranks: our schedules vs Megatron's own and the no-pipeline
run, recomputation with dropout, a failing rank.  ``launch(world, cases)`` runs them
(:func:`ds_autoplan.runtime.launch.launch`); a case's ``fn`` defaults to :func:`run_case`, a
bare name is a function of this module."""
from __future__ import annotations

import time
from types import SimpleNamespace

from ds_autoplan.models.megatron_gpt import (MBS, SEQ, build_chunks, build_reference,
                                             copy_weights, data_iter, forward_step, global_name,
                                             stage_offset)
from ds_autoplan.runtime import launch as _launcher

from . import ENV


def launch(world: int, cases: list, **kw) -> list:
    """:func:`ds_autoplan.runtime.launch.launch` with this module's case functions."""
    cases = [dict(c, fn=c.get("fn", "run_case")) for c in cases]
    cases = [c if ":" in c["fn"] else dict(c, fn=f"{__name__}:{c['fn']}") for c in cases]
    return _launcher.launch(world, cases, **{"env": ENV, **kw})


def sgd(params, lr=0.05):
    import torch
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None



def _plan(case):
    from ds_autoplan.plan import Plan
    d, n, name = case["pp"], case["n"], case.get("schedule", "custom")
    return Plan(pp=d, tp=case.get("tp", 1), ep=case.get("ep", 1), dp=case.get("dp", 1),
                sequence_parallel=case.get("sp", False),
                num_microbatches=n, micro_batch_size=MBS, schedule=name,
                schedule_options=case.get("options", {}), layers_per_stage=case["layers"],
                recompute_per_stage=case.get("recompute", [0.0] * len(case["layers"])),
                precision="fp32")


_REFERENCES: dict = {}


def reference_run(num_layers: int, n: int, steps: int, split: bool, tp: int, sp: bool) -> dict:
    """The local no-pipeline run every case of this shape compares with (Megatron's
    forward_backward_no_pipelining of the whole model, :func:`build_reference`): ``steps``
    training steps on ``data_iter(step)`` with SGD in between, then one forward-only pass on
    ``data_iter(99)``.  Its initial weights, per-step losses and gradients (by parameter name)
    and evaluation losses; computed once per process and shape (and tp rank: with ``tp`` > 1
    the model is sharded like the chunks), since every input of it is fixed."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as ms

    from ds_autoplan.runtime.megatron import cpu_shim
    key = (num_layers, n, steps, split, tp, sp, ps.get_tensor_model_parallel_rank())
    if key in _REFERENCES:
        return _REFERENCES[key]
    ref = build_reference(num_layers, split=split, tp=tp, sp=sp)
    run = {"weights": {k: p.detach().clone() for k, p in ref.named_parameters()},
           "losses": [], "grads": []}
    for step in range(steps):
        with cpu_shim(remap_cuda_factories=True):
            ref_l = ms.forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=data_iter(step), model=[ref],
                num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
        if sp:
            _allreduce_sp_grads([ref])
        run["losses"].append([float(x["loss"]) for x in ref_l])
        run["grads"].append({k: p.grad.clone() for k, p in ref.named_parameters()})
        sgd(ref.parameters())
    with cpu_shim(remap_cuda_factories=True), torch.no_grad():
        ref_l = ms.forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=data_iter(99), model=[ref],
            num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
    run["eval_losses"] = [float(x["loss"]) for x in ref_l]
    _REFERENCES[key] = run
    return run


def run_case(case) -> dict:
    """One schedule (ours or Megatron's own), 2 training steps; compares with a local
    no-pipeline run of the same model (:func:`reference_run`)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as ms

    from ds_autoplan.runtime.memtrack import MemTracker
    from ds_autoplan.schedule import Costs, Schedule, simulate
    from ds_autoplan.runtime.megatron import cpu_shim, get_forward_backward_func, initialize

    ps.destroy_model_parallel()
    plan = _plan(case)
    sched = Schedule.from_dict(case["sched"]) if "sched" in case else plan.build_schedule()
    setup = initialize(plan, schedule=sched)
    rank, S, n = setup.pp_rank, sched.num_stages, plan.num_microbatches
    L = sum(plan.layers_per_stage)
    split = case.get("split", True)
    # tp > 1: a reference with Megatron's own linear layers ("ref_split": False) checks the
    # tensor-parallel communication of the split layers against Megatron's
    ref = reference_run(L, n, case.get("steps", 2), case.get("ref_split", split), plan.tp,
                        setup.config_overrides["sequence_parallel"])
    chunks = build_chunks(setup, split=split, **case.get("config", {}))
    copy_weights(SimpleNamespace(named_parameters=ref["weights"].items), chunks, setup,
                 plan.layers_per_stage)
    params = [p for m in chunks for p in m.parameters()]
    runner = case.get("runner", "ours")
    tracker = MemTracker(exclude=params) if runner == "ours" else None
    fb = get_forward_backward_func(plan, schedule=sched, tracker=tracker) if runner == "ours" else None
    sched = fb.schedule if fb is not None else sched      # with the plan's R actions
    res = {"rank": rank, "tp_rank": ps.get_tensor_model_parallel_rank(), "stages": setup.stages,
           "losses": [], "ref_losses": [], "max_grad_err": 0.0, "max_grad": 0.0,
           "peak_bytes": [], "time": [], "w_items": 0,
           "has_w": runner == "ours" and any(a.kind.value == "W" for a in sched.ranks[rank])}
    w_items = _count_w_items(res)
    for step in range(case.get("steps", 2)):
        its = [data_iter(step) for _ in chunks]
        kw = dict(forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
                  model=chunks, num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
        t0 = time.perf_counter()
        if runner == "ours":
            losses = fb(**kw)
            res["peak_bytes"].append(fb.peak_bytes)
        else:  # Megatron's own schedule for this parallel state (1F1B or interleaved)
            with cpu_shim(remap_cuda_factories=True):
                losses = ms.get_forward_backward_func()(**kw)
        res["time"].append(time.perf_counter() - t0)
        if setup.config_overrides["sequence_parallel"]:
            _allreduce_sp_grads(chunks)
        for c, m in enumerate(chunks):
            off = stage_offset(plan.layers_per_stage, setup.stages[c])
            for nme, p in m.named_parameters():
                g_ref = ref["grads"][step][global_name(nme, off)]
                assert p.grad is not None, f"no gradient for {nme} (stage {setup.stages[c]}) step {step} " + str([q for q, pp in m.named_parameters() if pp.grad is None])
                res["max_grad_err"] = max(res["max_grad_err"], float((p.grad - g_ref).abs().max()))
                res["max_grad"] = max(res["max_grad"], float(g_ref.abs().max()))
        res["losses"].append([float(x["loss"]) for x in losses])
        res["ref_losses"].append(ref["losses"][step])
        sgd(params)
    if runner == "ours" and tracker is not None:
        # simulator with the measured per-(stage, mb) deltas of this rank's actions; other
        # ranks' stages get zeros (only this rank's peak is compared)
        import numpy as np
        mf, mb_, mw = (np.zeros((S, n)) for _ in range(3))
        keep = np.zeros((S, n))
        for (k, s, m), v in fb.mem_deltas.items():
            if k == "F":
                mf[s, m] = v
            elif k == "B":
                mb_[s, m] = v
            elif k == "BW":
                mb_[s, m] = v
            elif k == "R":
                mf[s, m] += v
        mw = -(mf + mb_)
        rec = {(a.stage, a.mb) for a in sched.actions() if a.kind.value == "R"}
        for (s, m) in rec:
            keep[s, m] = fb.mem_deltas.get(("F", s, m), 0.0)
        costs = Costs.per_stage(S, n, 1.0, 1.0, 1.0, mem_f=mf, mem_b=mb_, mem_w=mw, keep_ckpt=keep)
        res["sim_peak_bytes"] = simulate(sched.compute_only(), costs).peak_memory[rank]
    # one forward-only (evaluation) pass, as Megatron-LM's evaluate() runs it
    with cpu_shim(remap_cuda_factories=True), torch.no_grad():
        its = [data_iter(99) for _ in chunks]
        kw.update(data_iterator=its if len(chunks) > 1 else its[0], forward_only=True)
        if runner == "ours":
            losses = fb(**kw)
        else:
            losses = ms.get_forward_backward_func()(**kw)
    w_items()
    res["eval_losses"] = [float(x["loss"]) for x in losses]
    res["ref_eval_losses"] = ref["eval_losses"]
    dist.barrier()
    return res


def _count_w_items(res, key="w_items", pick=None):
    """Count, into ``res[key]``, the deferred weight-gradient closures of the Megatron split
    layers (those ``pick(fn)`` accepts) that W actions run (shows that W does work); returns
    the undo."""
    from ds_autoplan.runtime.splitgrad import WeightGradStore
    from ds_autoplan.runtime.megatron import splitgrad
    run_all = WeightGradStore.run_all
    res[key] = 0

    def counting(store):
        res[key] += sum(fn.__module__ == splitgrad.__name__ and (pick is None or pick(fn))
                        for fn, _, _ in store._items)
        return run_all(store)
    WeightGradStore.run_all = counting

    def undo():
        WeightGradStore.run_all = run_all
    return undo


def _allreduce_sp_grads(models):
    """What Megatron's ``finalize_model_grads`` does for sequence-parallel parameters (norms:
    each tp rank saw its slice of the sequence), on plain ``.grad`` (no DDP here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    for m in models:
        for p in m.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def dropout_case(case) -> dict:
    """The same schedule with and without recomputation (R) of some stages, hidden dropout
    on: R must replay each forward's random state, so gradients agree exactly; a third run
    without dropout shows that dropout is really drawn."""
    import torch
    from megatron.core import parallel_state as ps

    from ds_autoplan.schedule import Kind, Schedule
    from ds_autoplan.runtime.megatron import get_forward_backward_func, initialize
    with_r = Schedule.from_dict(case["sched"])
    no_r = Schedule.from_keys("no-r", with_r.num_microbatches, with_r.placement,
                              [[(a.kind.value, a.stage, a.mb) for a in acts if a.kind != Kind.R]
                               for acts in with_r.ranks])
    grads = []
    for sched, p in ((with_r, case["dropout"]), (no_r, case["dropout"]), (no_r, 0.0)):
        ps.destroy_model_parallel()
        plan = _plan(case)
        setup = initialize(plan, schedule=sched)
        chunks = build_chunks(setup, hidden_dropout=p)
        torch.manual_seed(4321 + setup.pp_rank)
        its = [data_iter(0) for _ in chunks]
        get_forward_backward_func(plan, schedule=sched)(
            forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
            model=chunks, num_microbatches=plan.num_microbatches, seq_length=SEQ,
            micro_batch_size=MBS)
        grads.append([q.grad.clone() for m in chunks for q in m.parameters()])
    err = max(float((a - b).abs().max()) for a, b in zip(grads[0], grads[1]))
    diff = max(float((a - b).abs().max()) for a, b in zip(grads[1], grads[2]))
    return {"rank": setup.pp_rank, "recomputes": sum(a.kind == Kind.R for a in with_r.ranks[setup.pp_rank]),
            "max_err": err, "dropout_effect": diff}


def fail_case(case) -> dict:
    """Our schedule with a forward_step_func that raises on one rank in the middle of the
    pipeline while the other ranks wait on receives (launcher robustness test)."""
    from megatron.core import parallel_state as ps

    from ds_autoplan.runtime.megatron import get_forward_backward_func, initialize
    ps.destroy_model_parallel()
    plan = _plan(case)
    setup = initialize(plan)
    chunks = build_chunks(setup)
    calls = []

    def bad_step(data_it, model):
        calls.append(1)
        if setup.pp_rank == case.get("bad_rank", 1) and len(calls) == 3:
            raise RuntimeError("deliberate failure")
        return forward_step(data_it, model)

    its = [data_iter(0) for _ in chunks]
    get_forward_backward_func(plan)(
        forward_step_func=bad_step, data_iterator=its if len(chunks) > 1 else its[0],
        model=chunks, num_microbatches=plan.num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
    return {}


# ------------------------------------------------------------------ expert parallelism (MoE)
_SOLO_FIELDS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep",
                "tp_ep_pp", "dp", "dp_cp", "tp_dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp")


def solo_groups():
    """A ``ProcessGroupCollection`` whose every group is this rank alone: a model built with
    it is the whole single-process model (all experts, no pipeline) inside a multi-rank job."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    mine = [g for r in range(dist.get_world_size()) for g in [dist.new_group([r])]
            if r == dist.get_rank()][0]
    pgc = ProcessGroupCollection()
    for f in _SOLO_FIELDS:
        setattr(pgc, f, mine)
    return pgc


def expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A local expert's parameter name in the whole model (local expert j of ep rank e is
    global expert e·local_experts + j, Megatron's MoELayer.local_expert_indices)."""
    key = ".local_experts."
    if key not in name:
        return name
    head, rest = name.split(key, 1)
    j, tail = rest.split(".", 1)
    return f"{head}{key}{ep_rank * local_experts + int(j)}.{tail}"


def _dp_data(step: int, dp_rank: int, n: int):
    """dp rank k's n micro-batches of a step (different data on every dp / ep rank)."""
    import itertools
    return itertools.islice(data_iter(1000 * step + dp_rank), n)


def reduce_moe_grads(models, dp: int):
    """What Megatron DDP does with the gradients of a MoE model (distributed_data_parallel.py,
    average_in_collective off): dense parameters are summed over the data-parallel group,
    expert parameters (``allreduce`` False) over the expert-data-parallel group, both scaled
    by 1/dp (the dense dp size, ``expert_gradient_scaling_factor``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    for m in models:
        for p in m.parameters():
            if p.grad is None:
                continue
            dense = getattr(p, "allreduce", True)
            grp = ps.get_data_parallel_group() if dense else ps.get_expert_data_parallel_group()
            dist.all_reduce(p.grad, group=grp)
            p.grad.div_(dp)


def moe_case(case) -> dict:
    """MoE (alltoall dispatcher, per-expert MLPs, EP = ``case['ep']``) in our schedule on
    pp × ep ranks: every dp/ep rank gets its own data; after Megatron's gradient reduction
    (dense over dp, experts over expert-dp) every local parameter's gradient equals that of
    the single-process model run on all ranks' micro-batches, each expert compared with the
    reference's expert of the same global index.  2 steps (SGD in between)."""
    import itertools

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as ms

    from ds_autoplan.models.megatron_gpt import base_config, gpt, moe_config
    from ds_autoplan.runtime.megatron import cpu_shim, get_forward_backward_func, initialize
    from ds_autoplan.schedule import Kind

    ps.destroy_model_parallel()
    ep = case["ep"]
    plan = _plan(dict(case, dp=ep))
    moe = moe_config(aux_loss=case.get("aux_loss", 0.0))
    L = sum(plan.layers_per_stage)
    ref = gpt(base_config(num_layers=L, **moe), pg_collection=solo_groups())
    setup = initialize(plan)             # expert_model_parallel_size = plan.ep
    fb = get_forward_backward_func(plan)
    chunks = build_chunks(setup, **moe)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ep_rank, nloc = ps.get_expert_model_parallel_rank(), moe["num_moe_experts"] // ep
    rp = dict(ref.named_parameters())

    def ref_name(c, nme):
        return expert_name(global_name(nme, stage_offset(plan.layers_per_stage, setup.stages[c])),
                           ep_rank, nloc)
    with torch.no_grad():
        for c, m in enumerate(chunks):
            for nme, p in m.named_parameters():
                p.copy_(rp[ref_name(c, nme)])
    n = plan.num_microbatches
    res = {"rank": dist.get_rank(), "pp_rank": setup.pp_rank, "ep_rank": ep_rank, "dp": dp,
           "local_experts": nloc, "max_grad_err": 0.0, "max_grad": 0.0, "losses": [],
           "ref_losses": [], "experts_compared": 0,
           "has_w": any(a.kind == Kind.W for a in fb.schedule.ranks[setup.pp_rank])}
    params = [p for m in chunks for p in m.parameters()]
    undo = _count_expert_w_items(res)
    for step in range(case.get("steps", 2)):
        with cpu_shim(remap_cuda_factories=True):
            ref_l = ms.forward_backward_no_pipelining(
                forward_step_func=forward_step, model=[ref], num_microbatches=dp * n,
                data_iterator=itertools.chain(*(_dp_data(step, k, n) for k in range(dp))),
                seq_length=SEQ, micro_batch_size=MBS)
        its = [_dp_data(step, dp_rank, n) for _ in chunks]
        losses = fb(forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
                    model=chunks, num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
        reduce_moe_grads(chunks, dp)
        experts = set()
        for c, m in enumerate(chunks):
            for nme, p in m.named_parameters():
                g_ref = rp[ref_name(c, nme)].grad
                assert p.grad is not None, f"no gradient for {nme}"
                res["max_grad_err"] = max(res["max_grad_err"], float((p.grad - g_ref).abs().max()))
                res["max_grad"] = max(res["max_grad"], float(g_ref.abs().max()))
                if ".local_experts." in nme:     # one entry per (layer, global expert)
                    experts.add(ref_name(c, nme).rsplit(".", 2)[0])
        res["experts_compared"] = len(experts)
        res["losses"].append([float(x["loss"]) for x in losses])
        res["ref_losses"].append([float(x["loss"]) for x in ref_l][dp_rank * n:(dp_rank + 1) * n])
        sgd(params)
        sgd(ref.parameters())
    undo()
    dist.barrier()
    return res


def _count_expert_w_items(res):
    """:func:`_count_w_items` of expert-parallel linear layers only (into
    ``res["expert_w_items"]``: their weight has Megatron's ``allreduce`` False)."""
    import torch

    def expert(fn):
        cells = [c.cell_contents for c in (fn.__closure__ or ())]
        return any(isinstance(c, torch.nn.Parameter) and getattr(c, "allreduce", True) is False
                   for c in cells)
    return _count_w_items(res, "expert_w_items", expert)
