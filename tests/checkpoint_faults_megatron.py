"""Megatron-core cases of tests/test_checkpoint_faults.py (every rank; launcher cases, run by
``python -m harness.forked``; Megatron's DDP, optimizer and dist_checkpointing as in
tests/resume_megatron.py).

``killed_resave``: train one step, save to ``dir`` (prints the weights' digest), train one more
and save to ``dir`` again with ``DS_AUTOPLAN_CHECKPOINT_FAULT=fault``: the save is SIGKILLed.
``load``: a fresh model loads ``dir``; the step, ``client_state`` and digest, or the error's line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib

RESULT = "AUTOPLAN_RESULT "
SPEC = {"schedule": "1f1b", "pp": 2, "dp": 1, "zero": 0, "sched": True}


def _resume():
    path = pathlib.Path(__file__).with_name("resume_megatron.py")
    spec = importlib.util.spec_from_file_location("_ckpt_faults_resume_megatron", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _resume()


def _digest(run) -> float:
    return float(sum(p.double().sum() for c in run.chunks for p in c.parameters()))


def killed_resave(case) -> dict:
    import torch.distributed as dist

    from ds_autoplan.runtime.megatron.checkpoint import save_checkpoint
    data = R._data()
    run = R.Run(SPEC, reference_weights=True)
    run.train(data, range(1))
    save_checkpoint(run.chunks, run.opt, case["dir"], plan=run.plan, step=1, scheduler=run.sched,
                    client_state={"epoch": 1})
    print(RESULT + json.dumps({"forked": case["name"], "rank": dist.get_rank(), "saved": 1,
                               "digest": _digest(run)}), flush=True)
    run.train(data, range(1, 2))
    os.environ["DS_AUTOPLAN_CHECKPOINT_FAULT"] = case["fault"]
    save_checkpoint(run.chunks, run.opt, case["dir"], plan=run.plan, step=2, scheduler=run.sched,
                    client_state={"epoch": 2})
    return {"rank": dist.get_rank(), "saved": 2, "digest": _digest(run)}


def load(case) -> dict:
    import torch.distributed as dist

    from ds_autoplan.runtime.checkpoint import CheckpointError
    from ds_autoplan.runtime.megatron.checkpoint import load_checkpoint
    run = R.Run(SPEC, reference_weights=False)
    out = {"name": case["name"], "rank": dist.get_rank()}
    try:
        meta = load_checkpoint(run.chunks, run.opt, case["dir"], scheduler=run.sched)
        out.update(step=meta["step"], client_state=meta["client_state"], digest=_digest(run))
    except CheckpointError as e:
        out["error"] = str(e)
    dist.barrier()
    return out
