"""The per-step planner's output is fixed: for a fixed sequence of global batches, every
planner setting gives the plans recorded in tests/data/dynamic_plans.json (recorded from the
planner before its fast path; a change of any micro-batch, shape, order, schedule or lowered
list fails here).  Regenerate only for an intended change of the plans:

    python tests/test_dynamic_plans.py --record
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import numpy as np
import pytest

from ds_autoplan.dynamic import CostModel, IterationPlanner, LengthSampler, stage_costs
from ds_autoplan.schedule import Costs, build, fastsim, simulate

DATA = pathlib.Path(__file__).with_name("data") / "dynamic_plans.json"
GB = 2 ** 30
BENCH = CostModel.gpt(2048, 16, 24, 4)                 # bench/dynamic_microbatch.py's model
T5 = CostModel.gpt(2048, 16, 24, 4, encdec=True)
SMALL = CostModel.gpt(hidden=512, heads=8, layers=8, stages=2)
DP = {"mem_cap": 10 * GB}


def cases() -> dict[str, tuple[IterationPlanner, str, int]]:
    """name -> (planner, length kind, global batch).  The first five are the benchmark's
    methods (its fixed and token settings); the others cover the encoder-decoder cost, the
    memory-capped rerun of the adaptive schedule, the DP's search over many t_max caps, one
    order only, p2p latency, a fixed micro-batch count and other builders."""
    one = dict(schedule="1f1b", device_mem=40 * GB)
    return {
        "packing": (IterationPlanner(BENCH, 4, "packing", split_opts={"max_len": 4096}, **one), "decoder", 256),
        "fixed": (IterationPlanner(BENCH, 4, "fixed", split_opts={"mbs": 4}, **one), "decoder", 256),
        "token": (IterationPlanner(BENCH, 4, "token", split_opts={"max_tokens": 2048}, **one), "decoder", 256),
        "dynapipe-1f1b": (IterationPlanner(BENCH, 4, "dynapipe", split_opts=DP, **one), "decoder", 256),
        "dynapipe-adaptive": (IterationPlanner(BENCH, 4, split_opts=DP, device_mem=40 * GB), "decoder", 256),
        "adaptive-mem-limited": (IterationPlanner(BENCH, 4, split_opts=DP, device_mem=12 * GB),
                                 "decoder", 256),
        "adaptive-gbs64": (IterationPlanner(BENCH, 4, split_opts=DP), "decoder", 64),  # many caps
        "adaptive-one-order": (IterationPlanner(BENCH, 4, split_opts=DP, try_orders=False), "decoder", 128),
        "adaptive-p2p": (IterationPlanner(BENCH, 4, split_opts=DP, p2p=3.0), "decoder", 128),
        "t5-adaptive": (IterationPlanner(T5, 4, split_opts=DP, device_mem=40 * GB), "encdec", 128),
        "t5-1f1b": (IterationPlanner(T5, 4, schedule="1f1b", split_opts=DP), "encdec", 128),
        "small-count": (IterationPlanner(SMALL, 2, split_opts={"num_microbatches": 5}), "small", 24),
        "small-zb-h1": (IterationPlanner(SMALL, 2, schedule="zb-h1", p2p=0.5), "small", 24),
        "small-gpipe": (IterationPlanner(SMALL, 2, schedule="gpipe"), "small", 24),
    }


def batches(kind: str, gbs: int, steps: int = 3) -> list[np.ndarray]:
    if kind == "small":
        sampler = LengthSampler(max_len=256, seed=1)
    else:
        sampler = LengthSampler(kind, 4096, seed=0)
    return [sampler(gbs) for _ in range(steps)]


def record(plan) -> dict:
    """What a plan is: structure by digest (micro-batches, shapes, both schedules), the rest
    as numbers."""
    text = json.dumps([plan.microbatches, plan.shapes, plan.info["order"]]) \
        + plan.schedule.to_text() + plan.lowered.to_text()
    return {"digest": hashlib.sha256(text.encode()).hexdigest()[:32],
            "order": plan.info["order"], "num_microbatches": plan.num_microbatches,
            "mem_limit": plan.schedule.meta.get("mem_limit"),
            "predicted_ms": plan.predicted_ms, "peak_memory": plan.info["peak_memory"],
            "safety_stock": plan.info["safety_stock"], "bubble": plan.info["bubble"]}


def plans(name: str) -> list[dict]:
    planner, kind, gbs = cases()[name]
    out = []
    for step, lengths in enumerate(batches(kind, gbs)):
        plan = planner(lengths, ids=range(100 * step, 100 * step + len(lengths)), step=step)
        c = stage_costs(plan.split, planner.cost, planner.stages, planner.p2p)
        for k in ("f", "b", "w", "mem_f", "mem_b", "mem_w"):   # the costs of the chosen order
            assert np.array_equal(getattr(plan.costs, k), getattr(c, k)), k
        assert plan.costs.p2p == c.p2p
        out.append(record(plan))
    return out


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(DATA.read_text())


@pytest.mark.parametrize("name", list(cases()))
def test_plans_are_the_recorded_ones(name, recorded):
    want, got = recorded[name], plans(name)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for k in ("order", "num_microbatches", "mem_limit", "digest"):
            assert g[k] == w[k], f"{name} step {step}: {k} {g[k]} != recorded {w[k]}"
        for k in ("predicted_ms", "peak_memory", "safety_stock", "bubble"):
            assert g[k] == pytest.approx(w[k], rel=1e-9, abs=1e-12), f"{name} step {step}: {k}"


def test_the_cases_cover_the_memory_capped_rerun(recorded):
    assert recorded["adaptive-mem-limited"][0]["mem_limit"] == 12 * GB
    assert all(r["mem_limit"] is None for r in recorded["dynapipe-adaptive"])


@pytest.mark.parametrize("name", ["dynapipe", "1f1b", "zb-h1", "v-zb"])
@pytest.mark.parametrize("seed", range(3))
def test_fast_timing_is_the_simulators_to_the_bit(name, seed):
    """What the planner compares its micro-batch orders by: the compiled longest path's
    makespan and per-rank peaks equal the simulator's exactly on costs per (stage,
    micro-batch) (the planner's choice between orders and its memory-capped rerun compare
    them), with unequal costs, a B/W split and p2p latency."""
    d, n = 4, 7 + seed
    S = 2 * d if name == "v-zb" else d
    rng = np.random.default_rng(seed)
    f, b, w, act = (rng.uniform(lo, hi, (S, n)) for lo, hi in ((0.5, 3), (1, 6), (0.1, 1), (1, 9)))
    costs = Costs.per_stage(S, n, f=f, b=b, w=w, mem_f=act, mem_b=-0.3 * act, p2p=0.37, num_ranks=d)
    sched = build(name, d, n, **({"costs": costs} if name == "dynapipe" else {}))
    got, ref = fastsim.run_costs(fastsim.compile_schedule(sched), costs), simulate(sched, costs)
    assert got.makespan == ref.makespan
    assert got.peak_memory.tolist() == ref.peak_memory
    assert got.busy.tolist() == pytest.approx(ref.busy, rel=1e-12)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps({name: plans(name) for name in cases()}, indent=1) + "\n")
    print(f"wrote {DATA}")
