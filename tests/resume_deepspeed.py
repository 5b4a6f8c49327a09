"""DeepSpeed cases of tests/test_resume.py (every rank; a launcher case, :func:`cases_case`):
train a tiny GPT under plan A, save a checkpoint after 3 steps, train 3 more (the
uninterrupted run); then build plan B's engine from *other* initial weights, load the
checkpoint and train the same 3 steps (the resumed run).  Cases run one after another in one
process group; each gives one result row.

A case: ``{"name", "dir", "a": spec or absent, "b": spec or absent, "api": "engine"}``; a
spec is ``{"schedule", "pp", "dp", "zero", "sched", "dropout"}`` (``sched``: DeepSpeed's
WarmupDecayLR from the config; ``dropout``: p after every block).  Without "a" the checkpoint
in "dir" comes from an earlier process group (another world size).  ``api: "engine"`` saves and
loads with ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (tag folder, ``latest``,
client_state) instead of the module functions.
"""
from __future__ import annotations

import random

import numpy as np
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


# linear warm-up over 3 steps, then linear decay: each of the 6 steps has another learning rate
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                 "warmup_num_steps": 3, "warmup_type": "linear",
                                                 "total_num_steps": 8}}


def layers(model, dropout):
    """The pipeline layers; with ``dropout`` > 0 every block is followed by dropout."""
    if not dropout:
        return model.layers()
    return [model.embed, *[torch.nn.Sequential(b, torch.nn.Dropout(dropout)) for b in model.blocks],
            model.head]


def make_engine(spec, seed):
    import ds_autoplan
    from ds_autoplan.models.tiny_gpt import gpt_loss, gpt_tiny
    model = gpt_tiny(vocab_size=32, hidden=16, num_layers=BLOCKS, num_heads=2, seq_len=SEQ, seed=seed)
    cfg = {"steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    if spec.get("sched"):
        cfg["scheduler"] = SCHEDULER
    engine, *_ = ds_autoplan.initialize(layers(model, spec.get("dropout")), make_plan(spec),
                                        loss_fn=gpt_loss, config=cfg,
                                        optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    return engine


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2 * STEPS):
        t = torch.randint(0, 32, (N, MBS, SEQ + 1), generator=g)
        out.append([(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in t])
    return out


def train(engine, data, steps, lrs):
    """One optimizer step per entry of ``steps`` (the learning rate each one runs at goes to
    ``lrs``); replica r takes its share of the step's micro-batches, so every plan sees the
    same global batch."""
    n = engine.micro_batches
    r = engine.grid.data_parallel_id
    out = []
    for s in steps:
        lrs.append(engine.get_lr()[0])
        out.append(float(engine.train_batch(iter(data[s][r * n:(r + 1) * n]))))
    return out


def save(eng, case):
    from ds_autoplan.runtime.checkpoint import CheckpointError
    from ds_autoplan.runtime.deepspeed.checkpoint import save_checkpoint
    if case.get("api") != "engine":
        return save_checkpoint(eng, case["dir"]), None
    try:
        eng.save_checkpoint(case["dir"], exclude_frozen_parameters=True)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    eng.save_checkpoint(case["dir"], client_state={"epoch": 7, "rank": torch.distributed.get_rank()})
    return None, refused


def load(eng, case, res):
    """The checkpoint's metadata; for the engine API also what it returned."""
    from ds_autoplan.runtime.checkpoint import read_meta
    from ds_autoplan.runtime.deepspeed.checkpoint import load_checkpoint
    if case.get("api") != "engine":
        return load_checkpoint(eng, case["dir"])
    res["no_checkpoint"] = list(eng.load_checkpoint(case["dir"] + "-absent"))
    _, res["module_only"] = eng.load_checkpoint(case["dir"], load_module_only=True)   # warm start
    res["module_only_steps"] = eng.global_steps
    path, client_state = eng.load_checkpoint(case["dir"])
    res.update(load_path=path, client_state=client_state, counters=[
        eng.global_steps, eng.global_samples, eng.skipped_steps])
    return read_meta(path)


def host_draws() -> list:
    """The next draws of Python's and NumPy's global generators (what a data pipeline uses)."""
    return [random.random(), float(np.random.rand())]


def run_case(case, data):
    res = {"name": case["name"], "rank": torch.distributed.get_rank(), "lr_a": [], "lr_b": []}
    if "a" in case:
        eng = make_engine(case["a"], seed=0)
        first = train(eng, data, range(STEPS), res["lr_a"])
        _, res["refused"] = save(eng, case)
        res["host_draws_a"] = host_draws()
        res["uninterrupted"] = first + train(eng, data, range(STEPS, 2 * STEPS), res["lr_a"])
    if "b" in case:
        eng = make_engine(case["b"], seed=1)
        random.seed(99)
        np.random.seed(99)             # plan B's own host generators, replaced by the load
        meta = load(eng, case, res)
        res["host_draws_b"] = host_draws()
        res["resumed"] = train(eng, data, range(STEPS, 2 * STEPS), res["lr_b"])
        res["saved_under"] = meta["plan"]["schedule"]
        res["rng_from"] = meta.get("rng_from_rank")
        res["layers"] = [i for i, _ in eng.module.local_layers()]
    return res


def cases_case(case) -> dict:
    """A launcher case (``harness.forked``): every case of ``case["cases"]`` on the launcher's
    process group; this rank's results under ``"rows"``."""
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    init_distributed()            # DeepSpeed's comm on the launcher's group
    data = batches()
    return {"rows": [run_case(c, data) for c in case["cases"]]}
