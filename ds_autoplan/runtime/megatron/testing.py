"""Tiny megatron-core GPT, weight copying and a multi-process launcher (tests, example, bench).

``launch(world, cases, ...)`` starts ``world`` CPU processes with gloo (``python -m
ds_autoplan.runtime.megatron.testing``), runs every case in one process group (imports are paid
once), and returns each rank's results.  A rank that fails exits at once (its sockets close,
so peers error out instead of hanging); the launcher kills the rest on the first failure and
everything after ``timeout`` seconds.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

VOCAB, HIDDEN, HEADS, SEQ, MBS = 32, 16, 2, 8, 2


# ------------------------------------------------------------------------------ launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cases: list, timeout: float = 240.0, module: str = __name__) -> list:
    """Run ``cases`` (JSON-able dicts) on ``world`` ranks; returns per-rank lists of results."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "cases.json")
        with open(spec, "w") as f:
            json.dump(cases, f)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs, logs = [], []
        for r in range(world):
            log = open(os.path.join(tmp, f"log{r}.txt"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, spec, os.path.join(tmp, f"out{r}.json")],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        failed = None
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad or time.time() > deadline:
                failed = bad[0] if bad else "timeout"
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        if failed is None:
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            failed = bad[0] if bad else None
        if failed is not None:
            texts = []
            for r, log in enumerate(logs):
                log.seek(0)
                texts.append(f"--- rank {r} (rc {procs[r].returncode}) ---\n" + log.read()[-4000:])
            raise RuntimeError(f"multi-process run failed (rank {failed}):\n" + "\n".join(texts))
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"out{r}.json")) as f:
                out.append(json.load(f))
        return out


# ------------------------------------------------------------------------------ model
def base_config(**over):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=2 * HIDDEN,
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
              pipeline_dtype=torch.float32, params_dtype=torch.float32,
              deallocate_pipeline_outputs=True, bias_activation_fusion=False,
              bias_dropout_fusion=False, masked_softmax_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False)
    kw.update(over)
    return TransformerConfig(**kw)


class SPTorchNorm:
    """torch ``LayerNorm`` for sequence parallelism on CPU: Megatron's local ``WrappedTorchNorm``
    refuses SP and its ``FusedLayerNorm`` needs apex.  A norm is per token, so SP only needs
    what ``FusedLayerNorm`` does: mark the parameters ``sequence_parallel`` (their gradients
    are summed over the tp group, as ``finalize_model_grads`` does)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        import torch
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(split: bool = True, sp: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from .splitgrad import split_backward_spec
    spec = get_gpt_layer_local_spec()
    if sp:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SPTorchNorm
    return split_backward_spec(spec) if split else spec


def gpt(config, pre_process=True, post_process=True, vp_stage=None, split=True, seed=1234,
        max_seq=SEQ):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)
    torch.manual_seed(seed)
    spec = layer_spec(split, config.sequence_parallel)
    if config.sequence_parallel:     # the block's final norm, too
        spec = TransformerBlockSubmodules([spec] * get_num_layers_to_build(config, vp_stage),
                                          layer_norm=SPTorchNorm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=max_seq, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def build_reference(num_layers: int, split=True, max_seq=SEQ, tp=1, sp=False):
    """The whole model on this pipeline rank (pp=1 config), deterministic weights; with
    ``tp`` > 1 it is tensor-parallel on this rank's tp group (sharded like the chunks)."""
    cfg = dict(tensor_model_parallel_size=tp, sequence_parallel=sp) if tp > 1 else {}
    return gpt(base_config(num_layers=num_layers, **cfg), split=split, max_seq=max_seq)


def build_chunks(setup, split=True, max_seq=SEQ, **cfg_over):
    """This rank's model chunks per :func:`ds_autoplan.runtime.megatron.initialize`'s setup."""
    base = base_config(**{**setup.config_overrides, **cfg_over})
    return [gpt(setup.chunk_config(base, c), setup.pre_process(c), setup.post_process(c),
                setup.vp_stage(c), split=split, max_seq=max_seq) for c in range(setup.num_chunks)]


def global_name(name: str, offset: int) -> str:
    if name.startswith("decoder.layers."):
        rest = name[len("decoder.layers."):]
        i, tail = rest.split(".", 1)
        return f"decoder.layers.{int(i) + offset}.{tail}"
    return name


def stage_offset(layers_per_stage, stage) -> int:
    return sum(layers_per_stage[:stage])


def copy_weights(ref, chunks, setup, layers_per_stage):
    import torch
    rp = dict(ref.named_parameters())
    with torch.no_grad():
        for c, m in enumerate(chunks):
            off = stage_offset(layers_per_stage, setup.stages[c])
            for n, p in m.named_parameters():
                p.copy_(rp[global_name(n, off)])


def data_iter(seed=7):
    import torch
    g = torch.Generator().manual_seed(seed)
    while True:
        tok = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        yield tok, torch.roll(tok, -1, 1)


def _loss_func(out):
    loss = out.float().mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_it, model):
    import torch
    tok, lab = next(data_it) if data_it is not None else (None, None)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    # explicit causal mask: Megatron's default one is built on device "cuda"
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return model(tok, pos, mask, labels=lab), _loss_func


def sgd(params, lr=0.05):
    import torch
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None


# ------------------------------------------------------------------------------ cases
def _plan(case):
    from ...plan import Plan
    d, n, name = case["pp"], case["n"], case.get("schedule", "custom")
    return Plan(pp=d, tp=case.get("tp", 1), sequence_parallel=case.get("sp", False), dp=1,
                num_microbatches=n, micro_batch_size=MBS, schedule=name,
                schedule_options=case.get("options", {}), layers_per_stage=case["layers"],
                recompute_per_stage=case.get("recompute", [0.0] * len(case["layers"])),
                precision="fp32")


def run_case(case) -> dict:
    """One schedule (ours or Megatron's own), 2 training steps; compares with a local
    no-pipeline run of the same model (Megatron's forward_backward_no_pipelining)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as ms

    from ..memtrack import MemTracker
    from ...schedule import Costs, Schedule, simulate
    from . import get_forward_backward_func, initialize
    from .shim import cpu_shim

    ps.destroy_model_parallel()
    plan = _plan(case)
    sched = Schedule.from_dict(case["sched"]) if "sched" in case else plan.build_schedule()
    setup = initialize(plan, schedule=sched)
    rank, S, n = setup.pp_rank, sched.num_stages, plan.num_microbatches
    L = sum(plan.layers_per_stage)
    split = case.get("split", True)
    # tp > 1: a reference with Megatron's own linear layers ("ref_split": False) checks the
    # tensor-parallel communication of the split layers against Megatron's
    ref = build_reference(L, split=case.get("ref_split", split), tp=plan.tp,
                          sp=setup.config_overrides["sequence_parallel"])
    chunks = build_chunks(setup, split=split, **case.get("config", {}))
    copy_weights(ref, chunks, setup, plan.layers_per_stage)
    params = [p for m in chunks for p in m.parameters()]
    runner = case.get("runner", "ours")
    tracker = MemTracker(exclude=params) if runner == "ours" else None
    fb = get_forward_backward_func(plan, schedule=sched, tracker=tracker) if runner == "ours" else None
    res = {"rank": rank, "tp_rank": ps.get_tensor_model_parallel_rank(), "stages": setup.stages,
           "losses": [], "ref_losses": [], "max_grad_err": 0.0, "max_grad": 0.0,
           "peak_bytes": [], "time": [], "w_items": 0,
           "has_w": runner == "ours" and any(a.kind.value == "W" for a in sched.ranks[rank])}
    w_items = _count_w_items(res)
    for step in range(case.get("steps", 2)):
        with cpu_shim(remap_cuda_factories=True):
            ref_l = ms.forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=data_iter(step), model=[ref],
                num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
        its = [data_iter(step) for _ in chunks]
        kw = dict(forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
                  model=chunks, num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
        t0 = time.perf_counter()
        if runner == "ours":
            losses = fb(**kw)
            res["peak_bytes"].append(fb.peak_bytes)
        else:  # Megatron's own schedule for this parallel state (1F1B or interleaved)
            with cpu_shim(remap_cuda_factories=True):
                losses = ms.get_forward_backward_func()(**kw)
        res["time"].append(time.perf_counter() - t0)
        if setup.config_overrides["sequence_parallel"]:
            _allreduce_sp_grads([ref, *chunks])
        rp = dict(ref.named_parameters())
        for c, m in enumerate(chunks):
            off = stage_offset(plan.layers_per_stage, setup.stages[c])
            for nme, p in m.named_parameters():
                g_ref = rp[global_name(nme, off)].grad
                assert p.grad is not None, f"no gradient for {nme} (stage {setup.stages[c]}) step {step} " + str([q for q, pp in m.named_parameters() if pp.grad is None])
                res["max_grad_err"] = max(res["max_grad_err"], float((p.grad - g_ref).abs().max()))
                res["max_grad"] = max(res["max_grad"], float(g_ref.abs().max()))
        res["losses"].append([float(x["loss"]) for x in losses])
        res["ref_losses"].append([float(x["loss"]) for x in ref_l])
        sgd(params)
        sgd(ref.parameters())
    if runner == "ours" and tracker is not None:
        # simulator with the measured per-(stage, mb) deltas of this rank's actions; other
        # ranks' stages get zeros (only this rank's peak is compared)
        import numpy as np
        mf, mb_, mw = (np.zeros((S, n)) for _ in range(3))
        keep = np.zeros((S, n))
        for (k, s, m), v in fb.mem_deltas.items():
            if k == "F":
                mf[s, m] = v
            elif k == "B":
                mb_[s, m] = v
            elif k == "BW":
                mb_[s, m] = v
            elif k == "R":
                mf[s, m] += v
        mw = -(mf + mb_)
        rec = {(a.stage, a.mb) for a in sched.actions() if a.kind.value == "R"}
        for (s, m) in rec:
            keep[s, m] = fb.mem_deltas.get(("F", s, m), 0.0)
        costs = Costs.per_stage(S, n, 1.0, 1.0, 1.0, mem_f=mf, mem_b=mb_, mem_w=mw, keep_ckpt=keep)
        res["sim_peak_bytes"] = simulate(sched.compute_only(), costs).peak_memory[rank]
    # one forward-only (evaluation) pass, as Megatron-LM's evaluate() runs it
    with cpu_shim(remap_cuda_factories=True), torch.no_grad():
        ref_l = ms.forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=data_iter(99), model=[ref],
            num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
        its = [data_iter(99) for _ in chunks]
        kw.update(data_iterator=its if len(chunks) > 1 else its[0], forward_only=True)
        if runner == "ours":
            losses = fb(**kw)
        else:
            losses = ms.get_forward_backward_func()(**kw)
    w_items()
    res["eval_losses"] = [float(x["loss"]) for x in losses]
    res["ref_eval_losses"] = [float(x["loss"]) for x in ref_l]
    dist.barrier()
    return res


def _count_w_items(res):
    """Count, into ``res["w_items"]``, the deferred weight-gradient closures of the Megatron
    split layers that W actions run (shows that W does work); returns the undo."""
    from ..splitgrad import WeightGradStore
    from . import splitgrad
    run_all = WeightGradStore.run_all

    def counting(store):
        res["w_items"] += sum(fn.__module__ == splitgrad.__name__ for fn, _, _ in store._items)
        return run_all(store)
    WeightGradStore.run_all = counting

    def undo():
        WeightGradStore.run_all = run_all
    return undo


def _allreduce_sp_grads(models):
    """What Megatron's ``finalize_model_grads`` does for sequence-parallel parameters (norms:
    each tp rank saw its slice of the sequence), on plain ``.grad`` (no DDP here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    for m in models:
        for p in m.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def dropout_case(case) -> dict:
    """The same schedule with and without recomputation (R) of some stages, hidden dropout
    on: R must replay each forward's random state, so gradients agree exactly; a third run
    without dropout shows that dropout is really drawn."""
    import torch
    from megatron.core import parallel_state as ps

    from ...schedule import Kind, Schedule
    from . import get_forward_backward_func, initialize
    with_r = Schedule.from_dict(case["sched"])
    no_r = Schedule.from_keys("no-r", with_r.num_microbatches, with_r.placement,
                              [[(a.kind.value, a.stage, a.mb) for a in acts if a.kind != Kind.R]
                               for acts in with_r.ranks])
    grads = []
    for sched, p in ((with_r, case["dropout"]), (no_r, case["dropout"]), (no_r, 0.0)):
        ps.destroy_model_parallel()
        plan = _plan(case)
        setup = initialize(plan, schedule=sched)
        chunks = build_chunks(setup, hidden_dropout=p)
        torch.manual_seed(4321 + setup.pp_rank)
        its = [data_iter(0) for _ in chunks]
        get_forward_backward_func(plan, schedule=sched)(
            forward_step_func=forward_step, data_iterator=its if len(chunks) > 1 else its[0],
            model=chunks, num_microbatches=plan.num_microbatches, seq_length=SEQ,
            micro_batch_size=MBS)
        grads.append([q.grad.clone() for m in chunks for q in m.parameters()])
    err = max(float((a - b).abs().max()) for a, b in zip(grads[0], grads[1]))
    diff = max(float((a - b).abs().max()) for a, b in zip(grads[1], grads[2]))
    return {"rank": setup.pp_rank, "recomputes": sum(a.kind == Kind.R for a in with_r.ranks[setup.pp_rank]),
            "max_err": err, "dropout_effect": diff}


def fail_case(case) -> dict:
    """Our schedule with a forward_step_func that raises on one rank in the middle of the
    pipeline while the other ranks wait on receives (launcher robustness test)."""
    from megatron.core import parallel_state as ps

    from . import get_forward_backward_func, initialize
    ps.destroy_model_parallel()
    plan = _plan(case)
    setup = initialize(plan)
    chunks = build_chunks(setup)
    calls = []

    def bad_step(data_it, model):
        calls.append(1)
        if setup.pp_rank == case.get("bad_rank", 1) and len(calls) == 3:
            raise RuntimeError("deliberate failure")
        return forward_step(data_it, model)

    its = [data_iter(0) for _ in chunks]
    get_forward_backward_func(plan)(
        forward_step_func=bad_step, data_iterator=its if len(chunks) > 1 else its[0],
        model=chunks, num_microbatches=plan.num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
    return {}


def _worker(spec_path, out_path):
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if os.environ.get("DSAP_DEBUG"):
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DSAP_DEBUG"]), exit=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    with open(spec_path) as f:
        cases = json.load(f)
    results = []
    for i, case in enumerate(cases):
        if os.environ.get("DSAP_DEBUG"):
            print(f"case {i}: {case.get('schedule')} {case.get('runner', 'ours')}", flush=True)
        fn = case.get("fn", "run_case")
        results.append(globals()[fn](case) if fn in globals() else _import_fn(fn)(case))
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _import_fn(path):
    """``package.module:fn`` or ``path/to/file.py:fn``."""
    import importlib
    import importlib.util
    mod, _, name = path.rpartition(":")
    if mod.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_dsap_case_module", mod)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)
    return getattr(importlib.import_module(mod), name)


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    try:
        _worker(sys.argv[1], sys.argv[2])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
