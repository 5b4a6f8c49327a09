"""Worker of tests/test_resume.py (every rank): train a tiny GPT under plan A, save a
checkpoint after 3 steps, train 3 more (the uninterrupted run); then build plan B's engine
from *other* initial weights, load the checkpoint and train the same 3 steps (the resumed
run).  Cases run one after another in one process group; each prints one result line.

    python tests/resume_deepspeed.py CASES.json

A case: ``{"name", "dir", "a": spec or absent, "b": spec or absent}``; a spec is
``{"schedule", "pp", "dp", "zero"}``.  Without "a" the checkpoint in "dir" comes from an
earlier process group (another world size).
"""
from __future__ import annotations

import functools
import json
import sys

import torch

MBS, N, SEQ, STEPS, BLOCKS = 2, 4, 8, 3, 6      # N micro-batches per step over all replicas


def make_plan(spec):
    from ds_autoplan.plan import Plan
    from ds_autoplan.schedule import build
    n = N // spec["dp"]
    S = build(spec["schedule"], spec["pp"], n).num_stages
    base, extra = divmod(BLOCKS, S)
    return Plan(pp=spec["pp"], dp=spec["dp"], zero_stage=spec["zero"], micro_batch_size=MBS,
                num_microbatches=n, global_batch_size=MBS * N, precision="fp32",
                schedule=spec["schedule"], layers_per_stage=[base + (s < extra) for s in range(S)],
                recompute_per_stage=[0.0] * S)


def make_engine(spec, seed):
    import ds_autoplan
    from ds_autoplan.models.tiny_gpt import gpt_loss, gpt_tiny
    model = gpt_tiny(vocab_size=32, hidden=16, num_layers=BLOCKS, num_heads=2, seq_len=SEQ, seed=seed)
    cfg = {"steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    engine, *_ = ds_autoplan.initialize(model.layers(), make_plan(spec), loss_fn=gpt_loss, config=cfg,
                                        optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    return engine


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2 * STEPS):
        t = torch.randint(0, 32, (N, MBS, SEQ + 1), generator=g)
        out.append([(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in t])
    return out


def train(engine, data, steps):
    """One optimizer step per entry of ``steps``; replica r takes its share of the step's
    micro-batches, so every plan sees the same global batch."""
    n = engine.micro_batches
    r = engine.grid.data_parallel_id
    return [float(engine.train_batch(iter(data[s][r * n:(r + 1) * n]))) for s in steps]


def run_case(case, data):
    from ds_autoplan.runtime.deepspeed.checkpoint import load_checkpoint, save_checkpoint
    res = {"name": case["name"], "rank": torch.distributed.get_rank()}
    if "a" in case:
        eng = make_engine(case["a"], seed=0)
        first = train(eng, data, range(STEPS))
        save_checkpoint(eng, case["dir"])
        res["uninterrupted"] = first + train(eng, data, range(STEPS, 2 * STEPS))
    if "b" in case:
        eng = make_engine(case["b"], seed=1)
        meta = load_checkpoint(eng, case["dir"])
        res["resumed"] = train(eng, data, range(STEPS, 2 * STEPS))
        res["saved_under"] = meta["plan"]["schedule"]
        res["layers"] = [i for i, _ in eng.module.local_layers()]
    return res


def main(path):
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from ds_autoplan.runtime.launch import report_runs
    torch.set_num_threads(1)
    init_distributed()
    with open(path) as f:
        cases = json.load(f)
    data = batches()
    report_runs(functools.partial(run_case, c, data) for c in cases)


if __name__ == "__main__":
    main(sys.argv[1])
