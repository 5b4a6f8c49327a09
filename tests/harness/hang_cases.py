"""Workers of tests/test_no_hang.py: a deadlocking action list given to each runtime, and a
rank that stops (SIGSTOP) in the middle of a step.  Run on every rank with
``spawn(["-m", "ds_autoplan.runtime.launch", CASES.json], world, env=ENV)``; the test reads
each rank's exit code and output (these cases are meant to fail)."""
from __future__ import annotations

import os
import signal

N = 4


def deadlock_schedule(n: int = 2):
    """A lowered 2-rank list that the simulator proves deadlocking: rank 1 runs F1.1 first,
    which needs the activation rank 0 sends only after BW0.0, which needs the gradient rank
    1 sends only after BW1.0 -- which comes after F1.1.  Each rank's own order is valid and
    the SEND/RECV pairs match (validate passes): only the cross-rank order hangs."""
    from ds_autoplan.schedule import Schedule
    r0 = [k for m in range(n) for k in (f"F0.{m}", f"SEND_F0.{m}@1", f"RECV_B0.{m}@1", f"BW0.{m}")]
    r1 = [f"RECV_F1.{m}@0" for m in range(n)] + [f"F1.{m}" for m in reversed(range(n))] + \
        [k for m in range(n) for k in (f"BW1.{m}", f"SEND_B1.{m}@0")]
    return Schedule.from_text(f"# ds_autoplan schedule name=deadlock microbatches={n} "
                              f"placement=0,1\nrank0: {' '.join(r0)}\nrank1: {' '.join(r1)}\n")


def _stop_at(module, call: int) -> None:
    """SIGSTOP this process at the ``call``-th forward of ``module`` (a stalled rank)."""
    count = [0]

    def hook(*_):
        count[0] += 1
        if count[0] == call:
            print(f"rank {os.environ.get('RANK')}: stopping (SIGSTOP)", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
    module.register_forward_pre_hook(hook)


def _ds_plan(pp, n):
    """fp32, 1F1B, two transformer blocks per stage."""
    from harness.contract import plan_dict
    return dict(plan_dict("1f1b", pp, pp, n), layers_per_stage=[2] * pp)


def ds_case(case) -> dict:
    """DeepSpeed runtime: ``case["sched"]`` (a schedule dict) or the plan's 1F1B; with
    ``stall_rank``, that rank stops in its second step."""
    import torch
    import torch.distributed as dist

    from ds_autoplan.models.tiny_gpt import gpt_loss
    from ds_autoplan.runtime.deepspeed import api
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from ds_autoplan.schedule import Schedule
    from harness.contract import MBS, SEQ
    from harness.ds_pipeline import synthetic_batches, tiny_gpt_layers
    init_distributed()            # DeepSpeed's comm on the launcher's gloo group
    world = dist.get_world_size()
    sched = Schedule.from_dict(case["sched"]) if case.get("sched") else None
    plan = _ds_plan(world, sched.num_microbatches if sched else N)
    engine, *_ = api.initialize(tiny_gpt_layers(blocks=2 * world, seq=SEQ), plan, schedule=sched,
                                loss_fn=gpt_loss, config={"steps_per_print": 10 ** 9},
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    if case.get("stall_rank") == dist.get_rank():
        _stop_at(engine.module.chunk_funcs[0][0], plan["num_microbatches"] + 2)
    batches = synthetic_batches(3, plan["num_microbatches"], MBS, SEQ, 32)
    for b in batches:
        engine.train_batch(iter(b))
    return {"rank": dist.get_rank()}


def mg_case(case) -> dict:
    """Megatron runtime: the same, through our forward_backward_func."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ds_autoplan.models.megatron_gpt import MBS, SEQ, build_chunks, data_iter, forward_step
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.megatron import get_forward_backward_func, initialize
    from ds_autoplan.schedule import Schedule
    ps.destroy_model_parallel()
    world = dist.get_world_size()
    sched = Schedule.from_dict(case["sched"]) if case.get("sched") else None
    n = sched.num_microbatches if sched else N
    plan = Plan(pp=world, num_microbatches=n, micro_batch_size=MBS, schedule="1f1b",
                layers_per_stage=[1] * world, recompute_per_stage=[0.0] * world, precision="fp32")
    setup = initialize(plan, schedule=sched)
    chunks = build_chunks(setup)
    if case.get("stall_rank") == dist.get_rank():
        _stop_at(chunks[0], n + 2)
    fb = get_forward_backward_func(plan, schedule=sched)
    for step in range(3):
        fb(forward_step_func=forward_step, data_iterator=data_iter(step), model=chunks,
           num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
    return {"rank": dist.get_rank()}


def refusal_case(case) -> dict:
    """``ds_autoplan.initialize`` with ``case["plan"]`` (over the 2-rank fp32 1F1B plan of
    ``blocks`` transformer blocks only) and ``case["config"]``: the one-line refusal every
    rank gives, as ``{"error": "Type: message"}`` (or ``{"error": None}`` when it ran)."""
    import torch
    import torch.nn.functional as F

    from ds_autoplan.runtime.deepspeed import api
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from harness.ds_pipeline import block_layers
    init_distributed()
    plan = {**_ds_plan(2, N), **case.get("plan", {})}
    try:
        api.initialize(block_layers(blocks=case.get("blocks", 4)), plan, loss_fn=F.mse_loss,
                       config=case.get("config"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    except Exception as e:            # noqa: BLE001 - the refusal is the result
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}
