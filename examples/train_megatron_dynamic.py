"""Train a small megatron-core GPTModel on variable-length samples with DynaPipe micro-batches.

    torchrun --nproc_per_node 2 examples/train_megatron_dynamic.py --steps 5

Every optimizer step has its own plan (ds_autoplan.dynamic; planned one step ahead in a
background thread): micro-batches of similar length cut by DynaPipe's dynamic programme,
an adaptive pipeline schedule for them, and the shape (mbs, padded length) of every
micro-batch, so our Megatron forward_backward_func posts each receive with the right
buffer and no shape handshake.  Micro-batch losses are weighted by their share of the
step's tokens: the gradient is the one of the whole step's samples in one batch.
Prints, per step on the last pipeline rank, the micro-batch shapes and the loss.
"""
import argparse
import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from ds_autoplan.runtime.ending import finish, one_line_errors
from ds_autoplan.dynamic import CostModel, IterationPlanner, LengthSampler
from ds_autoplan.dynamic.sampler import DynamicBatchSampler, pad_collate
from ds_autoplan.runtime.megatron import ScheduleRunner, cpu_shim, initialize, loss_weights, step_kwargs
from ds_autoplan.plan import Plan


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--samples", type=int, default=400, help="dataset size")
    p.add_argument("--max-len", type=int, default=64, help="longest sample (tokens)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


class ToyText(torch.utils.data.Dataset):
    """A learnable toy task: the next token is the current one plus one."""

    def __init__(self, lengths, vocab):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (len(lengths),), generator=g)
        self.items = [(int(s) + torch.arange(int(n))) % vocab for s, n in zip(start, lengths)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main():
    args = parse()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    d = dist.get_world_size()
    if args.layers % d:
        raise SystemExit(f"--layers {args.layers} must be a multiple of the {d} ranks")
    # the static plan fixes the partition and placement; each step brings its own schedule
    setup = initialize(Plan(pp=d, num_microbatches=1, micro_batch_size=1, schedule="1f1b",
                            layers_per_stage=[args.layers // d] * d, recompute_per_stage=[0.0] * d,
                            precision="fp32"))
    cfg = TransformerConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            deallocate_pipeline_outputs=True, **setup.config_overrides)
    model = [GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                      vocab_size=args.vocab, max_sequence_length=args.max_len,
                      pre_process=setup.pre_process(), post_process=setup.post_process(),
                      share_embeddings_and_output_weights=False)]
    opt = torch.optim.AdamW(model[0].parameters(), lr=args.lr)

    # real lengths (the shipped distribution), divided by 4 for the toy model's context
    lengths = np.clip(LengthSampler(seed=1)(args.samples) // 4, 2, args.max_len)
    # micro-batches are cut for the costs of a 7B-like GPT (the toy model runs the same shapes)
    cost = CostModel.gpt(hidden=4096, heads=32, layers=32, stages=d)
    sampler = DynamicBatchSampler(lengths, args.global_batch, IterationPlanner(cost, d), seed=0)
    loader = iter(DataLoader(ToyText(lengths, args.vocab), batch_sampler=sampler,
                             collate_fn=pad_collate(pad_to=cost.pad_to)))
    fb = ScheduleRunner(None)

    def forward_step(data_it, model):
        tok, lab = next(data_it)
        b, L = tok.shape
        pos = torch.arange(L).unsqueeze(0).expand(b, L)
        causal = torch.triu(torch.ones(1, 1, L, L, dtype=torch.bool), diagonal=1)
        mask = (lab != -100).float()   # padding carries no loss
        out = model(tok, pos, causal, labels=lab.clamp(min=0))

        def loss_func(o):
            loss = (o.float() * mask).sum() / mask.sum()
            return loss, {"loss": loss.detach().clone()}
        return out, loss_func

    for step in range(args.steps):
        first = next(loader)
        plan = sampler.pop_plan()
        batches = [first] + [next(loader) for _ in range(plan.num_microbatches - 1)]
        w = loss_weights([int((lab != -100).sum()) for _, lab in batches])
        opt.zero_grad(set_to_none=True)
        losses = fb(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                    microbatch_weights=w, **step_kwargs(plan))
        opt.step()
        if losses:
            loss = sum(wi * float(x["loss"]) for wi, x in zip(w, losses))
            shapes = " ".join(f"{b}x{L}" for b, L in plan.shapes)
            print(f"step {step} micro-batches {plan.num_microbatches} [{shapes}] loss {loss:.4f}",
                  flush=True)
    finish()        # every rank done: the group torn down, the rank ended (ds_autoplan/runtime/ending.py)


if __name__ == "__main__":
    with one_line_errors("train_megatron_dynamic.py"), cpu_shim():   # cpu_shim: Megatron's RNG tracker etc. on CPU torch
        main()
