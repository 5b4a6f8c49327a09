"""A training script whose compute is a cluster's, not this machine's: gpt-tiny's layers as
calibrated-sleep layers (:func:`ds_autoplan.models.sleep.cost_model_layers`) that take what the
cost model gives them on ``--truth`` (a cluster file) at the plan's micro-batch, trained by
ds_autoplan's DeepSpeed engine with real gloo transfers and a real optimizer.  On 2 shared
cores a plan's measured time is then the truth's, not the cores' contention (DEVELOPERS.md).

    DS_AUTOPLAN_PLAN=plan.json deepspeed --num_gpus 2 tests/harness/sleep_gpt.py --truth T.yaml --steps 10 [--load DIR]

The data position is the step: step k trains the global batch drawn from seed k, each
data-parallel rank its slice, so a run resumed at ``engine.global_steps`` trains every sample
once whatever the plan.  Rank 0 prints ``step K loss L`` (all digits)."""
from __future__ import annotations

import argparse
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--truth", required=True, help="the cluster file whose compute the layers take")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--load", default=None, help="engine.load_checkpoint folder to resume from")
    p.add_argument("--local_rank", type=int, default=None)
    a = p.parse_args()
    import torch
    import torch.nn.functional as F

    from ds_autoplan.models.sleep import cost_model_layers
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.deepspeed import initialize
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from ds_autoplan.spec.cluster import load_cluster
    from ds_autoplan.spec.model import load_model
    torch.set_num_threads(1)
    init_distributed()
    plan = Plan.load(os.environ["DS_AUTOPLAN_PLAN"])
    layers = cost_model_layers("gpt-tiny", load_cluster(a.truth), plan.micro_batch_size)
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True}
    engine, *_ = initialize(layers, plan, loss_fn=F.mse_loss, config=cfg)
    if a.load:
        engine.load_checkpoint(a.load)
    dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
    hidden, dp = load_model("gpt-tiny").hidden, engine.grid.data_parallel_id
    per, mbs = plan.global_batch_size // plan.dp, plan.micro_batch_size
    for step in range(engine.global_steps, a.steps):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(plan.global_batch_size, plan.seq_len, hidden, generator=g).to(dtype) for _ in "xy")
        xs, ys = x[dp * per:(dp + 1) * per], y[dp * per:(dp + 1) * per]
        loss = engine.train_batch(iter([(xs[i * mbs:(i + 1) * mbs], ys[i * mbs:(i + 1) * mbs])
                                        for i in range(plan.num_microbatches)]))
        if torch.distributed.get_rank() == 0:
            print(f"step {step} loss {float(loss)!r}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
