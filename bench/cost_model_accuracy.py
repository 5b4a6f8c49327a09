"""Cost-model accuracy: predicted vs measured iteration time and per-rank peak activation bytes.

Cases: schedule (1f1b, gpipe, interleaved v=2) x partition (even, skewed) x micro-batch size
(1, 2, 4) x stage-aware recomputation, gpt-tiny on 2 gloo CPU ranks.

Prediction (the cost model): the ``ds_autoplan.profile`` profile of gpt-tiny (per-layer forward
and backward time timed inside whole-model steps, saved-for-backward bytes, boundary bytes) plus
runtime micro-benchmarks (one-way p2p time of a boundary tensor; the DeepSpeed engine's own time
per forward/backward/transfer action and per step, measured on a model with no compute but the
same parameter tensors) fed to the schedule simulator (``lower`` + ``simulate``).  The per-step
time is what a step spends outside the simulated actions: before the first one, and from the
last action's end on any rank to the step's end (gradient reductions, the gradient-norm
all-reduce of DeepSpeed's default clipping, optimizer, loss aggregation).  It is measured on the
null model with gpt-tiny's parameter *tensors* (one flat tensor per layer under-counted that
per-tensor work by about 2 ms a step) and from the last action's end (a per-rank sum counted
one rank's wait in the norm all-reduce).  ``--diagnose`` prints, per case and rank, the
measured mean time of every action (p2p waits excluded) next to the cost the model uses.

Measurement: the real DeepSpeed PipelineEngine (``ds_autoplan.runtime.deepspeed.initialize``,
the action-list adapter): median ``train_batch`` wall time (max over ranks) and the engine's
peak saved-activation bytes per rank (``runtime.memtrack``, one extra step).

The machine is shared, so the profile samples, the micro-benchmarks and the measured steps run
in interleaved rounds on the same two ranks: a burst of load hits the cost model's inputs and
the measurement alike, and medians drop it.  Nothing measured on the real runs feeds the
prediction.

    python bench/cost_model_accuracy.py [--quick] [--json out.json] [--timing isolated]
                                        [--verbose] [--diagnose]

Prints one row per case and the medians; the last line is a JSON object with
"median_time_error" and "median_memory_error" (relative errors; max over ranks for memory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure as M  # noqa: E402

import torch  # noqa: E402

WORLD = 2
MODEL = "gpt-tiny"


def configs(quick: bool) -> list[dict]:
    """schedule x partition x micro-batch size [x recomputed fraction per stage]
    (10 layers: embed, 8 blocks, head)."""
    parts = {"even": {2: [5, 5], 4: [3, 2, 2, 3]}, "skew": {2: [4, 6], 4: [2, 3, 2, 3]}}
    grid = [("1f1b", "even", 2, 0), ("gpipe", "even", 2, 0.5), ("1f1b", "skew", 4, 0),
            ("interleaved", "even", 2, 0)]
    if not quick:
        grid += [("1f1b", "even", 1, 0), ("1f1b", "even", 4, 0), ("gpipe", "skew", 4, 0),
                 ("interleaved", "skew", 4, 0), ("1f1b", "skew", 1, 0), ("gpipe", "even", 1, 0),
                 ("gpipe", "even", 2, 0), ("1f1b", "even", 2, 0.6), ("gpipe", "skew", 2, 0.5),
                 ("interleaved", "even", 2, 0.5)]
    out = []
    for sched, part, mbs, rec in grid:
        S = 2 * WORLD if sched == "interleaved" else WORLD
        out.append({"schedule": sched, "options": {"v": 2} if sched == "interleaved" else {},
                    "partition": part, "layers_per_stage": parts[part][S], "mbs": mbs,
                    "n": 4 if quick else 8, "recompute": [rec] * S})
    return out


# --------------------------------------------------------------------------- prediction
def predict(cfg: dict, profs: list) -> dict:
    """Simulator prediction; stage s is timed with the profile taken on its rank.  Stage-aware
    recomputation as the adapter runs it: the first ``round(x * layers)`` layers of a stage
    keep only their input and are re-run by an early R action (docs/merak.md §5.2, §6)."""
    from ds_autoplan.schedule import Costs, build, lower, simulate
    from ds_autoplan.schedule.passes import add_recompute
    sched = build(cfg["schedule"], WORLD, cfg["n"], **cfg["options"])
    S, lps = sched.num_stages, cfg["layers_per_stage"]
    ks = [round(x * c) for x, c in zip(cfg["recompute"], lps)]
    if any(ks):
        sched = add_recompute(sched, ks)
    prof = profs[0]
    bounds, lo = [], 0
    for c in lps:
        bounds.append((lo, lo + c))
        lo += c
    own, act, keep = [], [], []     # per stage: the engine's own (F, B, R) time
    for s, (lo, hi) in enumerate(bounds):
        pr = profs[sched.placement[s]]
        # + the engine's own time per action, and for a cross-rank input its receive
        recv_f = s > 0 and sched.placement[s - 1] != sched.placement[s]
        recv_b = s < S - 1 and sched.placement[s + 1] != sched.placement[s]
        own.append((pr.overhead["F"] + recv_f * pr.overhead["comm"],
                     pr.overhead["B"] + recv_b * pr.overhead["comm"], pr.overhead["F"]))
        act.append(prof.stage_act_bytes(lo, hi))
        # recomputed stage keeps its input (checkpoint) and the rest of the stage's stash
        keep.append(prof.units[lo].act_input_bytes + prof.stage_act_bytes(lo + ks[s], hi)
                    if ks[s] else act[-1])
    p2p = max(p.overhead["p2p"] for p in profs)    # measured one-way boundary transfer
    times = [(*p.stage_times(lo, hi), p.stage_times(lo, lo + k, with_loss=False)[0])
             for (lo, hi), k, p in zip(bounds, ks, (profs[r] for r in sched.placement))]
    f, b, r = ([t[j] + o[j] for t, o in zip(times, own)] for j in range(3))
    costs = Costs.per_stage(S, cfg["n"], f, b, 0.0, r=r, mem_f=act, mem_b=[-a for a in act],
                            mem_w=0.0, keep_ckpt=keep, p2p=p2p,
                            send=max(p.overhead["comm"] for p in profs))
    res = simulate(lower(sched, costs), costs, blocking=False)
    # + once per step: optimizer, gradient reductions, loss aggregation (runtime benchmark)
    step = max(p.overhead["step"] for p in profs)
    return {"time": res.makespan + step, "peak": list(res.peak_memory),
            "costs": {"F": f, "B": b, "R": r, "step": step, "send": costs.send, "p2p": p2p,
                      "busy": list(res.busy), "makespan": res.makespan}}


def diagnose(cfg: dict, pred: dict, diag: list) -> None:
    """Per rank: measured mean time per action (p2p waits excluded) against the cost the
    prediction uses, the waits, and the step time outside the actions."""
    c = pred["costs"]
    names = {"F": "F", "BW": "B", "R": "R"}
    for rank, d in enumerate(diag):
        n = d["steps"]
        rows = []
        for k in sorted(k for k in d if k.startswith(":")):
            name, st = k[1:].split("@")
            mean = d[k] / d["n_" + k]
            want = c[names[name]][int(st)] if name in names else (
                c["send"] if name.startswith("SEND") else None)
            rows.append(f"{name[:8]}{st}={mean * 1e3:.2f}" + (
                f"/{want * 1e3:.2f}" if want is not None else "") + (
                f" w{d['wait:' + k[1:]] / n * 1e3:.1f}" if d["wait:" + k[1:]] > 1e-5 else ""))
        instr = sum(v for k, v in d.items() if k.startswith(":"))
        print(f"  r{rank} step {d['step'] / n * 1e3:.2f} = instr {instr / n * 1e3:.2f} + wait "
              f"{d['wait'] / n * 1e3:.2f} + outside {(d['step'] - instr - d['wait']) / n * 1e3:.2f}"
              f" | pred busy {c['busy'][rank] * 1e3:.2f} makespan {c['makespan'] * 1e3:.2f} "
              f"| once per step {d['once'] / n * 1e3:.2f}/{c['step'] * 1e3:.2f}\n    "
              + "  ".join(rows))


class _Null(torch.nn.Module):
    """A layer with (almost) no compute but the same parameter tensors as a gpt-tiny layer;
    the first one embeds the ids.  Only its first tensor is used (a gradient costs as little
    as possible); the others get zero gradients before each step (``NullEngine.step``), so
    the per-tensor work of a step (gradient reductions and norm, optimizer) is the real one."""

    def __init__(self, layer: torch.nn.Module, embed: bool = False):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(p))
                                          for p in layer.parameters()])
        self.embed = embed

    def forward(self, x):
        w = self.ps[0]
        return torch.nn.functional.embedding(x, w) if self.embed else x + w.view(-1)[:1] * 0


# once per step: the engine's methods after the action list
_ONCE = {"CommitP2P": "_exec_commit_p2p", "ReduceTiedGrads": "_exec_reduce_tied_grads",
         "ReduceGrads": "_exec_reduce_grads", "OptimizerStep": "_exec_optimizer_step"}


def _start(acc) -> float:
    if acc is not None:
        acc["_first"] = None
    return time.perf_counter()


def _once(acc, t0: float) -> float:
    """A step's time outside the simulated actions: before the first action, and from the
    last action's end on any rank to the step's end on every rank (one host: perf_counter
    is the same monotonic clock on every rank)."""
    t = torch.tensor([acc["_first"] - t0, acc["_last"], time.perf_counter()], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t[0] + t[2] - t[1])


def _timed(engine) -> dict:
    """Wrap the engine's action handlers (its dispatch table), its once-per-step work and its
    p2p waits: per-action time without the time spent waiting for the other rank (also per
    ``kind@stage``), and the waits per action (``wait:kind@stage``)."""
    acc = {"wait": 0.0}
    wait = engine._wait

    def add(k, v):
        acc[k] = acc.get(k, 0.0) + v
        acc["n_" + k] = acc.get("n_" + k, 0) + 1

    def timed_wait(*a, **kw):
        t0 = time.perf_counter()
        try:
            return wait(*a, **kw)
        finally:
            acc["wait"] += time.perf_counter() - t0
            acc["_in_wait"] = acc.get("_in_wait", 0.0) + time.perf_counter() - t0

    def wrap(fn, name):
        def w(*a, **kw):
            acc["_in_wait"] = 0.0
            t0 = time.perf_counter()
            r = fn(*a, **kw)
            t1 = time.perf_counter()
            dt, key = t1 - t0, f"{name}@{a[0].stage if a else ''}"
            if acc.get("_first") is None:
                acc["_first"] = t0
            if name not in _ONCE:
                acc["_last"] = t1
            add(name, dt - acc["_in_wait"])
            add(":" + key, dt - acc["_in_wait"])
            add("wait:" + key, acc["_in_wait"])
            return r
        return w
    engine._wait = timed_wait
    engine.ap_table = {k: wrap(f, k.value) for k, f in engine.ap_table.items()}
    for name, method in _ONCE.items():
        setattr(engine, method, wrap(getattr(engine, method), name))
    return acc


class NullEngine:
    """Runtime micro-benchmark on a model with no compute (the boundary tensors and the
    parameter tensors of gpt-tiny): the DeepSpeed engine's own time per action (p2p waits
    excluded) and per step (before the first action, and from the last action's end on any
    rank to the step's end: gradient reductions, gradient norm, optimizer, loss
    aggregation).  Independent of the measured cases; part of the cost model's input, like
    the p2p latency."""

    def __init__(self, api, n: int, mbs: int):
        from ds_autoplan.models import gpt_tiny
        real = gpt_tiny().layers()
        self.c, self.n, self.mbs = gpt_tiny().cfg, n, mbs
        layers = [_Null(layer, embed=i == 0) for i, layer in enumerate(real)]
        plan = {"pp": WORLD, "dp": 1, "zero_stage": 0, "micro_batch_size": mbs,
                "num_microbatches": n, "global_batch_size": mbs * n, "precision": "fp32",
                "schedule": "1f1b", "schedule_options": {}, "layers_per_stage": [5, 5],
                "recompute_per_stage": [0.0, 0.0]}
        self.engine, *_ = api.initialize(layers, plan, loss_fn=lambda out, y: out.mean(),
                                         config=_ds_config(n, mbs),
                                         optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
        self.params = list(self.engine.module.parameters())
        self.acc, self.once = None, []

    def step(self, timed: bool) -> None:
        ids = torch.randint(0, self.c.vocab_size, (self.n, self.mbs, self.c.seq_len))
        for p in self.params:       # as a real backward leaves them (the engine zeroes them)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.distributed.barrier()
        if timed and self.acc is None:
            self.acc = _timed(self.engine)
        t0 = _start(self.acc)
        self.engine.train_batch(iter([(x, x) for x in ids]))
        if timed:
            self.once.append(_once(self.acc, t0))

    def overheads(self) -> dict:
        acc = self.acc
        per = lambda k: acc.get(k, 0.0) / max(1, acc.get("n_" + k, 0))   # noqa: E731
        comm = [k for k in ("SEND_F", "SEND_B", "RECV_F", "RECV_B") if acc.get(k)]
        return {"F": per("F"), "B": per("BW"),
                "comm": sum(acc[k] for k in comm) / max(1, sum(acc["n_" + k] for k in comm)),
                # once per step: optimizer, gradient reductions and norm, loss aggregation
                "step": statistics.median(self.once)}


class Profiler:
    """The profile of gpt-tiny at one micro-batch size, with its unit timings sampled a few
    at a time (``sample``) so they can be interleaved with the measured steps."""

    def __init__(self, mbs: int, timing: str, inflight: int = 1):
        from ds_autoplan.models import resolve_model
        from ds_autoplan.profile import auto_leaf_classes, build_chain, profile_model, trace
        self.timing, self.inflight = timing, inflight
        self.prof = profile_model(resolve_model(MODEL), batch_size=mbs, repeats=3, warmup=1, timing=timing)
        e = resolve_model(MODEL)
        leaves = auto_leaf_classes(e.model)
        self.inputs = e.make_inputs(mbs)
        self.chain = build_chain(trace(e.model, leaves), self.inputs, leaves)
        self.loss = lambda out: e.loss(out, mbs)
        self.samples: list[list] = [[] for _ in range(self.prof.num_units + 1)]
        if timing == "isolated":
            from ds_autoplan.profile.measure import capture_unit_inputs
            self.unit_inputs = capture_unit_inputs(self.chain, self.inputs)
            with torch.no_grad():
                self.logits = self.chain.split(*self.inputs)

    def sample(self, k: int = 3) -> None:
        from ds_autoplan.profile.measure import time_in_chain, time_units
        cpu = torch.device("cpu")
        for _ in range(k):
            if self.timing == "chain":
                ts = time_in_chain(self.chain, self.inputs, cpu, self.inflight, 0, self.loss,
                                   self.inflight)
            else:
                units = list(self.chain.units)
                ts = time_units(units + [self.loss], list(self.unit_inputs) + [(self.logits,)],
                                cpu, 1, 0, [list(u.parameters()) for u in units] + [[]])
            for i, t in enumerate(ts):
                self.samples[i].append((t["fwd_s"], t["bwd_s"]))

    def result(self):
        med = [(statistics.median(f for f, _ in xs), statistics.median(b for _, b in xs))
               for xs in self.samples]
        for u, (f, b) in zip(self.prof.units, med):
            u.fwd_s, u.bwd_s = f, b
        self.prof.loss["fwd_s"], self.prof.loss["bwd_s"] = med[-1]
        self.prof.repeats = len(self.samples[0])
        return self.prof


def _ds_config(n: int, mbs: int) -> dict:
    return {"steps_per_print": 10 ** 9, "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": n, "train_batch_size": mbs * n}


def worker(path: str, steps: int, timing: str = "chain", diagnose: bool = False) -> None:
    """One rank: build the profilers, the no-compute engines and one real DeepSpeed engine
    (our adapter) per case, then run rounds of [profile samples, overhead steps, one step of
    every case], so a burst of load on the shared machine hits the cost model's inputs and
    the measured steps alike; medians over the rounds."""
    import copy

    from ds_autoplan.models import TinyGPT, gpt_loss, gpt_tiny
    from ds_autoplan.runtime.deepspeed import api
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    torch.set_num_threads(1)
    init_distributed()          # no JIT build of DeepSpeed's CPU comm op inside a rank
    rank = torch.distributed.get_rank()
    with open(path) as f:
        cases = json.load(f)
    sizes = sorted({c["mbs"] for c in cases})
    base: TinyGPT = gpt_tiny()
    cfg0 = base.cfg
    profilers = {mbs: Profiler(mbs, timing) for mbs in sizes}
    nulls = {mbs: NullEngine(api, max(c["n"] for c in cases), mbs) for mbs in sizes}
    p2p: dict = {mbs: [] for mbs in sizes}

    def ping(mbs: int, k: int = 5) -> None:
        """One-way time of a boundary tensor [mbs, seq, hidden] between the two ranks."""
        x = torch.zeros(mbs, cfg0.seq_len, cfg0.hidden)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            if rank == 0:
                torch.distributed.send(x, 1)
                torch.distributed.recv(x, 1)
            else:
                torch.distributed.recv(x, 0)
                torch.distributed.send(x, 0)
        p2p[mbs].append((time.perf_counter() - t0) / (2 * k))
    engines, trackers = [], []
    for case in cases:
        n, mbs = case["n"], case["mbs"]
        plan = {"pp": WORLD, "dp": 1, "zero_stage": 0, "micro_batch_size": mbs,
                "num_microbatches": n, "global_batch_size": mbs * n, "precision": "fp32",
                "schedule": case["schedule"], "schedule_options": case["options"],
                "layers_per_stage": case["layers_per_stage"],
                "recompute_per_stage": case["recompute"]}
        engine, *_ = api.initialize(copy.deepcopy(base).layers(), plan, loss_fn=gpt_loss,
                                    config=_ds_config(n, mbs),
                                    optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                                    track_memory=True)
        trackers.append(engine.memtracker)
        engine.memtracker = None                # timed steps run without the hooks
        engines.append(engine)
    g = torch.Generator().manual_seed(1)

    def step(i):
        n, mbs = cases[i]["n"], cases[i]["mbs"]
        ids = torch.randint(0, cfg0.vocab_size, (n, mbs, cfg0.seq_len + 1), generator=g)
        batch = [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in ids]
        torch.distributed.barrier()
        t0 = _start(diag[i] if diag else None)
        engines[i].train_batch(iter(batch))
        own[i].append(time.perf_counter() - t0)
        if diag:
            diag[i]["once"] = diag[i].get("once", 0.0) + _once(diag[i], t0)
        t = torch.tensor([own[i][-1]])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    times: list[list[float]] = [[] for _ in cases]
    own: list[list[float]] = [[] for _ in cases]
    diag = []
    for r in range(steps + 1):                  # round 0: warm-up
        if r == 1 and diagnose:
            diag = [_timed(e) for e in engines]
            own = [[] for _ in cases]
        for mbs in sizes:
            if r:
                profilers[mbs].sample()
            nulls[mbs].step(timed=r > 0)
            ping(mbs)
        for i in range(len(cases)):
            t = step(i)
            if r:
                times[i].append(t)
    for mbs in sizes:
        print("ACC_PROFILE " + json.dumps({"rank": rank, "mbs": mbs,
                                           "profile": profilers[mbs].result().to_dict(),
                                           "overhead": {**nulls[mbs].overheads(),
                                                        "p2p": statistics.median(p2p[mbs])},
                                           "null": {**nulls[mbs].acc, "steps": len(nulls[mbs].once)}
                                           if diagnose else None}),
              flush=True)
    for i, case in enumerate(cases):            # one more step with the saved-bytes tracker
        d = {**diag[i], "step": sum(own[i]), "steps": len(own[i])} if diag else None
        engines[i].memtracker = trackers[i]
        step(i)
        print("ACC_RESULT " + json.dumps({"case": case, "rank": rank,
                                          "time": statistics.median(times[i]),
                                          "diag": d,
                                          "peak": trackers[i].peak}), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(cases: list[dict], steps: int, timeout: float, timing: str = "chain",
            diagnose: bool = False):
    """Run the ranks; return the per-case measurements and the ranks' profiles per mbs."""
    from ds_autoplan.profile import Profile
    from ds_autoplan.runtime.launch import spawn
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cases, f)
    try:
        outs = spawn([os.path.abspath(__file__), "--worker", f.name, "--steps", str(steps),
                      "--timing", timing] + ["--diagnose"] * diagnose,
                     WORLD, timeout=timeout, grace=20)
    finally:
        os.unlink(f.name)
    res: dict = {}
    profs: dict = {}
    for rc, text in outs:
        for line in text.splitlines():
            if line.startswith("ACC_PROFILE "):
                r = json.loads(line[len("ACC_PROFILE "):])
                prof = Profile.from_dict(r["profile"])
                prof.overhead, prof.null = r["overhead"], r.get("null")
                profs.setdefault(r["mbs"], [None] * WORLD)[r["rank"]] = prof
            if line.startswith("ACC_RESULT "):
                r = json.loads(line[len("ACC_RESULT "):])
                key = json.dumps(r["case"], sort_keys=True)
                res.setdefault(key, {"time": 0.0, "peak": [0] * WORLD, "diag": [None] * WORLD})
                res[key]["diag"][r["rank"]] = r["diag"]
                res[key]["time"] = max(res[key]["time"], r["time"])
                res[key]["peak"][r["rank"]] = r["peak"]
        if rc != 0:
            tail = "\n".join(text.splitlines()[-15:])
            raise RuntimeError(f"a rank failed (exit {rc}):\n{tail}")
    return [res[json.dumps(c, sort_keys=True)] for c in cases], profs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 cases (n = 4), < 60 s")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case")
    ap.add_argument("--json", help="also write the per-case results here")
    ap.add_argument("--timing", choices=("chain", "isolated"), default="chain",
                    help="how the profile times units (ds_autoplan.profile.profile_model)")
    ap.add_argument("--verbose", action="store_true", help="print the profiles and overheads")
    ap.add_argument("--diagnose", action="store_true",
                    help="per case and rank: measured time per action vs the cost model's")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    steps = args.steps or (20 if args.quick else 16)
    if args.worker:
        worker(args.worker, steps, args.timing, args.diagnose)
        return 0
    M.prebuild_ops()            # before the clock and outside any kill timeout
    t_start = time.time()
    cases = configs(args.quick)
    try:
        meas, profs = measure(cases, steps, timeout=55 if args.quick else 600, timing=args.timing,
                              diagnose=args.diagnose)
    except (RuntimeError, KeyError) as e:   # a failed or killed rank: still one JSON line
        print(e, file=sys.stderr)
        print(json.dumps({"median_time_error": None, "median_memory_error": None,
                          "error": str(e).splitlines()[0]}))
        return 1
    preds = [predict(c, profs[c["mbs"]]) for c in cases]
    if args.verbose:
        for mbs, ps in profs.items():
            for r, p in enumerate(ps):
                print(mbs, r, [f"{u.fwd_s * 1e3:.2f}/{u.bwd_s * 1e3:.2f}"
                               for u in (*p.units, SimpleNamespace(**p.loss))],
                      {k: round(v * 1e3, 3) for k, v in p.overhead.items()})
                if p.null:
                    print("   null engine per action:", {k[1:]: round(v / p.null["n_" + k] * 1e3, 2)
                                                         for k, v in p.null.items()
                                                         if k.startswith(":")})
    rows, terr, merr = [], [], []
    print(f"{'schedule':<12} {'part':<5} {'rec':>3} {'mbs':>3} {'n':>2} {'pred ms':>8} "
          f"{'meas ms':>8} {'t err':>6} {'pred peak KiB':>16} {'meas peak KiB':>16} {'m err':>6}")
    for c, p, m in zip(cases, preds, meas):
        te = abs(p["time"] - m["time"]) / m["time"]
        me = max(abs(a - b) / b for a, b in zip(p["peak"], m["peak"]))
        terr.append(te)
        merr.append(me)
        rows.append({**c, "pred_time": p["time"], "meas_time": m["time"], "time_error": te,
                     "pred_peak": p["peak"], "meas_peak": m["peak"], "memory_error": me})
        pk = lambda xs: "/".join(f"{x / 1024:.0f}" for x in xs)  # noqa: E731
        print(f"{c['schedule']:<12} {c['partition']:<5} {max(c['recompute']):>3.1f} "
              f"{c['mbs']:>3} {c['n']:>2} "
              f"{p['time'] * 1e3:>8.2f} {m['time'] * 1e3:>8.2f} {te:>6.1%} "
              f"{pk(p['peak']):>16} {pk(m['peak']):>16} {me:>6.1%}")
        if args.diagnose:
            diagnose(c, p, m["diag"])
    out = {"median_time_error": statistics.median(terr),
           "median_memory_error": statistics.median(merr), "cases": len(cases), "iters": steps,
           "spread": {"median_time_error": [round(min(terr), 4), round(max(terr), 4)],
                      "median_memory_error": [round(min(merr), 4), round(max(merr), 4)]},
           "runtime": "deepspeed PipelineEngine (ds_autoplan adapter), 2 gloo CPU ranks",
           "device": profs[cases[0]["mbs"]][0].device.get("name"),
           "seconds": round(time.time() - t_start, 1)}
    return M.publish(out, rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
