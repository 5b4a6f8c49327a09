"""Plan -> megatron.json (TransformerConfig / parallel sizes) and megatron_args.txt (flags of
Megatron-LM's pretrain_gpt.py).  Uneven stage layer counts use megatron-core 0.16's
``pipeline_model_parallel_layout`` (integration.md §4.3; 'E' embedding, 't' decoder layer,
'L' loss, '|' between stages, ordered vpp0pp0, vpp0pp1, ...)."""
from __future__ import annotations

import re

from ..plan import Plan

# characters a value may hold so that the flags work unquoted: as `$(...)` output (word
# splitting only, no quote removal) and as lines of megatron_args.txt ('|' is data there)
_UNQUOTED_SAFE = re.compile(r"[A-Za-z0-9_.,:=+/@%|-]+")

def _schedule(plan: Plan):
    """The plan's schedule (None for pp = 1); its placement decides what Megatron can express."""
    return plan.build_schedule() if plan.pp > 1 else None


def megatron_stage_counts(plan: Plan) -> list[int] | None:
    """Layer counts in Megatron's (vpp, pp) order, or None when Megatron's placement cannot
    express the schedule's (V-shapes put stage 2P-1-r on rank r)."""
    sched = _schedule(plan)
    if sched is not None and not sched.round_robin:
        return None
    return list(plan.layers_per_stage)      # 1F1B: pp order; interleaved: chunk*pp + rank


def layout_string(counts: list[int]) -> str:
    """``--pipeline-model-parallel-layout`` form, e.g. 'Ett|ttL' ('E' embedding, 't' decoder
    layer, 'L' loss, '|' between stages in (vpp, pp) order)."""
    S = len(counts)
    return "|".join(("E" if s == 0 else "") + "t" * int(n) + ("L" if s == S - 1 else "")
                    for s, n in enumerate(counts))


def megatron_config(plan: Plan, model=None) -> dict:
    """Keys named as megatron-core's ModelParallelConfig / TransformerConfig fields."""
    from ..spec import SpecError
    from ..spec.model import load_model
    m = model
    if m is None and plan.model:
        try:
            m = load_model(plan.model, plan.seq_len or None)
        except SpecError:          # not a preset (profiled or user spec): sizes from the plan only
            m = None
    par = plan.parallel
    vpp = par.chunks if par.pp > 1 else None
    cfg = {
        "tensor_model_parallel_size": par.tp,
        "pipeline_model_parallel_size": par.pp,
        "virtual_pipeline_model_parallel_size": vpp if vpp and vpp > 1 else None,
        "sequence_parallel": par.sequence_parallel,
        "micro_batch_size": par.micro_batch,
        "global_batch_size": plan.global_batch_size,
        "num_microbatches": par.num_microbatches,
        "data_parallel_size": par.dp,
        "use_distributed_optimizer": par.zero >= 1,
        "bf16": plan.precision == "bf16", "fp16": plan.precision == "fp16",
    }
    if m is not None:
        cfg.update({"num_layers": m.num_layers, "hidden_size": m.hidden,
                    "num_attention_heads": m.heads,
                    "num_query_groups": int(m.config.get("kv_heads", m.heads)),
                    "ffn_hidden_size": int(m.config.get("ffn", 4 * m.hidden)),
                    "seq_length": m.seq_len, "vocab_size": m.vocab,
                    "gated_linear_unit": m.arch == "llama", **_architecture(m)})
    counts = megatron_stage_counts(plan)
    if plan.pp > 1 and counts is not None:
        cfg["pipeline_model_parallel_layout"] = layout_string(counts)
        group = _schedule(plan).meta.get("microbatch_group_size_per_vp_stage")
        if vpp and vpp > 1 and group:
            cfg["microbatch_group_size_per_vp_stage"] = group
    # recompute: Megatron's 'block' method recomputes the first N layers of every stage; the
    # value is global in the args, so emit the largest per-stage count (memory-safe, for
    # Megatron's own schedules) and the per-stage counts.  ds_autoplan's executor (runtime,
    # patched pretrain_gpt.py) runs the per-stage counts as R actions instead and turns the
    # full recompute off (docs/megatron.md "Recomputation"; integration.md §4.3).
    per_stage = [round(r * n) for r, n in zip(plan.recompute_per_stage, plan.layers_per_stage)]
    if getattr(plan, "selective_recompute", False):     # Korthikanti et al. 2022 §5
        cfg.update({"recompute_granularity": "selective", "recompute_method": None,
                    "recompute_num_layers": None})
    elif any(per_stage):
        cfg.update({"recompute_granularity": "full", "recompute_method": "block",
                    "recompute_num_layers": max(per_stage)})
    else:
        cfg.update({"recompute_granularity": None, "recompute_method": None,
                    "recompute_num_layers": None})
    cfg["autoplan"] = {"schedule": plan.schedule, "schedule_options": dict(plan.schedule_options),
                       "layers_per_stage": list(plan.layers_per_stage),
                       "recompute_layers_per_stage": per_stage,
                       "layers_per_rank": layers_per_rank(plan)}
    if counts is None and plan.pp > 1:
        # the embedding (stage 0) and the output layer (stage 2P-1) are two chunks of pp rank 0,
        # which Megatron does not tie
        cfg["share_embeddings_and_output_weights"] = False
        cfg["autoplan"]["note"] = (f"{plan.schedule} places stage i and 2P-1-i on rank i; Megatron's "
                                   "layout cannot express that order: the patched pretrain_gpt.py "
                                   "(patches/megatron-lm-pretrain_gpt.patch) or ds_autoplan's "
                                   "Megatron runtime builds it from the plan")
    if m is not None and m.arch not in ("gpt", "llama"):
        cfg["autoplan"]["note_arch"] = f"pretrain_gpt.py trains decoder-only models; {m.arch} needs its own script"
    return cfg


def _architecture(m) -> dict:
    """Embedding tying, biases, positions, norm epsilon and experts of model ``m``, named as
    megatron-core's TransformerConfig fields (plus GPTModel's
    ``share_embeddings_and_output_weights``); unset values keep Megatron's defaults."""
    from ..spec.model import tied_embeddings
    c, rope = m.config, m.arch == "llama"
    lin = bool(c.get("linear_bias", not rope))
    out = {"share_embeddings_and_output_weights": tied_embeddings(c), "add_bias_linear": lin,
           "add_qkv_bias": lin or bool(c.get("qkv_bias")),
           "position_embedding_type": "rope" if rope else "learned_absolute",
           "rotary_base": int(c.get("rope_base", 10000)) if rope else None,
           "rope_scaling_factor": c.get("rope_scaling_factor") if rope else None,
           "layernorm_epsilon": c.get("norm_eps"),
           "num_moe_experts": c.get("num_experts"), "moe_router_topk": c.get("moe_topk")}
    return {k: v for k, v in out.items() if v is not None}


def _architecture_args(c: dict) -> list[str]:
    """Megatron-LM flags for :func:`_architecture`'s keys (arguments.py of core_v0.16.1)."""
    a = []
    if not c.get("share_embeddings_and_output_weights", True):
        a.append("--untie-embeddings-and-output-weights")
    if not c.get("add_bias_linear", True):
        a.append("--disable-bias-linear")
        if c.get("add_qkv_bias"):
            a.append("--add-qkv-bias")
    if c.get("rotary_base") is not None:
        a.append(f"--rotary-base {c['rotary_base']}")
    if c.get("rope_scaling_factor"):
        a += ["--use-rope-scaling", f"--rope-scaling-factor {c['rope_scaling_factor']}"]
    if c.get("layernorm_epsilon") is not None:
        a.append(f"--norm-epsilon {c['layernorm_epsilon']}")
    if c.get("num_moe_experts"):
        a += [f"--num-experts {c['num_moe_experts']}", f"--moe-router-topk {c['moe_router_topk']}"]
    return a


def layers_per_rank(plan: Plan) -> list[list[int]]:
    """Stage layer counts grouped by pipeline rank (schedule placement)."""
    sched = _schedule(plan)
    place = sched.placement if sched is not None else [0] * len(plan.layers_per_stage)
    return [[plan.layers_per_stage[s] for s in range(len(place)) if place[s] == r]
            for r in range(plan.pp)]


def megatron_args(plan: Plan, model=None) -> list[str]:
    """Flags for Megatron-LM's pretrain_gpt.py, one ``--flag value`` per item.  No value needs
    quoting, so the joined flags work verbatim as ``pretrain_gpt.py $(...)`` and as the lines
    of megatron_args.txt (``$(cat megatron_args.txt)``): a quote would reach Megatron
    literally, since ``$(...)`` output is only split at spaces."""
    c = megatron_config(plan, model)
    a = [f"--tensor-model-parallel-size {c['tensor_model_parallel_size']}",
         f"--pipeline-model-parallel-size {c['pipeline_model_parallel_size']}",
         f"--micro-batch-size {c['micro_batch_size']}",
         f"--global-batch-size {c['global_batch_size']}"]
    if "num_layers" in c:
        a += [f"--num-layers {c['num_layers']}", f"--hidden-size {c['hidden_size']}",
              f"--num-attention-heads {c['num_attention_heads']}",
              f"--ffn-hidden-size {c['ffn_hidden_size']}",
              f"--seq-length {c['seq_length']}", f"--max-position-embeddings {c['seq_length']}"]
        if c["num_query_groups"] != c["num_attention_heads"]:
            a += ["--group-query-attention", f"--num-query-groups {c['num_query_groups']}"]
        if c["gated_linear_unit"]:
            a += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope"]
        a += _architecture_args(c)
    if c.get("pipeline_model_parallel_layout"):
        a.append(f"--pipeline-model-parallel-layout {c['pipeline_model_parallel_layout']}")
    elif c["virtual_pipeline_model_parallel_size"]:
        # a V placement: Megatron's layout string cannot say "stage 2P-1-r on rank r", so only
        # the chunk count goes on the command line; the patched pretrain_gpt.py applies the
        # plan's placement (ds_autoplan.clients.megatron_lm)
        a.append(f"--num-virtual-stages-per-pipeline-rank {c['virtual_pipeline_model_parallel_size']}")
        if "--untie-embeddings-and-output-weights" not in a:   # (see megatron_config)
            a.append("--untie-embeddings-and-output-weights")
    if c.get("microbatch_group_size_per_vp_stage"):
        a.append("--microbatch-group-size-per-virtual-pipeline-stage "
                 f"{c['microbatch_group_size_per_vp_stage']}")
    if c["sequence_parallel"]:
        a.append("--sequence-parallel")
    if c["use_distributed_optimizer"]:
        a.append("--use-distributed-optimizer")
    if c["recompute_granularity"]:
        a.append(f"--recompute-granularity {c['recompute_granularity']}")
    if c["recompute_method"]:
        a += [f"--recompute-method {c['recompute_method']}",
              f"--recompute-num-layers {c['recompute_num_layers']}"]
    if c["bf16"]:
        a.append("--bf16")
    elif c["fp16"]:
        a.append("--fp16")
    for flag in a:
        if not all(_UNQUOTED_SAFE.fullmatch(tok) for tok in flag.split(" ")):
            raise ValueError(f"Megatron flag {flag!r} would need shell quoting")
    return a
