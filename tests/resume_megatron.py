"""Megatron cases of tests/test_resume.py (every rank, through ds_autoplan.runtime.launch):
Megatron's own DDP and optimizer (Adam; ZeRO-1 = its DistributedOptimizer), our schedule
runner; train 3 steps under plan A, save, train 3 more; then plan B's chunks from other
weights load the checkpoint and train the same 3 steps.  A spec's ``sched``: Megatron-core's
OptimizerParamScheduler (warm-up, then linear decay); ``dropout``: the config's hidden dropout."""
from __future__ import annotations

import contextlib

STEPS, N, BLOCKS = 3, 4, 4          # N micro-batches per step over all replicas


def _plan(spec):
    from ds_autoplan.plan import Plan
    from ds_autoplan.models import megatron_gpt as T
    from ds_autoplan.schedule import build
    n = N // spec["dp"]
    S = build(spec["schedule"], spec["pp"], n).num_stages
    base, extra = divmod(BLOCKS, S)
    return Plan(pp=spec["pp"], dp=spec["dp"], zero_stage=spec["zero"], micro_batch_size=T.MBS,
                num_microbatches=n, global_batch_size=T.MBS * N, precision="fp32",
                schedule=spec["schedule"], layers_per_stage=[base + (s < extra) for s in range(S)],
                recompute_per_stage=[0.0] * S)


class Run:
    """One plan's model chunks (Megatron DDP), optimizer and schedule on this rank."""

    def __init__(self, spec, reference_weights: bool):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from ds_autoplan.runtime.megatron import cpu_shim, get_forward_backward_func, initialize
        from ds_autoplan.models import megatron_gpt as T
        ps.destroy_model_parallel()
        self.plan = _plan(spec)
        self.setup = initialize(self.plan)
        chunks = T.build_chunks(self.setup, hidden_dropout=spec.get("dropout", 0.0))
        if reference_weights:      # plan A starts from the whole model's weights
            T.copy_weights(T.build_reference(BLOCKS), chunks, self.setup, self.plan.layers_per_stage)
        zero = spec["zero"] > 0
        with cpu_shim(remap_cuda_factories=True), _cuda_type_names():
            self.chunks = [DistributedDataParallel(c.config, DistributedDataParallelConfig(
                use_distributed_optimizer=zero), c) for c in chunks]
            self.opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=0.01, min_lr=0.001, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=zero,
                params_dtype=torch.float32), self.chunks)
        for c in self.chunks:
            c.config.no_sync_func = [m.no_sync for m in self.chunks]
            c.config.finalize_model_grads_func = finalize_model_grads
        self.fb = get_forward_backward_func(self.plan)
        self.sched = _scheduler(self.opt) if spec.get("sched") else None
        self.lrs: list = []       # the learning rate each step ran at

    def train(self, data, steps):
        import torch
        import torch.distributed as dist

        from ds_autoplan.runtime.megatron import cpu_shim
        from ds_autoplan.models import megatron_gpt as T
        n, dp = self.plan.num_microbatches, self.plan.dp
        r = _dp_rank()
        out = []
        for s in steps:
            mine = data[s][r * n:(r + 1) * n]
            self.opt.zero_grad()
            for c in self.chunks:
                c.zero_grad_buffer()
            its = [iter(mine) for _ in self.chunks]
            losses = self.fb(forward_step_func=T.forward_step, model=self.chunks,
                             data_iterator=its if len(its) > 1 else its[0], num_microbatches=n,
                             seq_length=T.SEQ, micro_batch_size=T.MBS)
            self.lrs.append(self.opt.param_groups[0]["lr"])
            with cpu_shim(remap_cuda_factories=True), _cuda_type_names():
                self.opt.step()
            if self.sched is not None:
                self.sched.step(increment=1)
            # the step's loss: mean over the replica's micro-batches, averaged over replicas
            tot = torch.tensor(sum(float(x["loss"]) for x in losses) / n if losses else 0.0,
                               dtype=torch.float64)
            dist.all_reduce(tot)
            out.append(float(tot) / dp)
        return out


def _scheduler(opt):
    """Linear warm-up over 3 steps, then linear decay: each of the 6 steps has another rate."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(opt, init_lr=0.001, max_lr=0.01, min_lr=0.001, lr_warmup_steps=3,
                                   lr_decay_steps=8, lr_decay_style="linear", start_wd=0.0,
                                   end_wd=0.0, wd_incr_steps=8, wd_incr_style="constant")


@contextlib.contextmanager
def _cuda_type_names():
    """Megatron's DistributedOptimizer accepts parameters by ``param.type()`` naming a CUDA
    tensor type only (distrib_optimizer.py); on CPU report the CUDA name of the same dtype."""
    import torch
    orig = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and self.device.type == "cpu":
            name = orig(self)     # (may come back through this function for a Parameter)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return orig(self, dtype, non_blocking, **kw)
    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = orig


def _dp_rank():
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_rank()


def _data():
    import torch

    from ds_autoplan.models import megatron_gpt as T
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(2 * STEPS):
        tok = torch.randint(0, T.VOCAB, (N, T.MBS, T.SEQ), generator=g)
        out.append([(t, torch.roll(t, -1, 1)) for t in tok])
    return out


def resume_case(case) -> dict:
    import torch.distributed as dist

    from ds_autoplan.runtime.megatron.checkpoint import load_checkpoint, save_checkpoint
    data = _data()
    res = {"name": case["name"], "rank": dist.get_rank()}
    if "a" in case:
        run = Run(case["a"], reference_weights=True)
        first = run.train(data, range(STEPS))
        save_checkpoint(run.chunks, run.opt, case["dir"], plan=run.plan, step=STEPS, scheduler=run.sched,
                        client_state={"epoch": 7})
        res["uninterrupted"] = first + run.train(data, range(STEPS, 2 * STEPS))
        res["lr_a"] = run.lrs
    if "b" in case:
        run = Run(case["b"], reference_weights=False)
        meta = load_checkpoint(run.chunks, run.opt, case["dir"], scheduler=run.sched)
        res["resumed"] = run.train(data, range(STEPS, 2 * STEPS))
        res["lr_b"], res["client_state"] = run.lrs, meta["client_state"]
        res["saved_under"] = meta["plan"]["schedule"]
        res["rng_from"] = meta.get("rng_from_rank")
        res["stages"] = run.setup.stages
    dist.barrier()
    return res


def resume_cases(case) -> dict:
    """A launcher case (``harness.forked``): :func:`resume_case` for every case of
    ``case["cases"]``; this rank's results under ``"rows"``."""
    return {"rows": [resume_case(c) for c in case["cases"]]}
