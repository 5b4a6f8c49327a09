"""Train a small GPT with DeepSpeed's PipelineEngine and any ds_autoplan schedule, on CPU.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_deepspeed.py --schedule v-zb --microbatches 4
    ds-autoplan launch --model gpt-tiny --num_gpus 2 examples/train_deepspeed.py   # plans first
    DS_AUTOPLAN_MODEL=gpt-tiny deepspeed --autoplan --num_gpus 2 examples/train_deepspeed.py

With a plan (``--plan plan.json``, or ``$DS_AUTOPLAN_PLAN`` from ``--autoplan`` /
``ds-autoplan launch`` given a model) the plan decides parallelism, partition, schedule and
recomputation; otherwise the flags build a pure-pipeline plan for the world size.
Prints the loss of every optimizer step on rank 0.

Resume the DeepSpeed way, also under another plan (schedule, pp, dp, ZeRO 0/1):

    ... train_deepspeed.py --schedule v-half --steps 2 --save ckpt
    ... train_deepspeed.py --schedule 1f1b --steps 4 --load ckpt     # continues with step 2
"""
import argparse
import os
import sys

import torch

from ds_autoplan.errors import PlanError
from ds_autoplan.models.tiny_gpt import GPTConfig, TinyGPT, gpt_loss
from ds_autoplan.plan import Plan
from ds_autoplan.runtime.deepspeed import as_plan, initialize
from ds_autoplan.runtime.deepspeed.dist import init_distributed
from ds_autoplan.runtime.ending import finish, one_line_errors
from ds_autoplan.schedule import build
from ds_autoplan.search.pipeline import schedule_options


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="1f1b", help="any registered ds_autoplan schedule")
    # not "--n": DeepSpeed's launcher parser would take it for an abbreviation of its options
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=None,
                   help="transformer blocks (default: enough to fill every stage of the schedule "
                        "on these ranks, at least 4)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--zero", type=int, default=0, choices=[0, 1])
    p.add_argument("--recompute", type=float, default=0.0,
                   help="fraction of each stage's layers to recompute")
    p.add_argument("--plan", default=None, help="plan.json (default: $DS_AUTOPLAN_PLAN)")
    p.add_argument("--save", default=None, help="engine.save_checkpoint folder after the last step")
    p.add_argument("--load", default=None, help="engine.load_checkpoint folder to resume from")
    p.add_argument("--deepspeed_config", default=None)
    p.add_argument("--local_rank", type=int, default=None)
    return p.parse_args()


def default_layers(stages: int) -> int:
    """The fewest layers, at least 4, that give every stage the same number (at least one)."""
    return stages * -(-4 // stages)


def flag_plan(args, world):
    """A pure-pipeline plan over ``world`` ranks from the flags; one rank trains unpipelined
    (one stage: there is no pipeline for the schedule to order)."""
    opts = schedule_options(args.schedule, 2)
    S = 1 if world == 1 else build(args.schedule, world, args.microbatches, **opts).num_stages
    layers = args.layers or default_layers(S)
    base, extra = divmod(layers, S)
    return Plan(pp=world, dp=1, micro_batch_size=args.mbs, num_microbatches=args.microbatches,
                global_batch_size=args.mbs * args.microbatches, precision="fp32", schedule=args.schedule,
                schedule_options=opts, zero_stage=args.zero, num_layers=layers,
                seq_len=args.seq,
                layers_per_stage=[base + (s < extra) for s in range(S)],
                recompute_per_stage=[args.recompute] * S)


def batches(plan, cfg, dp_rank):
    """The same synthetic micro-batches every step (so the loss visibly falls)."""
    g = torch.Generator().manual_seed(dp_rank)
    for _ in range(plan.num_microbatches):
        ids = torch.randint(0, cfg.vocab_size, (plan.micro_batch_size, cfg.seq_len + 1), generator=g)
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def main():
    args = parse()
    init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    planned = args.plan or os.environ.get("DS_AUTOPLAN_PLAN")
    try:
        plan = as_plan(planned) if planned else flag_plan(args, world)
    except PlanError as e:
        if rank == 0:
            print(f"train_deepspeed.py: error: {e}", file=sys.stderr, flush=True)
        finish(2, barrier=False)
    cfg = GPTConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=plan.num_layers or args.layers or 4,
                    num_heads=4, seq_len=plan.seq_len or args.seq)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ds_cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
              "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True}
    if args.deepspeed_config:
        import json
        with open(args.deepspeed_config) as fh:
            ds_cfg.update(json.load(fh))
    engine, *_ = initialize(model.layers(), plan, loss_fn=gpt_loss, config=ds_cfg)
    dp_rank = engine.grid.data_parallel_id
    if rank == 0:
        print(f"plan: pp={plan.pp} dp={plan.dp} schedule={plan.schedule_label} layers={cfg.num_layers} "
              f"layers_per_stage={plan.layers_per_stage} recompute={plan.recompute_per_stage}",
              flush=True)
    if args.load:
        path, client_state = engine.load_checkpoint(args.load)     # (None, None): nothing to resume
        if rank == 0 and path:
            print(f"resumed from {path} ({client_state}) at step {engine.global_steps}", flush=True)
    for step in range(engine.global_steps, args.steps):
        loss = engine.train_batch(batches(plan, cfg, dp_rank))
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f}\n  next lr {engine.get_lr()[0]:.6g}", flush=True)
    if args.save:
        engine.save_checkpoint(args.save, client_state={"schedule": plan.schedule})
    finish()        # every rank done: the group torn down, the rank ended (ds_autoplan/runtime/ending.py)


if __name__ == "__main__":
    with one_line_errors("train_deepspeed.py"):    # a bad DS_AUTOPLAN_* value: one line, exit 2
        main()
