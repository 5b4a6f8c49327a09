"""Worker (every rank, 2 ranks): offload plans trained by ds_autoplan's DeepSpeed runtime against
DeepSpeed's own engine under the same merged config (issue 26 item 5).  One result line per
case: the largest relative loss error, and for the checkpoint cases the loss after resuming
under the other plan against the uninterrupted run.

Cases: ``zero2-opt`` (ZeRO-Offload, DeepSpeed's plain engine), ``zero3-ratio`` (ZeRO-3 with half
of the optimizer on the host: Twin-Flow), ``zero3-infinity`` (optimizer and parameters on the
host), ``pipe-zero1-opt`` (2 pipeline stages, ZeRO-1 with the optimizer on the host: the
pipeline engine), ``zero2-opt-act`` / ``zero1-act`` (activations on the host too / alone, in the
plain and the pipeline engine), ``resume-off-on`` / ``resume-on-off`` (a ZeRO-1 pipeline checkpoint
saved without offload resumed with it, and back), ``resume-zero2-off-on`` / ``resume-zero2-on-off``
(the same for a ZeRO-2 plan in DeepSpeed's plain engine: ZeRO-Offload on and off)."""
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_autoplan.runtime.deepspeed import initialize
from ds_autoplan.runtime.deepspeed.api import config_from_plan
from ds_autoplan.runtime.deepspeed.dist import init_distributed
from ds_autoplan.runtime.launch import report_runs
from ds_autoplan.plan import Plan

N, MBS, STEPS, H = 2, 2, 3, 8
CFG = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "steps_per_print": 10 ** 9}
PLANS = {"zero2-opt": dict(pp=1, zero_stage=2, offload="opt", layers_per_stage=[7]),
         "zero3-ratio": dict(pp=1, zero_stage=3, offload="opt:0.5", layers_per_stage=[7]),
         "zero3-infinity": dict(pp=1, zero_stage=3, offload="opt+param", layers_per_stage=[7]),
         "pipe-zero1-opt": dict(pp=2, zero_stage=1, offload="opt", layers_per_stage=[3, 4],
                                recompute_per_stage=[0.0, 0.0]),
         # activations on the host (saved tensors of the kept layers swapped), first layers
         # recomputed: the plain engine and the pipeline engine's one stage
         "zero2-opt-act": dict(pp=1, zero_stage=2, offload="opt+act", layers_per_stage=[7],
                               recompute_per_stage=[0.3]),
         "zero1-act": dict(pp=1, zero_stage=1, offload="act", layers_per_stage=[7],
                           recompute_per_stage=[0.3])}


def layers():
    torch.manual_seed(0)
    out = [nn.Linear(H, H)]
    for _ in range(3):
        out += [nn.Tanh(), nn.Linear(H, H)]
    return out


def plan_of(**kw) -> Plan:
    dp = 2 // kw.get("pp", 1)
    return Plan(dp=dp, micro_batch_size=MBS, num_microbatches=N, precision="fp32", **kw)


def data(rank: int):
    g = torch.Generator().manual_seed(1 + rank)
    return [[(torch.randn(MBS, H, generator=g), torch.randn(MBS, H, generator=g)) for _ in range(N)]
            for _ in range(STEPS)]


def reference(cfg: dict, batches) -> list:
    """DeepSpeed's own engine on the same layers (an nn.Sequential, no pipeline) under ``cfg``:
    per step the mean loss over the micro-batches and the ranks, as ``train_batch`` returns."""
    import deepspeed
    # every rank a data-parallel rank here: a pipeline plan's one data rank is given the same
    # batches on both (their mean gradient is its gradient)
    cfg = {k: v for k, v in cfg.items() if k != "pipeline"}
    cfg["train_batch_size"] = MBS * N * torch.distributed.get_world_size()
    engine, *_ = deepspeed.initialize(model=nn.Sequential(*layers()), config=cfg)
    out = []
    for mbl in batches:
        tot = 0.0
        for x, y in mbl:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            tot += float(loss) / len(mbl)
        t = torch.tensor([tot])
        torch.distributed.all_reduce(t)
        out.append(float(t) / torch.distributed.get_world_size())
    return out


def train(plan: Plan, batches, engine=None):
    if engine is None:
        engine, *_ = initialize(layers(), plan, loss_fn=F.mse_loss, config=CFG)
    return engine, [float(engine.train_batch(iter(mbl))) for mbl in batches]


def versus_deepspeed(name):
    def run():
        plan = plan_of(**PLANS[name])
        batches = data(torch.distributed.get_rank() if plan.pp == 1 else 0)
        # DeepSpeed's engine first: a pipeline engine leaves its grid as deepspeed.utils.groups' mpu
        ref = reference(config_from_plan(plan, CFG), batches)
        engine, ours = train(plan, batches)
        zo = engine._config.zero_config
        what = (zo.stage, str(zo.offload_optimizer.device) if zo.offload_optimizer else None,
                zo.offload_optimizer.ratio if zo.offload_optimizer else None,
                str(zo.offload_param.device) if zo.offload_param else None)
        err = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
        swappers = [engine.module.swapper] if hasattr(engine.module, "swapper") else \
            list(engine.ap_swap.values())
        return {"case": name, "rank": torch.distributed.get_rank(), "loss_err": err, "ours": ours,
                "swapped_bytes": sum(s.swapped_bytes for s in swappers if s is not None),
                "deepspeed": ref, "engine": type(engine).__name__, "zero": list(what),
                "optimizer": type(engine.optimizer.optimizer).__name__
                if hasattr(engine.optimizer, "optimizer") else type(engine.optimizer).__name__}
    return run


def resume(name: str, first: str, then: str, base: str = "pipe-zero1-opt"):
    """Two steps under plan ``base`` with offload ``first``, a checkpoint (the engine's
    ``save_checkpoint``: ds_autoplan's plan-independent one in the pipeline engine, DeepSpeed's
    own in its plain engine), the third step under offload ``then`` from it; against three
    uninterrupted steps under ``first``."""
    def run():
        rank = torch.distributed.get_rank()
        p = {o: plan_of(**{**PLANS[base], "offload": o}) for o in (first, then)}
        batches = data(rank if p[first].pp == 1 else 0)
        _, whole = train(p[first], batches)
        folder = tempfile.mkdtemp(prefix="ds-autoplan-offload-") if rank == 0 else None
        box = [folder]
        torch.distributed.broadcast_object_list(box)
        folder = os.path.join(box[0], "ckpt")
        engine, head = train(p[first], batches[:2])
        engine.save_checkpoint(folder)
        engine2, *_ = initialize(layers(), p[then], loss_fn=F.mse_loss, config=CFG)
        engine2.load_checkpoint(folder)
        _, tail = train(p[then], batches[2:], engine2)
        torch.distributed.barrier()
        if rank == 0:
            import shutil
            shutil.rmtree(box[0], ignore_errors=True)
        return {"case": name, "rank": rank, "whole": whole, "resumed": head + tail,
                "engine": type(engine2).__name__,
                "loss_err": max(abs(a - b) / abs(b) for a, b in zip(head + tail, whole))}
    return run


JOBS = {**{k: versus_deepspeed(k) for k in PLANS},
        **{f"resume{z}-{a}-{b}": resume(f"resume{z}-{a}-{b}", *o, base)
           for z, base in (("", "pipe-zero1-opt"), ("-zero2", "zero2-opt"))
           for a, b, o in (("off", "on", ("none", "opt")), ("on", "off", ("opt", "none")))}}


def script():
    """An unchanged DeepSpeed pipeline script (``--script [--config ds_config.json]``), for
    ``ds-autoplan launch`` and DeepSpeed's own launcher: one line per step, ``OFFLOAD_LOSS step
    loss``, and the offload its engine runs."""
    import json

    import deepspeed
    from deepspeed.pipe import PipelineModule
    deepspeed.init_distributed(dist_backend="gloo")
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(4 * MBS * N * STEPS, H, generator=g), torch.randn(4 * MBS * N * STEPS, H, generator=g)
    net = PipelineModule(layers=layers(), num_stages=1, loss_fn=F.mse_loss)
    cfg = {**CFG, "train_batch_size": 2 * MBS * N}
    if "--config" in sys.argv:
        with open(sys.argv[sys.argv.index("--config") + 1]) as fh:
            cfg = json.load(fh)
    engine, *_ = deepspeed.initialize(model=net, config=cfg, training_data=torch.utils.data.TensorDataset(xs, ys))
    for step in range(STEPS):
        loss = float(engine.train_batch())
        if torch.distributed.get_rank() == 0:
            print(f"OFFLOAD_LOSS {step} {loss!r}", flush=True)
    if torch.distributed.get_rank() == 0:
        zo = engine._config.zero_config
        print("OFFLOAD_RAN", zo.stage, zo.offload_optimizer.device if zo.offload_optimizer else None,
              engine._config.activation_checkpointing_config.cpu_checkpointing, flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()      # a live gloo group aborts the process at exit


if __name__ == "__main__":
    if "--script" in sys.argv:
        script()
        sys.exit(0)
    init_distributed()
    report_runs([JOBS[k] for k in sys.argv[1:]])
