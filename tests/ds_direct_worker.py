"""Worker (every rank) for tests/test_runtime_deepspeed_direct.py.

``decide``: the engine built from each DeepSpeed config of :data:`CONFIGS`; one row per config
with ``ap_direct`` (F/B call the module and autograd directly) and ``ap_wrapped`` (what
DeepSpeed's forward/backward wrappers would do instead).

``compare SCHEDULE...``: per schedule the same layers, batches and plan trained twice for
:data:`STEPS` steps, F/B direct and then through DeepSpeed's wrappers (``ap_direct`` turned off
by hand); one row per schedule with whether every step's loss and every gradient that reaches
the optimizer step are bitwise equal.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_autoplan.runtime.deepspeed import initialize
from ds_autoplan.runtime.deepspeed.dist import init_distributed
from ds_autoplan.runtime.launch import report_runs

N, MBS, STEPS, H, LAYERS = 4, 2, 2, 8, 8
BASE = {"steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True}
# name -> DeepSpeed config over BASE (and the plan's precision)
CONFIGS = {"fp32": ({}, "fp32"),
           "fp32-zero1": ({"zero_optimization": {"stage": 1}}, "fp32"),
           "bf16": ({"bf16": {"enabled": True}}, "bf16"),
           "torch_autocast": ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "fp32"),
           "wall_clock_breakdown": ({"wall_clock_breakdown": True}, "fp32"),
           "memory_breakdown": ({"memory_breakdown": True}, "fp32")}


def layers():
    torch.manual_seed(0)
    out = []
    for _ in range(LAYERS // 2):
        out += [nn.Linear(H, H), nn.Tanh()]
    return out


def engine(name, cfg, precision, recompute=0.0):
    from ds_autoplan.schedule import build
    S = build(name, 2, N).num_stages
    plan = {"pp": 2, "micro_batch_size": MBS, "num_microbatches": N, "global_batch_size": MBS * N,
            "precision": precision, "schedule": name, "layers_per_stage": [LAYERS // S] * S,
            "recompute_per_stage": [recompute] * S}
    e, *_ = initialize(layers(), plan, loss_fn=F.mse_loss, config={**BASE, **cfg})
    return e


def decide(name):
    def run():
        from ds_autoplan.runtime.deepspeed.engine import hook_work
        cfg, precision = CONFIGS[name]
        e = engine("1f1b", cfg, precision)
        row = {"config": name, "rank": torch.distributed.get_rank(), "direct": e.ap_direct,
               "wrapped": e.ap_wrapped, "bare": e._ap_hooks is not None, "hooks": hook_work(e)}
        if name == "fp32":      # F skips DeepSpeed's hooks, still starts the throughput timer,
            train(e)            # and a hook the user adds runs
            row["timer"] = [e.tput_timer.config.enabled, e.tput_timer.started]
            calls = []
            e.module.register_forward_hook(lambda *_: calls.append(1))
            train(e)
            row["user_hook_calls"] = len(calls)
        return row
    return run


def train(e):
    """Every step's loss and the gradients its optimizer step sees."""
    grads, losses = [], []
    step = e._exec_optimizer_step

    def recorded():
        grads.append([p.grad.clone() for p in e.module.parameters()])
        step()
    e._exec_optimizer_step = recorded
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        data = [(torch.randn(MBS, H, generator=g), torch.randn(MBS, H, generator=g)) for _ in range(N)]
        losses.append(e.train_batch(iter(data)).clone())
    return losses, grads


def compare(name, recompute):
    def run():
        direct = engine(name, {}, "fp32", recompute)
        wrapped = engine(name, {}, "fp32", recompute)
        wrapped.ap_direct = False
        (la, ga), (lb, gb) = train(direct), train(wrapped)
        same = all(torch.equal(a, b) for a, b in zip(la, lb)) and len(ga) == len(gb) == STEPS \
            and all(torch.equal(a, b) for sa, sb in zip(ga, gb) for a, b in zip(sa, sb))
        return {"schedule": name, "recompute": recompute, "rank": torch.distributed.get_rank(),
                "direct": direct.ap_direct, "identical": same, "grads": sum(len(s) for s in ga)}
    return run


if __name__ == "__main__":
    init_distributed()
    what, *names = sys.argv[1:]
    if what == "decide":
        report_runs([decide(n) for n in CONFIGS])
    else:
        report_runs([compare(n, r) for n in names for r in (0.0, 0.5)])
