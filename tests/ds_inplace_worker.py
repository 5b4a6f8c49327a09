"""Worker (every rank): layers whose stages start with ``nn.ReLU(inplace=True)`` trained by
ds_autoplan's DeepSpeed engine; prints one result line per schedule with the largest relative
loss error against the same layers trained without pipelining in this process."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_autoplan.runtime.deepspeed import initialize
from ds_autoplan.runtime.deepspeed.dist import init_distributed
from ds_autoplan.runtime.launch import report_runs

N, MBS, STEPS, H = 4, 2, 3, 8
# stage boundaries fall right before every in-place ReLU (and the V turn-around is local)
LPS = {"1f1b": [3, 4], "v-zb": [1, 2, 2, 2]}


def layers():
    torch.manual_seed(0)
    out = [nn.Linear(H, H)]
    for _ in range(3):
        out += [nn.ReLU(inplace=True), nn.Linear(H, H)]
    return out


def reference(data):
    """The same layers without pipelining: per step the mean micro-batch loss, SGD."""
    model = nn.Sequential(*layers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for mbl in data:
        opt.zero_grad()
        losses = [F.mse_loss(model(x), y) / len(mbl) for x, y in mbl]
        sum(losses).backward()
        opt.step()
        out.append(float(sum(losses)))
    return out


def job(name):
    def run():
        g = torch.Generator().manual_seed(1)
        data = [[(torch.randn(MBS, H, generator=g), torch.randn(MBS, H, generator=g)) for _ in range(N)]
                for _ in range(STEPS)]
        ref = reference(data)
        plan = {"pp": 2, "micro_batch_size": MBS, "num_microbatches": N, "global_batch_size": MBS * N,
                "precision": "fp32", "schedule": name, "layers_per_stage": LPS[name],
                "recompute_per_stage": [0.0] * len(LPS[name])}
        cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 10 ** 9}
        engine, *_ = initialize(layers(), plan, loss_fn=F.mse_loss, config=cfg)
        losses = [float(engine.train_batch(iter(mbl))) for mbl in data]
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        return {"schedule": name, "rank": torch.distributed.get_rank(), "loss_err": err,
                "losses": losses}
    return run


if __name__ == "__main__":
    init_distributed()
    report_runs([job(n) for n in sys.argv[1:]])
