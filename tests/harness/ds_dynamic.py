"""Check of dynamic micro-batching in the DeepSpeed runtime (tests).

On every rank (:func:`ds_autoplan.runtime.launch.spawn` with :data:`harness.ENV`, or the
``deepspeed`` launcher)::

    python -m harness.ds_dynamic --steps 2 --runs dynapipe:0:tokens,1f1b:1:tokens [--then --dp 2 ...]

Draws sequence lengths from the shipped real distribution, plans every step with DynaPipe
(DP micro-batching + adaptive schedule, ``DynamicBatchSampler`` in a background thread),
trains the tiny GPT with :func:`dynamic.train_batch` through a torch ``DataLoader`` over the
sampler, and compares with the unpipelined model trained on each step's samples as one
padded batch (mean next-token loss over all real tokens).  Prints one ``AUTOPLAN_RESULT
{json}`` line per rank and run (schedule, ZeRO stage, loss weight): shapes per step and
the largest relative error of the losses and of every local parameter.  ``--then`` starts
another group of options, run in the same process group (each result names its ``group``).
"""
from __future__ import annotations

import argparse
import copy
import sys

import numpy as np
import torch
import torch.nn as nn

from ds_autoplan.dynamic.sampler import VarLenTokens
from ds_autoplan.runtime.launch import report_runs
from harness import option_groups


def make_sampler(args, lengths, dp, dp_rank, schedule="dynapipe"):
    from ds_autoplan.dynamic import CostModel, IterationPlanner
    from ds_autoplan.dynamic.sampler import DynamicBatchSampler
    # an A100-class GPT layer cost: with these lengths the DP cuts 2-5 micro-batches per step
    cost = CostModel.gpt(hidden=args.cost_hidden, heads=16, layers=8, stages=args.pp)
    planner = IterationPlanner(cost, args.pp, schedule=schedule)
    return DynamicBatchSampler(lengths, args.gbs, planner, seed=args.seed, num_replicas=dp,
                               rank=dp_rank, prefetch=1)


def reference(layers, ds, steps_idx, lr, loss_fn, collate):
    """Unpipelined: each step's samples as one padded batch, SGD."""
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for idx in steps_idx:
        x, y = collate([ds[int(i)] for i in idx])
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, layers


def run(args, schedule, zero, weight, recompute, ref, layers0, ds, lengths):
    from torch.utils.data import DataLoader

    from ds_autoplan.dynamic.sampler import pad_collate
    from ds_autoplan.models.tiny_gpt import gpt_loss
    from ds_autoplan.runtime.deepspeed import api, dynamic
    from harness.ds_pipeline import _local_layers, _rel_err
    cfg = {"steps_per_print": 10 ** 9, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}
    plan = dynamic.static_plan(args.pp, dp=args.dp, zero_stage=zero,
                               recompute_per_stage=[recompute] * args.pp)
    engine, *_ = api.initialize([copy.deepcopy(m) for m in layers0], plan, loss_fn=gpt_loss, config=cfg,
                                optimizer=lambda p: torch.optim.SGD(p, lr=args.lr))
    sampler = make_sampler(args, lengths, args.dp, engine.grid.data_parallel_id, schedule)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate())
    losses, shapes = [], []
    for plan, data in dynamic.steps(engine, sampler, loader):
        if plan.step >= args.steps:
            break
        w = [1.0] * plan.num_microbatches if weight == "uniform" else weight   # uniform: DeepSpeed's 1/n
        losses.append(float(dynamic.train_batch(engine, plan, data, hidden=args.hidden, weight=w)))
        shapes.append([list(s) for s in plan.shapes])
    res = {"schedule": schedule, "zero": zero, "weight": weight, "recompute": recompute, "rank": torch.distributed.get_rank(),
           "dp_rank": engine.grid.data_parallel_id, "losses": losses, "shapes": shapes,
           "ref_losses": ref["losses"], "gas": engine.gradient_accumulation_steps(),
           "handshakes": len(engine._meta_sent) + len(engine._recv_meta),
           "recomputed_layers": sum(engine.module.recompute_layers.values()),
           "layers": [i for i, _ in _local_layers(engine)]}
    res["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    res["param_err"] = max(_rel_err(p.detach(), q.detach()) for i, layer in _local_layers(engine)
                           for p, q in zip(layer.parameters(), ref["layers"][i].parameters()))
    res["errors"] = _misuse(args, engine, sampler) if args.misuse else {}
    res["moved"] = max(float((p.detach() - q.detach()).abs().max()) for i, layer in _local_layers(engine)
                       for p, q in zip(layer.parameters(), layers0[i].parameters()))
    return res


def _misuse(args, engine, sampler) -> dict:
    """The messages of a schedule for other ranks, of a loader whose shapes differ from the
    plan (every rank here loads data, so every rank stops before any transfer) and of ranks
    holding different plans (every rank stops at the plan check)."""
    from ds_autoplan.schedule import build
    from ds_autoplan.runtime.deepspeed import dynamic
    out = {}
    try:
        engine.set_step_schedule(build("1f1b", args.pp + 1, 2))
    except ValueError as e:
        out["placement"] = str(e)
    plan = next(iter(sampler.iter_plans()))
    wrong = [(torch.zeros(m, L + 1, dtype=torch.long),) * 2 for m, L in plan.shapes]
    try:
        dynamic.train_batch(engine, plan, iter(wrong), hidden=args.hidden)
    except ValueError as e:
        out["shape"] = str(e)
    plans = sampler.iter_plans()     # pipeline rank r takes step r's plan: they differ
    mine = [next(plans) for _ in range(engine.stage_id + 1)][-1]
    try:
        dynamic.train_batch(engine, mine, iter([]), hidden=args.hidden)
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gbs", type=int, default=12, help="samples per optimizer step (all replicas)")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--cost-hidden", type=int, default=1024, help="hidden size of the cost model")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--runs", default="dynapipe:0:tokens",
                    help="comma-separated SCHEDULE:ZERO:WEIGHT[:RECOMPUTE] (schedule dynapipe|1f1b, "
                         "ZeRO 0|1, loss weight tokens|samples|uniform, recomputed fraction of "
                         "each stage's layers)")
    ap.add_argument("--misuse", action="store_true", help="also report the misuse errors")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local_rank", type=int, default=None)
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    torch.set_num_threads(1)
    init_distributed()
    groups = option_groups(sys.argv[1:] if argv is None else argv)
    report_runs(job for g, group in enumerate(groups) for job in _group_jobs(ap.parse_args(group), g))


def _group_jobs(args, group):
    """One option group's runs (each result tagged with ``group``), after its reference."""
    from ds_autoplan.dynamic import LengthSampler
    from ds_autoplan.dynamic.sampler import pad_collate
    from ds_autoplan.models.tiny_gpt import GPTConfig, TinyGPT, gpt_loss
    args.pp = torch.distributed.get_world_size() // args.dp
    lengths = LengthSampler(max_len=args.max_len, seed=args.seed)(args.gbs * args.steps)
    ds = VarLenTokens(lengths, args.vocab, args.seed)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=args.vocab, hidden=args.hidden, num_layers=args.blocks,
                              num_heads=4, seq_len=args.max_len))
    layers0 = model.layers()
    # the step's samples over all replicas, as the sampler deals them
    probe = make_sampler(args, lengths, 1, 0)
    steps_idx = [np.asarray(i) for i in probe.step_indices()[:args.steps]]
    losses, layers = reference(copy.deepcopy(layers0), ds, steps_idx, args.lr, gpt_loss, pad_collate())
    ref = {"losses": losses, "layers": layers}
    for spec in args.runs.split(","):
        schedule, zero, weight, *rec = spec.split(":")
        yield lambda schedule=schedule, zero=zero, weight=weight, rec=rec: {
            **run(args, schedule, int(zero), weight, float(rec[0]) if rec else 0.0, ref, layers0, ds,
                  lengths), "group": group}


if __name__ == "__main__":
    main()
