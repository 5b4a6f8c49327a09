"""Train a small megatron-core GPTModel with any ds_autoplan schedule, on CPU ranks with gloo.

    torchrun --nproc_per_node 2 examples/train_megatron.py --schedule v-zb --microbatches 4
    torchrun --nproc_per_node 4 examples/train_megatron.py --schedule v-half --microbatches 8 --layers 8
    torchrun --nproc_per_node 2 examples/train_megatron.py --plan out/plan.json

``ds_autoplan.runtime.megatron.initialize(plan)`` sets up Megatron's parallel state and says how to
build this rank's model chunks (layer layout, V placement, per-stage recompute);
``get_forward_backward_func(plan)`` is a drop-in for Megatron's schedule function.
Prints the mean loss of every step on the rank that holds the last stage.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from ds_autoplan.runtime.ending import finish, one_line_errors
from ds_autoplan.runtime.megatron import (cpu_shim, get_forward_backward_func, initialize,
                                  split_backward_spec)
from ds_autoplan.plan import Plan
from ds_autoplan.schedule import build
from ds_autoplan.search.pipeline import schedule_options


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="1f1b", help="any registered ds_autoplan schedule")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=None,
                   help="transformer layers (default: enough to fill every stage of the schedule "
                        "on these ranks, at least 4)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recompute", type=float, default=0.0,
                   help="fraction of each stage's layers recomputed (Megatron block recompute)")
    p.add_argument("--plan", default=os.environ.get("DS_AUTOPLAN_PLAN"), help="plan.json")
    return p.parse_args()


def flag_plan(args, world: int) -> Plan:
    """A pure-pipeline plan over ``world`` ranks from the flags; one rank trains unpipelined."""
    opts = schedule_options(args.schedule, 2)
    S = 1 if world == 1 else build(args.schedule, world, args.microbatches, **opts).num_stages
    layers = args.layers or S * -(-4 // S)     # the fewest, at least 4, filling every stage evenly
    if layers % S:
        raise SystemExit(f"--layers {layers} must be a multiple of the {S} stages of "
                         f"{args.schedule!r} on {world} ranks")
    return Plan(pp=world, micro_batch_size=args.mbs, num_microbatches=args.microbatches,
                global_batch_size=args.mbs * args.microbatches, precision="fp32", schedule=args.schedule,
                schedule_options=opts, layers_per_stage=[layers // S] * S,
                recompute_per_stage=[args.recompute] * S, num_layers=layers)


def main():
    args = parse()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    plan = Plan.load(args.plan) if args.plan else flag_plan(args, dist.get_world_size())
    setup = initialize(plan)          # parallel_state + TransformerConfig overrides for this rank
    cfg = TransformerConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            deallocate_pipeline_outputs=True, **setup.config_overrides)
    spec = split_backward_spec(get_gpt_layer_local_spec())   # linear layers with a B/W split
    chunks = [GPTModel(config=setup.chunk_config(cfg, c), transformer_layer_spec=spec,
                       vocab_size=args.vocab, max_sequence_length=args.seq,
                       pre_process=setup.pre_process(c), post_process=setup.post_process(c),
                       share_embeddings_and_output_weights=False, vp_stage=setup.vp_stage(c))
              for c in range(setup.num_chunks)]
    opt = torch.optim.AdamW([p for m in chunks for p in m.parameters()], lr=args.lr)
    fb = get_forward_backward_func(plan)

    mbs, seq = plan.micro_batch_size, args.seq
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # causal

    def batches(step):
        g = torch.Generator().manual_seed(step)
        while True:  # a learnable toy task: the next token is the current one plus one
            tok = torch.randint(0, args.vocab, (mbs, seq), generator=g)
            tok = (tok[:, :1] + torch.arange(seq)) % args.vocab
            yield tok, (tok + 1) % args.vocab

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_it, model):
        tok, lab = next(data_it)
        return model(tok, pos, mask, labels=lab), loss_func

    for step in range(args.steps):
        its = [batches(step) for _ in chunks]  # one iterator per chunk, as for Megatron's VPP
        opt.zero_grad(set_to_none=True)
        losses = fb(forward_step_func=forward_step,
                    data_iterator=its if len(chunks) > 1 else its[0], model=chunks,
                    num_microbatches=plan.num_microbatches, seq_length=seq, micro_batch_size=mbs)
        opt.step()
        if losses:
            mean = sum(float(x["loss"]) for x in losses) / len(losses)
            print(f"step {step} schedule {plan.schedule} pp-rank {setup.pp_rank} loss {mean:.4f}",
                  flush=True)
    finish()        # every rank done: the group torn down, the rank ended (ds_autoplan/runtime/ending.py)


if __name__ == "__main__":
    with one_line_errors("train_megatron.py"), cpu_shim():   # cpu_shim: Megatron's RNG tracker etc. on CPU torch
        main()
