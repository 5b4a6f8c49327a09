"""DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) in the DeepSpeed
pipeline runtime on gloo ranks: pp × sp ranks, each holding 1/sp of every sequence, against
the single-process model on whole sequences.

    launch(4, [{"fn": "harness.ds_ulysses:cases_case", "cases": [case, ...]}], env=harness.ENV)

A case: ``{"pp": 2, "sp": 2, "n": 4, "schedule": "1f1b"}``.  Per case and rank one row: the
largest gradient difference (SGD with lr 1: the step is the gradient) against the
non-pipelined, non-sequence-parallel model, the loss, and how many attention cores run as
``DistributedAttention``.
"""
from __future__ import annotations

import copy

import torch

SEQ, MBS, BLOCKS = 8, 2, 4


def _reference(layers0, batches):
    """Gradients and mean loss of the whole model on whole sequences, one process."""
    from ds_autoplan.models.tiny_gpt import gpt_loss
    model = torch.nn.Sequential(*copy.deepcopy(layers0))
    total = 0.0
    for x, y in batches:
        loss = gpt_loss(model(x), y) / len(batches)
        loss.backward()
        total += float(loss)
    return [[p.grad.clone() for p in m.parameters()] for m in model], total


def run_case(case, layers0, batches, ref):
    from deepspeed.sequence.layer import DistributedAttention

    from ds_autoplan.models.tiny_gpt import gpt_loss, ulysses_layers
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.deepspeed import api
    from ds_autoplan.runtime.deepspeed.ulysses import sequence_parallel_group, shard_sequence
    from ds_autoplan.schedule import build
    pp, sp, n = case["pp"], case["sp"], case["n"]
    world = torch.distributed.get_world_size()
    S = build(case["schedule"], pp, n).num_stages
    # sp > 1: the plan's context parallelism, run as Ulysses; sp = 1: the same ranks as dp
    plan = Plan(pp=pp, cp=sp, dp=world // (pp * sp), micro_batch_size=MBS, num_microbatches=n,
                precision="fp32", schedule=case["schedule"], layers_per_stage=[BLOCKS // S] * S,
                recompute_per_stage=[0.0] * S)
    group = sequence_parallel_group(plan)
    layers = [copy.deepcopy(m) for m in layers0]
    if group is not None:
        layers = ulysses_layers(layers, group)
    cfg = {"steps_per_print": 10 ** 9, "gradient_clipping": 0.0}
    engine, *_ = api.initialize(layers, plan, loss_fn=gpt_loss, config=cfg,
                                optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    mod = engine.module
    local = [(lo + i, f) for (lo, _), fs in zip(mod.chunk_bounds, mod.chunk_funcs) for i, f in enumerate(fs)]
    before = {i: [p.detach().clone() for p in f.parameters()] for i, f in local}
    mine = [shard_sequence((x, y), group) if group is not None else (x, y) for x, y in batches]
    loss = float(engine.train_batch(iter(mine)))
    ref_grads, ref_loss = ref
    err = scale = 0.0
    for i, f in local:
        for p0, p, g in zip(before[i], f.parameters(), ref_grads[i]):
            err = max(err, float((p0 - p.detach() - g).abs().max()))
            scale = max(scale, float(g.abs().max()))
    return {"schedule": case["schedule"], "sp": sp, "rank": torch.distributed.get_rank(),
            "stage": engine.stage_id, "max_grad_err": err, "max_grad": scale,
            "loss": loss, "ref_loss": ref_loss, "train_batch_size": engine.train_batch_size(), "tokens_per_rank": int(mine[0][0].numel()),
            "sp_group_size": torch.distributed.get_world_size(group) if group is not None else 1,
            "distributed_attention": sum(isinstance(m, DistributedAttention)
                                         for _, f in local for m in f.modules())}


def cases_case(case) -> dict:
    """A launcher case (:func:`ds_autoplan.runtime.launch.launch`): every case of
    ``case["cases"]`` on the launcher's process group; this rank's results under ``"rows"``."""
    from ds_autoplan.models.tiny_gpt import TinyGPT, example_batch
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    init_distributed()            # DeepSpeed's comm on the launcher's group
    cases = case["cases"]
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, hidden=16, num_layers=BLOCKS, num_heads=2, seq_len=SEQ)
    batches = [example_batch(model.cfg, MBS, seed=m) for m in range(cases[0]["n"])]
    ref = _reference(model.layers(), batches)
    return {"rows": [run_case(c, model.layers(), batches, ref) for c in cases]}
