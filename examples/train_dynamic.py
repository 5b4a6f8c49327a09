"""Train a small GPT on variable-length data with DynaPipe's dynamic micro-batches, on CPU.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_dynamic.py --steps 5

Sequence lengths are drawn from the shipped real length distribution
(``ds_autoplan/data/text_lengths.tsv``, see ``ds_autoplan.dynamic.lengths``); the tokens are
random.  Every step the planner (in a background thread, one step ahead) splits the step's
samples into micro-batches of similar length with DynaPipe's DP and builds the adaptive
schedule; DeepSpeed's PipelineEngine runs that plan (its own micro-batch count and padded
shapes) and takes its optimizer step.  Rank 0 prints one line per step.
"""
import argparse
import time

import torch
from torch.utils.data import DataLoader

from ds_autoplan.dynamic import CostModel, IterationPlanner, LengthSampler
from ds_autoplan.dynamic.sampler import DynamicBatchSampler, VarLenTokens, pad_collate
from ds_autoplan.models.tiny_gpt import GPTConfig, TinyGPT, gpt_loss
from ds_autoplan.runtime.deepspeed import initialize
from ds_autoplan.runtime.deepspeed.dist import init_distributed
from ds_autoplan.runtime.ending import finish, one_line_errors
from ds_autoplan.runtime.deepspeed.dynamic import static_plan, steps, train_batch


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--schedule", default="dynapipe", help="dynapipe (adaptive) or 1f1b")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1])
    p.add_argument("--local_rank", type=int, default=None)
    return p.parse_args()


def main():
    args = parse()
    init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.layers,
                              num_heads=4, seq_len=args.max_len))
    ds_cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
              "steps_per_print": 10 ** 9, "gradient_clipping": 1.0}
    engine, *_ = initialize(model.layers(), static_plan(world, zero_stage=args.zero),
                            loss_fn=gpt_loss, config=ds_cfg)
    lengths = LengthSampler(max_len=args.max_len, seed=0)(args.global_batch * args.steps)
    # the planner's cost model: a GPT layer of an A100-class GPU (what the split optimises)
    planner = IterationPlanner(CostModel.gpt(hidden=1024, heads=16, layers=8, stages=world), world,
                               schedule=args.schedule)
    sampler = DynamicBatchSampler(lengths, args.global_batch, planner, seed=0)
    loader = DataLoader(VarLenTokens(lengths, args.vocab), batch_sampler=sampler,
                        collate_fn=pad_collate())
    t0 = time.perf_counter()
    for plan, data in steps(engine, sampler, loader):
        loss = train_batch(engine, plan, data, hidden=args.hidden)
        if rank == 0:
            print(f"step {plan.step} loss {float(loss):.4f} micro-batches {plan.num_microbatches} "
                  f"shapes {plan.shapes} padding efficiency {plan.split.padding_efficiency:.2f} "
                  f"planning {1e3 * plan.plan_seconds:.1f} ms", flush=True)
    if rank == 0:
        print(f"{args.steps} steps in {time.perf_counter() - t0:.2f} s", flush=True)
    finish()        # every rank done: the group torn down, the rank ended (ds_autoplan/runtime/ending.py)


if __name__ == "__main__":
    with one_line_errors("train_dynamic.py"):    # a bad DS_AUTOPLAN_* value: one line, exit 2
        main()
