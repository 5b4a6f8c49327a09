"""Check of the DeepSpeed adapter on CPU ranks (tests).

Run on every rank (:func:`ds_autoplan.runtime.launch.spawn` with :data:`harness.ENV`, or the
``deepspeed`` launcher)::

    python -m harness.ds_pipeline --schedules 1f1b,v-min --n 4 [--then --zero 1 --schedules ...]

For each schedule it trains a tiny GPT for ``--steps`` optimizer steps with
:func:`ds_autoplan.initialize`, trains the same model without pipelining in this process,
and prints one ``AUTOPLAN_RESULT {json}`` line per rank: the largest relative error of the
losses and of every local parameter, the measured peak saved-activation bytes of the last
step, and the simulator's prediction for this rank from per-layer activation bytes
(:func:`harness.memory.profile_layers`).  ``ds-train`` / ``ds-dualpipev`` run DeepSpeed's own
TrainSchedule / DualPipeVSchedule engines for comparison (benchmarks).  ``--then`` starts
another group of options, run in the same process group (each result names its ``group``).
"""
from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_autoplan.models.tiny_gpt import Block, GPTConfig, TinyGPT, gpt_loss
from ds_autoplan.runtime.launch import report_runs
from harness import option_groups


# ----------------------------------------------------------------------------- models
def tiny_gpt_layers(vocab=32, hidden=16, blocks=6, seq=8, seed=0) -> list[nn.Module]:
    """The tiny GPT's pipeline layers: embedding, ``blocks`` transformer blocks, LM head."""
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=vocab, hidden=hidden, num_layers=blocks, num_heads=2,
                             seq_len=seq)).layers()


def block_layers(hidden=16, blocks=8, seed=0) -> list[nn.Module]:
    """Identical transformer blocks only (uniform stages: the paper's memory model)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(hidden=hidden, num_heads=2)
    return [Block(cfg) for _ in range(blocks)]


def synthetic_batches(steps, n, mbs, seq, vocab, seed=1, hidden=None):
    """``steps`` lists of ``n`` (tokens, next-token labels) micro-batches; with ``hidden``,
    (float input, float target) pairs for :func:`block_layers`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbl = []
        for _ in range(n):
            if hidden:
                mbl.append((torch.randn(mbs, seq, hidden, generator=g), torch.randn(mbs, seq, hidden, generator=g)))
                continue
            t = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
            mbl.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        out.append(mbl)
    return out


def model_and_data(args):
    """(layers, loss_fn, batches) of the ``--model`` the worker trains."""
    hid = args.hidden if args.model == "blocks" else None
    batches = synthetic_batches(args.steps, args.n, args.mbs, args.seq, args.vocab, hidden=hid)
    if args.model == "blocks":
        return block_layers(args.hidden, args.blocks, args.seed), F.mse_loss, batches
    return tiny_gpt_layers(args.vocab, args.hidden, args.blocks, args.seq, args.seed), gpt_loss, batches


def reference_training(layers, batches, lr, loss_fn):
    """Plain single-process training: per step the mean micro-batch loss, SGD."""
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for mbl in batches:
        opt.zero_grad()
        tot = 0.0
        for x, y in mbl:
            loss = loss_fn(model(x), y) / len(mbl)
            loss.backward()
            tot += loss.item()
        opt.step()
        losses.append(tot)
    return losses, layers


# ----------------------------------------------------------------------------- predictions
def stage_costs(sched, layers, parts, sample, recompute_layers=None, loss_fn=gpt_loss):
    """Per-stage activation bytes from per-layer profiles, as simulator Costs."""
    from ds_autoplan.schedule import Costs
    from harness.memory import profile_layers
    prof = profile_layers(copy.deepcopy(layers), sample[0], loss_fn=loss_fn, labels=sample[1])
    S, n = sched.num_stages, sched.num_microbatches
    mf, mb_, mw, keep = [], [], [], []
    x = sample[0]
    with torch.no_grad():
        ins = []
        for layer in layers:
            ins.append(x.numel() * x.element_size())
            x = layer(x)
    for s in range(S):
        rng = range(parts[s], parts[s + 1])
        mf.append(sum(prof[i][0] for i in rng))
        mb_.append(sum(prof[i][1] for i in rng))
        mw.append(sum(prof[i][2] for i in rng))
        k = (recompute_layers or {}).get(s, 0)
        keep.append(ins[parts[s]] + sum(prof[i][0] for i in rng[k:]) if k else mf[-1])
    return Costs.per_stage(S, n, 1.0, 1.0, 1.0, mem_f=mf, mem_b=mb_, mem_w=mw, keep_ckpt=keep)


# ----------------------------------------------------------------------------- worker
def _plan(name, d, n, mbs, nlayers, zero, rec, dp=1):
    from ds_autoplan.schedule import build
    opts = {"v": 2} if name == "interleaved" else {}
    sched = build(name, d, n, **opts)
    S = sched.num_stages
    base, extra = divmod(nlayers, S)
    lps = [base + (1 if s < extra else 0) for s in range(S)]
    if S == d == 2:
        lps = [lps[0] - 1, lps[1] + 1]          # uneven on purpose: the partition is honoured
    recs = [rec * (1 - s / S) for s in range(S)] if rec else [0.0] * S   # α_i rises (Merak §6.3)
    return {"pp": d, "dp": dp, "zero_stage": zero, "micro_batch_size": mbs, "num_microbatches": n,
            "global_batch_size": mbs * n * dp, "precision": "fp32", "schedule": name,
            "schedule_options": opts, "layers_per_stage": lps, "recompute_per_stage": recs}


def _local_layers(engine):
    """(global layer index, module) for every layer this rank holds."""
    mod = engine.module
    if hasattr(mod, "chunk_funcs"):
        return [(lo + i, f) for (lo, _), fs in zip(mod.chunk_bounds, mod.chunk_funcs) for i, f in enumerate(fs)]
    if hasattr(mod, "phase_funcs"):
        return [(lo + i, f) for (lo, _), fs in zip(mod.phase_bounds, mod.phase_funcs) for i, f in enumerate(fs)]
    return [(mod._local_start + i, f) for i, f in enumerate(mod.forward_funcs)]


def _rel_err(a, b):
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def _inject_failure(engine, spec, rank):
    """``spec`` = "rank:raise|kill|hang:call": fail inside the given layer-forward call."""
    r, mode, at = spec.split(":")
    if int(r) != rank:
        return
    count = [0]
    layer = _local_layers(engine)[0][1]

    def hook(*_):
        count[0] += 1
        if count[0] == int(at):
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected failure on rank {rank}")
    layer.register_forward_pre_hook(hook)


def run_one(name, args, world, rank, ref):
    import deepspeed
    from ds_autoplan.schedule import names, simulate
    from ds_autoplan.runtime.deepspeed import api
    d = world // args.dp        # every data-parallel replica sees the same batches here
    layers, loss_fn, batches = model_and_data(args)
    nlayers = len(layers)
    cfg = {"steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
           "train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.n,
           "train_batch_size": args.mbs * args.n * args.dp}
    if args.zero:
        cfg["zero_optimization"] = {"stage": args.zero}
    if args.ds_ckpt:      # DeepSpeed's own uniform checkpointing (the recompute baseline);
        # reentrant checkpointing drops the embedding's gradients when stage 0 gets token ids
        # (DeepSpeed 0.19.8's own engine fails the same way), so use the non-reentrant one
        cfg["pipeline"] = {"activation_checkpoint_interval": args.ds_ckpt, "use_reentrant": False}

    def opt(params):
        return torch.optim.SGD(params, lr=args.lr)

    if name in ("ds-train", "ds-dualpipev"):
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
        cls = DualPipeVModule if name == "ds-dualpipev" else PipelineModule
        module = cls(layers=layers, num_stages=d, loss_fn=loss_fn, partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=module, config=cfg, optimizer=opt,
                                          model_parameters=[p for p in module.parameters()])
        sim = None
    else:
        if name not in names():
            return {"schedule": name, "skipped": "not registered"}
        plan = _plan(name, d, args.n, args.mbs, nlayers, args.zero, args.recompute, args.dp)
        engine, *_ = api.initialize(layers, plan, loss_fn=loss_fn, optimizer=opt, config=cfg,
                                    track_memory=True)
        sim = simulate(engine.ap_schedule, stage_costs(engine.ap_schedule, ref["layers0"],
                                                        engine.module.parts, batches[0][0],
                                                        _all_recompute(engine), loss_fn))
    if args.fail:
        _inject_failure(engine, args.fail, rank)
    from ds_autoplan.runtime.memtrack import MemTracker
    tracker = getattr(engine, "memtracker", None)
    if tracker is None:        # DeepSpeed's own engines: count with a tracker around train_batch
        tracker = MemTracker(exclude=list(engine.module.parameters()))
    losses, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        if getattr(engine, "memtracker", None) is None:
            tracker.reset_peak()
            with tracker.track():
                loss = engine.train_batch(iter(batches[step]))
        else:
            loss = engine.train_batch(iter(batches[step]))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    res = {"schedule": name, "rank": rank, "losses": losses, "iter_time": min(times[1:] or times),
           "peak": tracker.peak, "layers": [i for i, _ in _local_layers(engine)]}
    res["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    ev = float(engine.eval_batch(iter(batches[0])))
    res["eval_err"] = abs(ev - ref["eval"]) / abs(ref["eval"])
    res["param_err"] = max(_rel_err(p.detach(), q.detach())
                           for i, layer in _local_layers(engine)
                           for p, q in zip(layer.parameters(), ref["layers"][i].parameters()))
    if sim is not None:
        res["sim_peak"] = sim.peak_memory[engine.stage_id]
        res["dp_rank"] = engine.grid.data_parallel_id
        res["sim_makespan"] = sim.makespan
    return res


def _all_recompute(engine):
    """Stage -> module layers R re-runs, for every stage (the whole-schedule simulation)."""
    from ds_autoplan.schedule.passes import recompute_layers
    mod = engine.module
    ks = recompute_layers(engine.ap_schedule, mod.plan_layer_counts)
    return {s: k + (1 if mod._joined and s == 0 and k else 0) for s, k in enumerate(ks)}


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b")
    ap.add_argument("--model", choices=["gpt", "blocks"], default="gpt")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel degree (pp = world / dp)")
    ap.add_argument("--recompute", type=float, default=0.0)
    ap.add_argument("--ds-ckpt", type=int, default=0,
                    help="DeepSpeed pipeline.activation_checkpoint_interval (uniform recompute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fail", default="", help="rank:raise|kill|hang:call (failure injection)")
    ap.add_argument("--local_rank", type=int, default=None)   # set by the deepspeed launcher
    return ap


def _jobs(argv):
    """Every option group's runs, on this rank of the process group."""
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ap = _parser()
    return (job for g, group in enumerate(option_groups(argv)) for job in _group_jobs(ap.parse_args(group), g, world, rank))


def main(argv=None):
    torch.set_num_threads(1)
    report_runs(_jobs(sys.argv[1:] if argv is None else argv))


def groups_case(case) -> dict:
    """A launcher case (:func:`ds_autoplan.runtime.launch.launch`, ``harness.forked``): the
    option groups of ``case["argv"]`` on the launcher's process group; their results under
    ``"rows"``."""
    return {"rows": [job() for job in _jobs(case["argv"])]}


def _group_jobs(args, group, world, rank):
    """One option group's runs (each result tagged with ``group``), after its reference."""
    layers0, loss_fn, batches = model_and_data(args)
    losses, layers = reference_training(copy.deepcopy(layers0), batches, args.lr, loss_fn)
    with torch.no_grad():
        model = nn.Sequential(*layers)
        ev = sum(float(loss_fn(model(x), y)) for x, y in batches[0]) / len(batches[0])
    ref = {"losses": losses, "layers": layers, "layers0": layers0, "eval": ev}
    for name in args.schedules.split(","):
        yield lambda name=name: {**run_one(name, args, world, rank, ref), "group": group}


if __name__ == "__main__":
    main()
