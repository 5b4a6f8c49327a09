"""DeepSpeed cases of tests/test_checkpoint_faults.py (every rank, 2 ranks; launcher cases,
run by ``python -m harness.forked``).

``save``: train one step, ``engine.save_checkpoint(dir, tag="t1")``, print the weights'
digest; train one more step, then save again (to tag ``tag2``: ``t1`` re-saves the same tag)
with ``DS_AUTOPLAN_CHECKPOINT_FAULT=fault`` (a SIGKILL of one rank inside the save) and return
the new digest if the save returns.  ``load``: one fresh engine (other initial weights) loads
each of ``cases`` (``{"name", "dir", "tag"}``) and prints the loaded path, the weights' digest
and the step -- or the error's one line.
"""
from __future__ import annotations

import json
import os

import torch

RESULT = "AUTOPLAN_RESULT "


def make_engine(seed):
    import ds_autoplan
    from ds_autoplan.models.tiny_gpt import gpt_loss, gpt_tiny
    from ds_autoplan.plan import Plan
    model = gpt_tiny(vocab_size=32, hidden=16, num_layers=2, num_heads=2, seq_len=8, seed=seed)
    plan = Plan(pp=2, dp=1, zero_stage=0, micro_batch_size=2, num_microbatches=2, global_batch_size=4,
                precision="fp32", schedule="1f1b", layers_per_stage=[2, 2], recompute_per_stage=[0.0, 0.0])
    cfg = {"steps_per_print": 10 ** 9, "gradient_clipping": 0.0}
    engine, *_ = ds_autoplan.initialize(model.layers(), plan, loss_fn=gpt_loss, config=cfg,
                                        optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))
    return engine


def step(engine):
    g = torch.Generator().manual_seed(engine.global_steps)
    t = torch.randint(0, 32, (2, 2, 9), generator=g)
    engine.train_batch(iter([(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in t]))


def digest(engine) -> float:
    return float(sum(p.double().sum() for _, layer in engine.module.local_layers()
                     if isinstance(layer, torch.nn.Module) for p in layer.parameters()))


def say(**row):
    print(RESULT + json.dumps({"rank": torch.distributed.get_rank(), **row}), flush=True)


def save(case) -> dict:
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    init_distributed()           # DeepSpeed's comm on the case's process group
    engine = make_engine(0)
    step(engine)
    engine.save_checkpoint(case["dir"], tag="t1", client_state={"epoch": 1})
    say(forked=case["name"], saved="t1", digest=digest(engine), step=engine.global_steps)
    step(engine)
    os.environ["DS_AUTOPLAN_CHECKPOINT_FAULT"] = case["fault"]
    engine.save_checkpoint(case["dir"], tag=case["tag2"], client_state={"epoch": 2})
    return {"rank": torch.distributed.get_rank(), "saved": case["tag2"], "digest": digest(engine),
            "step": engine.global_steps}


def load(job) -> dict:
    from ds_autoplan.runtime.checkpoint import CheckpointError
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    init_distributed()
    engine = make_engine(1)
    for case in job["cases"]:
        try:
            path, client_state = engine.load_checkpoint(case["dir"], tag=case.get("tag"))
            say(name=case["name"], path=path, digest=digest(engine), step=engine.global_steps,
                client_state=client_state)
        except CheckpointError as e:
            say(name=case["name"], error=str(e))
    return {"rank": torch.distributed.get_rank(), "loaded": len(job["cases"])}
