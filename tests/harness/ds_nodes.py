"""Launcher cases of tests/test_nodes.py: a DeepSpeed script's ``deepspeed.initialize`` of a
``PipelineModule`` through ds_autoplan's hook (as ``deepspeed --autoplan`` runs it, options
installed as the bootstrap installs them), on whatever world and nodes the launch formed.

``train``: ``case["options"]`` are the hook's options (``pp``, ``schedules``, ``out``: the hook
plans the script's layers for the launch's nodes, ``--cluster auto``; or ``plan``: the plan of
another run); three optimizer steps on fixed data; the rank's losses (the hook writes the
plan to ``out``).  ``cluster_cmd``: ``ds-autoplan cluster`` run by every rank of the launch.
"""
from __future__ import annotations

import torch

SEQ, VOCAB, STEPS = 8, 32, 3


def _data(n: int):
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return [(x[:-1].contiguous(), x[1:].contiguous()) for x in t]


def _micro_batches(engine, samples):
    """Data-parallel rank d's micro-batches of every step: the same samples whatever the launch
    (and the same every step, so the loss falls)."""
    mbs, gas = engine.micro_batch_size, engine.gradient_accumulation_steps()
    start = engine.grid.data_parallel_id * mbs * gas
    for i in range(gas):
        part = samples[start + i * mbs:start + (i + 1) * mbs]
        yield torch.stack([x for x, _ in part]), torch.stack([y for _, y in part])


def train(case) -> dict:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from ds_autoplan.clients import deepspeed_hook
    from ds_autoplan.models.tiny_gpt import gpt_loss, gpt_tiny
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    init_distributed()
    deepspeed_hook.install(case["options"])
    model = gpt_tiny(vocab_size=VOCAB, hidden=16, num_layers=4, num_heads=2, seq_len=SEQ, seed=0)
    module = PipelineModule(layers=model.layers(), loss_fn=gpt_loss, num_stages=2)
    samples = _data(8)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=module, training_data=samples, config=cfg,
                                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05))
    losses = [float(engine.train_batch(_micro_batches(engine, samples))) for _ in range(STEPS)]
    return {"rank": dist.get_rank(), "losses": losses}


def cluster_cmd(case) -> dict:
    """``ds-autoplan cluster --out FILE`` on every rank of the launch (rank 0 writes FILE)."""
    import torch.distributed as dist

    from ds_autoplan.cli import main
    return {"rank": dist.get_rank(), "rc": main(["cluster", "--out", case["out"]])}
