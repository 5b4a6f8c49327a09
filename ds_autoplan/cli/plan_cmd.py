"""`ds-autoplan plan`: search a plan and write ds_config.json, megatron.json,
megatron_args.txt, plan.json and report.md (+ plots) into --out."""
from __future__ import annotations

import gc
import json
import os
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan hybrid-parallel training (Galvatron-BMW search)",
                       description="Search the parallel plan for MODEL on CLUSTER and emit "
                                   "DeepSpeed and Megatron configuration.")
    add_problem_args(p)
    p.add_argument("--out", default=None, help="output folder (created if missing); each file is replaced atomically and nothing else in the folder is touched (see docs/reliability.md)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.add_argument("--emit", choices=["megatron-args", "ds-config", "hf"], default=None,
                   help="print only Megatron-LM's pretrain_gpt.py flags (one line, to append to "
                        "its command) or the ds_config.json on stdout; hf: plan for a Hugging Face "
                        "Trainer (DeepSpeed's engine: ZeRO, micro-batch, accumulation, gradient "
                        "checkpointing), write its ds_config.json and training_args.json under --out "
                        "and print the matching TrainingArguments flags (docs/huggingface.md)")
    p.add_argument("--partitioner", default="bmw", choices=["bmw", "even", "dawnpiper", "merak"],
                   help="how layers are cut into pipeline stages: bmw (Galvatron-BMW, balances time "
                        "and memory; default), even (equal layer counts), dawnpiper (DawnPiper's "
                        "binary partition), merak (Merak's graph sharding); the report compares all")
    from ..schedule.builders import names, searched_by_default
    p.add_argument("--schedules", default=None,
                   help=f"comma-separated candidate schedules (default {','.join(searched_by_default())}; "
                        f"registered: {', '.join(names())})")
    p.add_argument("--pp", type=int, default=None, help="restrict the search to this pipeline degree")
    p.add_argument("--tp", type=int, default=None, help="restrict the search to this tensor degree")
    p.add_argument("--sequence-parallel", choices=["auto", "on", "off"], default="auto",
                   help="Megatron sequence parallelism: auto = on whenever the plan has tp > 1 "
                        "(never slower, less activation memory); on = search tp > 1 only "
                        "(an error with --tp 1); off = never")
    p.add_argument("--fix", default=None, metavar="K=V,...",
                   help="restrict the search to your configuration, e.g. tp=8,pp=8,mbs=1,zero=1,"
                        "schedule=interleaved,v=3,recompute=full,sp=on,ep=8,etp=1,cp=2,cp_comm=p2p "
                        "(see `ds-autoplan cost`)")
    p.add_argument("--no-wide", action="store_true", help="skip the wide Galvatron-BMW mode")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def add_problem_args(p) -> None:
    """What is planned: model, cluster, batch, precision, budget (plan and cost)."""
    from ..cost.engines import OPTIMIZERS
    p.add_argument("--model", required=True,
                   help="preset name (`ds-autoplan presets` lists them), model YAML, or Hugging Face "
                        "config.json")
    p.add_argument("--cluster", required=True,
                   help="preset name (`ds-autoplan presets`; cpu-N: N CPU ranks), cluster YAML "
                        "(`ds-autoplan cluster --out`) or auto: this machine, detected (GPU kind and "
                        "memory; CPU ranks measured)")
    p.add_argument("--nodes", type=int, default=None,
                   help="with --cluster auto: identical nodes (default SLURM_JOB_NUM_NODES, else 1)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --cluster auto: devices per node (default SLURM_GPUS_ON_NODE, else "
                        "--world-size / nodes, else the visible GPUs; CPU ranks: 2)")
    p.add_argument("--global-batch", type=int, required=True, help="global batch size (samples)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: the preset's; for a Hugging Face config.json its "
                        "context, capped at 4096 tokens)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="training precision: bf16 (default) or fp16 mixed precision (16-bit "
                        "weights and activations, fp32 master weights and optimizer state), fp32")
    p.add_argument("--memory-budget-gb", type=float, default=None,
                   help="per-device budget (default: device memory minus the preset's reserve)")
    p.add_argument("--headroom-gb", type=float, default=None,
                   help="memory kept free below the budget (default: 5%% of device memory, 0 with "
                        "--memory-budget-gb)")
    p.add_argument("--runtime", choices=["any", "megatron", "deepspeed"], default="any",
                   help="whose memory accounting plans must fit (default: the larger of both)")
    p.add_argument("--execution", choices=["any", "megatron-core", "megatron-2021", "deepspeed", "fsdp"],
                   default=None,
                   help="the engine's execution model: what it overlaps and serialises "
                        "(ds_autoplan/cost/engines.py; default: the --runtime's engine, 'any' for any)")
    p.add_argument("--overlap", default=None, metavar="A,B",
                   help="engine overlap switches: grad-reduce, param-gather, tp-comm (no-X turns one off), "
                        "e.g. Megatron-LM's --overlap-grad-reduce --overlap-param-gather = grad-reduce,param-gather")
    p.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the data-parallel gradient reduction on the wire (default: the "
                        "engine's: fp32 for Megatron-LM bf16, else the parameter dtype)")
    p.add_argument("--attention-kernel", choices=["fa1", "fa2", "cudnn"], default=None,
                   help="attention-kernel generation of your stack: fa1 (flash-attn 1.x, Triton "
                        "pre-MLIR), fa2 (flash-attn 2.x, SDPA flash), cudnn (Transformer Engine on "
                        "Hopper); default: the GPU kind's (ds_autoplan/data/gpus.yaml)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default=None,
                   help="optimizer step: fused (FusedAdam, default), eager (a per-tensor loop of "
                        "torch ops, e.g. Composer's DecoupledAdamW) or distributed-fused-adam "
                        "(NeMo's Apex DistributedFusedAdam: bf16 master kept as a 16-bit remainder, "
                        "10 optimizer bytes per parameter instead of 12)")
    p.add_argument("--moe-dispatch", choices=["fused", "unfused"], default=None,
                   help="MoE token dispatch: fused (default; megatron-core's --moe-permute-fusion) or "
                        "unfused (megatron-core 2024's torch-op permute/unpermute, e.g. NeMo 24.09)")
    p.add_argument("--trainable", default=None, metavar="FRACTION|lora:r=R,targets=A,B",
                   help="which parameters train (frozen ones keep their 16-bit copy only: no "
                        "gradient, master or optimizer state): a fraction in (0, 1], or LoRA adapters, "
                        "e.g. lora:r=16,targets=q_proj,v_proj (default: all)")
    p.add_argument("--world-size", type=int, default=None, help="expected number of devices (checked)")
    p.add_argument("--profile", default=None, help="YAML/JSON of measured cluster overrides")


RUNTIME_ENGINE = {"any": "any", "megatron": "megatron-core", "deepspeed": "deepspeed"}


def execution_of(args):
    """The execution model the command line names: --execution (default: the --runtime's
    engine) with --overlap's switches, --grad-reduce-dtype, --attention-kernel, --optimizer,
    --moe-dispatch (the switches bench/published_runs.py sets per row)."""
    from ..cost.engines import get_execution
    return get_execution(args.execution or RUNTIME_ENGINE[args.runtime], args.overlap,
                         args.grad_reduce_dtype, args.attention_kernel, args.optimizer,
                         getattr(args, "moe_dispatch", None))


def search_options(args, **space):
    """The :class:`~ds_autoplan.search.options.SearchOptions` of the problem arguments
    (:func:`add_problem_args`: precision, budget, headroom, runtime, execution model, world
    size, profile) and the command's own (``space``)."""
    from ..search import SearchOptions
    return SearchOptions(precision=args.precision, budget_gb=args.memory_budget_gb,
                         headroom_gb=args.headroom_gb, runtime=args.runtime,
                         execution=execution_of(args), world_size=args.world_size,
                         profile=args.profile, trainable=getattr(args, "trainable", None), **space)


def param_counts(model) -> dict:
    """Parameters of the planned model: all of them and those each token goes through (a
    mixture of experts' routed experts it is not sent to left out; spec/blocks.py)."""
    return {"total_params": int(model.total_params), "active_params": int(model.active_params)}


def count_text(n: float) -> str:
    """A parameter count in the unit that keeps it readable: 12.852 B, 1.234 M, 213.5 K, 96."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if unit == 'K' else 3}f} {unit}"
    return f"{n:.0f}"


def params_line(model) -> str:
    c = param_counts(model)
    moe = c["active_params"] != c["total_params"]
    return (f"parameters {count_text(c['total_params'])}" +
            (f", {count_text(c['active_params'])} active per token" if moe else ""))


def summary(plan, model=None) -> dict:
    """``--json``: the plan as plan.json has it (without the per-layer labels, notes and the
    search's tables), its predicted figures (:meth:`Prediction.figures`; where a figure and a
    plan field share a name, ``offload``, the plan's), and the model's parameter counts."""
    d = plan.to_dict()
    for k in ("layer_strategies", "notes", "predicted"):
        del d[k]
    figures = {k: v for k, v in plan.predicted.figures().items() if k not in d}
    return {**(param_counts(model) if model is not None else {}), **d, **figures}


def trainable_line(t: dict) -> str:
    """What training only some parameters saves (search.planner.Planner.trainable_summary)."""
    full, mine = t["full_finetune_states_gb"], t["model_states_gb"]
    return (f"trainable {t['trainable_params'] / 1e6:.4g} M of {t['params'] / 1e9:.4g} B parameters "
            f"({t['trainable_params'] / t['params']:.3%}, {t['spec']}): model states {mine:.2f} GB per "
            f"device, a full fine-tune of this layout {full:.2f} GB ({full - mine:.2f} GB more"
            f"{f', {full / mine:.1f}x' if mine else ''})")


def offload_line(o: dict | None) -> str:
    """One line: what the plan offloads, the host memory of its busiest node and the seconds
    per iteration it costs; or why nothing is offloaded."""
    if not o or o.get("what", "none") == "none":
        return f"offload: none ({(o or {}).get('why', 'not considered')})"
    return (f"offload: {o['label']}; host memory {o['host_memory_gb_per_node']:.1f} GB / "
            f"{o['host_budget_gb_per_node']:.0f} GB per node; +{o['step_s']:.3g} s per iteration "
            "(host step, copies)")


def batch_line(plan) -> str:
    """How the global batch is split: micro-batch size x micro-batches x data-parallel ranks."""
    return (f"global batch {plan.global_batch_size} = micro-batch {plan.micro_batch_size} x "
            f"{plan.num_microbatches} micro-batches per iteration "
            f"({'pipelined' if plan.pp > 1 else 'gradient accumulation'}) x dp {plan.dp}")


def stages_line(plan) -> str:
    """Layers and recompute per pipeline stage; where a rank runs several stages (interleaved,
    V schedules), which ones."""
    out = f"layers per stage {plan.layers_per_stage}, recompute {plan.recompute_per_stage}"
    if plan.num_stages <= plan.pp:
        return out
    place = plan.stage_placement()
    held = [[s for s, r in enumerate(place) if r == rank] for rank in range(plan.pp)]
    shown = [f"rank {r} runs stages {', '.join(map(str, held[r]))}" for r in range(plan.pp)]
    if len(shown) > 3:
        shown = [*shown[:2], "...", shown[-1]]
    return (f"{out} ({plan.num_stages} stages, {plan.num_stages // plan.pp} per pipeline rank: "
            f"{'; '.join(shown)})")


def seq_line(plan, model, seq_arg) -> str:
    """The sequence length planned for, and where it came from."""
    if seq_arg is not None:
        return f"sequence length {plan.seq_len} (--seq)"
    return model.config.get("seq_note") or f"sequence length {plan.seq_len} (the model's; --seq to change)"


# what every plan writes under --out (checked before the search; gantt.png and memory.png,
# written when the plan has a pipeline, are checked when written, still before any file is)
OUT_FILES = ("plan.json", "ds_config.json", "megatron.json", "megatron_args.txt", "report.md",
             "memory_per_stage.png")


def write_outputs(res, out: str) -> list[str]:
    """The plan's files into the folder ``out`` (ds_autoplan.outputs.write_folder: each file
    replaced atomically, nothing there that ds-autoplan did not write is touched, the last
    run's files no longer produced are removed)."""
    from ..emit.deepspeed import ds_config
    from ..emit.megatron import NotExpressible, megatron_args, megatron_config
    from ..outputs import json_text, text, write_folder
    from ..report import report_files
    plan = res.plan
    files = {"plan.json": text(plan.to_json() + "\n"),
             "ds_config.json": json_text(ds_config(plan)),
             "megatron.json": json_text(megatron_config(plan, res.model))}
    try:
        files["megatron_args.txt"] = text("\n".join(megatron_args(plan, res.model)) + "\n")  # $(cat ...)
    except NotExpressible as e:           # megatron.json's autoplan.note_model says why
        print(f"ds-autoplan: megatron_args.txt not written: {e}", file=sys.stderr)
    files.update(report_files(res))
    return write_folder(out, files, complete=True)


def run(args) -> int:
    from ..search import search
    from . import UserError
    if args.out is not None:           # a wrong target is refused before the search
        from ..outputs import check_folder
        check_folder(args.out, OUT_FILES)
    if args.global_batch <= 0:
        raise UserError(f"--global-batch must be positive, got {args.global_batch}")
    if args.emit == "hf":
        return _run_hf(args)
    scheds = [s.strip() for s in args.schedules.split(",") if s.strip()] if args.schedules else None
    from .cluster_cmd import resolve
    args.cluster = resolve(args.cluster, args.nodes, args.gpus_per_node, args.world_size)
    res = search(args.model, args.cluster, args.global_batch, args.seq, search_options(
        args, partitioner=args.partitioner, schedules=scheds, wide=not args.no_wide,
        progress=not args.quiet and sys.stderr.isatty(), keep_sim=args.out is not None,
        pp=args.pp, tp=args.tp, sequence_parallel=args.sequence_parallel, fix=args.fix))
    # the search's memoised schedules and tables (~10^6 objects) stay alive: out of the
    # cyclic collector's reach while the report and plots allocate (it would re-scan them,
    # some 0.3 s), back in it when the command returns
    gc.freeze()
    try:
        return _report(res, args)
    finally:
        gc.unfreeze()


HF_FILES = ("plan.json", "ds_config.json", "training_args.json")


def _run_hf(args) -> int:
    """``--emit hf``: the plan of DeepSpeed's engine space (search/engine_space.py) as a Trainer
    takes it."""
    from ..emit.hf import args_line, hf_ds_config, training_args
    from ..outputs import json_text, text, write_folder
    from ..search.engine_space import search_engine_space
    from . import UserError
    if args.out is None:
        raise UserError("--emit hf writes ds_config.json and training_args.json: give --out FOLDER")
    from ..outputs import check_folder
    check_folder(args.out, HF_FILES)
    given = [f for f, v in (("--pp", args.pp), ("--schedules", args.schedules)) if v]
    if given:
        raise UserError(f"--emit hf plans DeepSpeed's engine without a pipeline; "
                        f"drop {', '.join(given)}")
    res = search_engine_space(args.model, args.cluster, args.global_batch, seq=args.seq, autotp=True,
                              options=search_options(args, tp=args.tp), fix=args.fix)
    plan = res.plan
    write_folder(args.out, {"plan.json": text(plan.to_json() + "\n"),
                            "ds_config.json": json_text(hf_ds_config(plan)),
                            "training_args.json": json_text(training_args(plan))}, complete=True)
    pr = plan.predicted
    print(f"{plan.model} on {plan.cluster}: dp={plan.dp}{f' AutoTP tp={plan.tp}' if plan.tp > 1 else ''} "
          f"ZeRO-{plan.zero_stage} micro-batch="
          f"{plan.micro_batch_size} x {plan.num_microbatches} accumulation steps, gradient checkpointing "
          f"{'on' if training_args(plan)['gradient_checkpointing'] else 'off'}", file=sys.stderr)
    print(f"predicted {pr.iteration_time_s:.4g} s/iteration, peak memory "
          f"{max(pr.peak_memory_gb_per_stage):.2f} GB / {pr.memory_budget_gb:.1f} GB", file=sys.stderr)
    if pr.trainable:
        print(trainable_line(pr.trainable), file=sys.stderr)
    print(f"wrote {', '.join(HF_FILES)} to {args.out}; TrainingArguments:", file=sys.stderr)
    print(args_line(plan, os.path.join(args.out, "ds_config.json")))
    return 0


def _report(res, args) -> int:
    """Outputs under --out and the printed plan (or --emit / --json)."""
    files = write_outputs(res, args.out) if args.out is not None else []
    plan = res.plan
    if args.emit == "megatron-args":   # unquoted on purpose: pretrain_gpt.py $(ds-autoplan plan ...)
        from ..emit.megatron import megatron_args
        print(" ".join(megatron_args(plan, res.model)))
    elif args.emit == "ds-config":
        from ..emit.deepspeed import ds_config
        print(json.dumps(ds_config(plan), indent=2))
    elif args.json:
        print(json.dumps(summary(plan, res.model)))
    else:
        pr = plan.predicted
        print(f"{plan.model} on {plan.cluster}: pp={plan.pp} tp={plan.tp}"
              f"{' (sequence parallel)' if plan.sequence_parallel else ''} dp={plan.dp} "
              f"{f'ep={plan.ep} etp={plan.etp} ' if plan.ep > 1 else ''}"
              f"{f'cp={plan.cp} ({plan.cp_comm}) ' if plan.cp > 1 else ''}"
              f"ZeRO-{plan.zero_stage} schedule={plan.schedule_label}")
        print(batch_line(plan))
        print(seq_line(plan, res.model, args.seq))
        print(params_line(res.model))
        print(stages_line(plan))
        print(f"predicted {pr.iteration_time_s:.4g} s/iteration, "
              f"{pr.throughput_tokens_per_s:.6g} tokens/s, MFU {pr.mfu:.1%}, "
              f"peak memory {max(pr.peak_memory_gb_per_stage):.2f} GB / {pr.memory_budget_gb:.1f} GB"
              f" (headroom {pr.memory_headroom_gb:.1f} GB kept free, {pr.memory_runtime} accounting)")
        print(offload_line(pr.offload))
        from ..cost.engines import band_text
        print(f"execution model {pr.execution}: {band_text(pr.error_band)}")
        if pr.trainable:
            print(trainable_line(pr.trainable))
        if pr.ratio_vs_best_baseline:
            print(f"{pr.ratio_vs_best_baseline:.3f}x the best baseline; search {pr.search_time_s:.2f} s")
        if files:
            print(f"wrote {', '.join(files)} to {args.out}")
    return 0
