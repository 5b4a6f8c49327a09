"""DynaPipe iteration plans in our Megatron forward_backward_func: per-step schedule,
per-micro-batch shapes without a handshake, token-weighted losses; gradients, losses and
parameters equal to the unpipelined model on the same samples (2 CPU ranks, gloo)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

TOL = 1e-5
PAD, GBS, MAXLEN, N = 8, 12, 40, 40


def _lengths():
    """Real lengths (the shipped distribution) scaled down to a tiny model: 2..40 tokens."""
    from ds_autoplan.dynamic import LengthSampler
    return np.clip(LengthSampler(seed=3)(N) // 8, 2, MAXLEN)


def _planner():
    from ds_autoplan.dynamic import CostModel, IterationPlanner
    return IterationPlanner(CostModel(layers=1, overhead=0.05, lin=0.01, quad=0.001, pad_to=PAD), 2)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, lengths, vocab, seed=5):
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _causal(L):
    # explicit causal mask: Megatron's default one is built on device "cuda"
    return torch.triu(torch.ones(1, 1, L, L, dtype=torch.bool), diagonal=1)


def _lm(model, tok, lab):
    """Per-token loss [b, L] of ``model`` and the loss mask (padding carries no loss)."""
    b, L = tok.shape
    pos = torch.arange(L).unsqueeze(0).expand(b, L)
    return model(tok, pos, _causal(L), labels=lab.clamp(min=0)), (lab != -100).float()


def forward_step(data_it, model):
    tok, lab = next(data_it)
    out, mask = _lm(model, tok, lab)

    def loss_func(o):
        loss = (o.float() * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}
    return out, loss_func


def forward_step_per_token(data_it, model):
    """Megatron's per-token form (``calculate_per_token_loss``): (loss sum, tokens, report)."""
    tok, lab = next(data_it)
    out, mask = _lm(model, tok, lab)

    def loss_func(o):
        total, count = (o.float() * mask).sum(), mask.sum().to(torch.int)
        return total, count, {"loss": (total / count).detach().clone()}
    return out, loss_func


def _pairs(chunks, ref, setup, layers):
    """(parameter of a local chunk, the reference model's parameter it copies)."""
    from ds_autoplan.models import megatron_gpt as T
    rp = dict(ref.named_parameters())
    for c, m in enumerate(chunks):
        off = T.stage_offset(layers, setup.stages[c])
        for name, p in getattr(m, "module", m).named_parameters():   # unwrap Megatron's DDP
            yield p, rp[T.global_name(name, off)]


def dynamic_case(case) -> dict:
    """Runs on every rank (harness.megatron_cases.launch): ``steps`` optimizer steps,
    each with its own DynaPipe plan, vs the whole model on the step's samples in one batch."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.utils.data import DataLoader

    from ds_autoplan.dynamic.sampler import DynamicBatchSampler, pad_collate
    from ds_autoplan.runtime.megatron import ScheduleRunner, cpu_shim, initialize, loss_weights, step_kwargs
    from harness.megatron_cases import sgd
    from ds_autoplan.models import megatron_gpt as T
    from ds_autoplan.plan import Plan
    from ds_autoplan.schedule import ScheduleError

    ps.destroy_model_parallel()
    layers = case["layers"]
    # the static plan only fixes the partition and (sequential) placement
    setup = initialize(Plan(pp=2, num_microbatches=1, micro_batch_size=1, schedule="1f1b",
                            layers_per_stage=layers, recompute_per_stage=[0.0, 0.0],
                            precision="fp32"))
    ref = T.build_reference(sum(layers), max_seq=MAXLEN)
    per_token = case.get("per_token", False)
    chunks = T.build_chunks(setup, max_seq=MAXLEN, calculate_per_token_loss=per_token)
    T.copy_weights(ref, chunks, setup, layers)
    params = [p for m in chunks for p in m.parameters()]
    step_func, grad = forward_step, (lambda p: p.grad)
    if per_token:
        # Megatron's own way: its DDP (grads in main_grad) and finalize_model_grads, which
        # divides by the step's token count that our executor accumulates
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig,
                                               finalize_model_grads)
        with cpu_shim(remap_cuda_factories=True):
            chunks = [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c)
                      for c in chunks]
        cfg = chunks[0].config
        cfg.no_sync_func, cfg.finalize_model_grads_func = chunks[0].no_sync, finalize_model_grads
        step_func, grad = forward_step_per_token, (lambda p: p.main_grad)
    ds = TokenDataset(_lengths(), T.VOCAB)
    collate = pad_collate(pad_to=PAD)
    sampler = DynamicBatchSampler(_lengths(), GBS, _planner(), seed=1)
    it = iter(DataLoader(ds, batch_sampler=sampler, collate_fn=collate))
    fb, plans = ScheduleRunner(None), []
    res = {"rank": setup.pp_rank, "shapes": [], "losses": [], "ref_losses": [], "uniform_gap": [],
           "max_grad_err": 0.0, "max_grad": 0.0}
    for _ in range(case["steps"]):
        first = next(it)
        plan = sampler.pop_plan()          # this step's plan, planned in the background
        plans.append(plan)
        batches = [first] + [next(it) for _ in range(plan.num_microbatches - 1)]
        assert [tuple(b[0].shape) for b in batches] == [tuple(s) for s in plan.shapes]
        res["shapes"].append([list(s) for s in plan.shapes])
        w = loss_weights([int((lab != -100).sum()) for _, lab in batches])
        losses = fb(forward_step_func=step_func, data_iterator=iter(batches), model=chunks,
                    microbatch_weights=None if per_token else w,
                    **step_kwargs(plan, group=ps.get_pipeline_model_parallel_group()))
        # reference: all the step's samples in one batch through the whole model
        tok, lab = collate([ds[i] for mb in plan.microbatches for i in mb])
        with cpu_shim():
            # Megatron's default instead: the mean over micro-batches of their mean losses
            # (a separate forward: Megatron's cross-entropy backward works in place)
            out, mask = _lm(ref, tok, lab)
            rows = np.cumsum([0] + [len(mb) for mb in plan.microbatches])
            uniform = sum((out[a:b] * mask[a:b]).sum() / mask[a:b].sum()
                          for a, b in zip(rows[:-1], rows[1:])) / plan.num_microbatches
            g_uni = torch.autograd.grad(uniform, list(ref.parameters()))
            out, mask = _lm(ref, tok, lab)
            ref_loss = (out * mask).sum() / mask.sum()
            ref_loss.backward()
        g_ref = [p.grad for p in ref.parameters()]
        res["uniform_gap"].append(max(float((a - b).abs().max()) for a, b in zip(g_uni, g_ref))
                                  / max(float(b.abs().max()) for b in g_ref))
        got = [float(x["loss"]) for x in losses]
        res["losses"].append(float(sum(wi * x for wi, x in zip(w, got))) if got else None)
        res["ref_losses"].append(float(ref_loss))
        for p, q in _pairs(chunks, ref, setup, layers):
            res["max_grad_err"] = max(res["max_grad_err"], float((grad(p) - q.grad).abs().max()))
            res["max_grad"] = max(res["max_grad"], float(q.grad.abs().max()))
        if per_token:
            for p in params:
                p.grad = p.main_grad.clone()
            for m in chunks:
                m.zero_grad_buffer()
        sgd(params)
        sgd(ref.parameters())
    res["max_param_err"] = max(float((p - q).abs().max())
                               for p, q in _pairs(chunks, ref, setup, layers))
    # forward-only (evaluation) on the last step's batches with the updated weights
    with torch.no_grad():
        losses = fb(forward_step_func=step_func, data_iterator=iter(batches), model=chunks,
                    forward_only=True, microbatch_weights=None if per_token else w,
                    **step_kwargs(plan))
        with cpu_shim():
            out, mask = _lm(ref, tok, lab)
        res["eval"] = [float(sum(wi * float(x["loss"]) for wi, x in zip(w, losses)))
                       if losses else None, float((out * mask).sum() / mask.sum())]
    # ranks holding different plans: a clear error on every rank, before any transfer
    try:
        step_kwargs(plans[setup.pp_rank - 1], group=ps.get_pipeline_model_parallel_group())
        res["mismatch_error"] = None
    except ScheduleError as e:
        res["mismatch_error"] = str(e)
    dist.barrier()
    return res


@pytest.mark.timeout(90)
def test_dynamic_plans_match_unpipelined_run():
    """Loss weights (``microbatch_weights``) and Megatron's per-token loss (its DDP and
    ``finalize_model_grads``), each 2 steps with different plans."""
    from harness.megatron_cases import launch
    cases = [dict(fn=f"{__file__}:dynamic_case", layers=[1, 1], steps=2, per_token=pt)
             for pt in (False, True)]
    out = launch(2, cases, timeout=80)
    for i in range(len(cases)):
        _check(out[0][i], out[1][i])


def _check(r0, r1):
    # two steps with different micro-batch counts and shapes, the same plan on both ranks
    assert r0["shapes"] == r1["shapes"]
    assert all("different iteration plans" in r["mismatch_error"] for r in (r0, r1))
    assert len({len(s) for s in r0["shapes"]}) == 2 or r0["shapes"][0] != r0["shapes"][1]
    assert len({tuple(s) for step in r0["shapes"] for s in step}) >= 3
    for r in (r0, r1):
        assert r["max_grad_err"] <= TOL * max(1.0, r["max_grad"]), r
        assert r["max_param_err"] <= TOL, r
    last = r1 if r1["losses"][0] is not None else r0
    assert r0["losses"][0] is None or r1["losses"][0] is None
    assert last["losses"] == pytest.approx(last["ref_losses"], rel=TOL)
    assert last["eval"][0] == pytest.approx(last["eval"][1], rel=TOL)
    # Megatron's default 1/num_microbatches averaging would not match (the test can fail)
    assert min(last["uniform_gap"]) > 100 * TOL


def test_step_kwargs_and_loss_weights():
    from ds_autoplan.dynamic.sampler import DynamicBatchSampler
    from ds_autoplan.runtime.megatron import loss_weights, step_kwargs
    sampler = DynamicBatchSampler(_lengths(), GBS, _planner(), seed=1, background="none")
    plan = next(sampler.iter_plans())
    kw = step_kwargs(plan)
    assert kw["num_microbatches"] == plan.num_microbatches == len(kw["microbatch_shapes"])
    assert kw["schedule"].has_comm() and kw["schedule"].num_microbatches == plan.num_microbatches
    assert kw["seq_length"] == max(L for _, L in plan.shapes) and kw["decoder_seq_length"] is None
    assert loss_weights([1, 3]) == pytest.approx([0.25, 0.75])
    with pytest.raises(ValueError):
        loss_weights([0, 0])


def test_shape_plan_mismatch_is_a_clear_error():
    from ds_autoplan.runtime.megatron import ScheduleRunner
    from ds_autoplan.schedule import ScheduleError, build
    fb = ScheduleRunner(None)
    with pytest.raises(ScheduleError, match="no schedule"):
        fb(forward_step_func=None, data_iterator=None, model=[], num_microbatches=2,
           seq_length=8, micro_batch_size=1)
    with pytest.raises(ScheduleError):  # 3 shapes for 2 micro-batches (checked before any comm)
        fb(forward_step_func=None, data_iterator=None, model=[], num_microbatches=2, seq_length=8,
           micro_batch_size=1, schedule=build("1f1b", 1, 2), microbatch_shapes=[(1, 8)] * 3)


@pytest.mark.timeout(90)
def test_example_trains_with_dynamic_plans():
    import os
    import subprocess
    import sys
    from ds_autoplan.runtime.launch import free_port
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()),
           os.path.join(root, "examples", "train_megatron_dynamic.py"), "--steps", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=80,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert p.returncode == 0 and len(steps) == 3, p.stdout + p.stderr
    assert len({ln.split("[")[1] for ln in steps}) == 3       # a different plan every step
    losses = [float(ln.rsplit(" ", 1)[1]) for ln in steps]
    assert losses[-1] < losses[0]
