"""Plan -> megatron.json (TransformerConfig / parallel sizes) and megatron_args.txt (flags of
Megatron-LM's pretrain_gpt.py).  Uneven stage layer counts use megatron-core 0.16's
``pipeline_model_parallel_layout`` (docs/runtimes.md §4.3; 'E' embedding, 't' decoder layer,
'L' loss, '|' between stages, ordered vpp0pp0, vpp0pp1, ...)."""
from __future__ import annotations

import re

from ..plan import Plan
from ..spec import SpecError

# characters a value may hold so that the flags work unquoted: as `$(...)` output (word
# splitting only, no quote removal) and as lines of megatron_args.txt ('|' is data there)
_UNQUOTED_SAFE = re.compile(r"[A-Za-z0-9_.,:=+/@%|-]+")
# --moe-layer-freq's list expression (DeepSeek's leading dense layers: ([0]*3+[1]*58)) has no
# other form (Megatron-LM takes no file of flags; its YAML config replaces all of them).  It
# works unquoted: `$(...)` output is not re-parsed, so '(' is data, and as a glob it matches only
# a file named like '(0...3+1...58)' in the working directory (`set -f` rules even that out).

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
        "context_parallel_size": par.cp,
        "cp_comm_type": par.cp_comm if par.cp > 1 else None,
        "use_distributed_optimizer": par.zero >= 1,
        # Megatron-core's HybridDeviceOptimizer (optimizer/cpu_offloading): OptimizerConfig
        # fields; Megatron-LM asks for the precision-aware optimizer beside it (arguments.py)
        "optimizer_cpu_offload": par.offload.states,
        "optimizer_offload_fraction": par.offload.optimizer if par.offload.states else None,
        "overlap_cpu_optimizer_d2h_h2d": par.offload.states,
        "use_precision_aware_optimizer": par.offload.states,
        "bf16": plan.precision == "bf16", "fp16": plan.precision == "fp16",
    }
    if m is not None:
        blk = _typical_block(m)
        cfg.update({"num_layers": m.num_layers, "hidden_size": m.hidden,
                    "num_attention_heads": m.heads,
                    "num_query_groups": blk.kv if blk is not None else m.heads,
                    "ffn_hidden_size": int(m.config.get("ffn", 4 * m.hidden)),
                    "seq_length": m.seq_len, "vocab_size": m.vocab,
                    "gated_linear_unit": bool(blk is not None and blk.gated), **_architecture(m)})
        if cfg.get("num_moe_experts"):          # experts: Megatron-core's EP x ETP layout
            cfg.update({"expert_model_parallel_size": par.ep, "expert_tensor_parallel_size": par.etp,
                        "moe_token_dispatcher_type": "alltoall"})
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
    # full recompute off (docs/megatron.md "Recomputation"; docs/runtimes.md §4.3).
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
    if m is not None and _inexpressible(m):
        cfg["autoplan"]["note_model"] = _inexpressible(m)
    return cfg


class NotExpressible(SpecError):
    """The model has a feature Megatron-LM's pretrain_gpt.py flags cannot state."""


def _typical_block(m):
    """The first mixture-of-experts block, else the first block (its sizes are the model's)."""
    shapes = [l.shape for l in m.layers if l.shape is not None]
    return next((b for b in shapes if b.experts), shapes[0] if shapes else None)


# Megatron-core's LLaMA-3 RoPE scaling has fixed constants (rotary_pos_embedding.py
# _apply_scaling): only the factor is a flag
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# MLATransformerConfig's YaRN fields without a flag (their defaults; DeepSeek-V2/V3's values)
_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


def _inexpressible(m) -> str | None:
    """Why the flags cannot build model ``m`` (None: they can).  Gemma's GeGLU is a GELU-tanh
    gate: Megatron-LM offers --swiglu (SiLU) and --quick-geglu (x * sigmoid(1.702 x)), neither
    is it; TransformerConfig(gated_linear_unit=True, activation_func=gelu-tanh) from your own
    script is."""
    c, blk = m.config, _typical_block(m)
    if blk is not None and blk.act == "geglu":
        return (f"{m.name}: GeGLU (a GELU-tanh gate) has no Megatron-LM flag (--swiglu is SiLU, "
                "--quick-geglu is x*sigmoid(1.702x)); build TransformerConfig(gated_linear_unit=True, "
                "activation_func=gelu(approximate='tanh')) in your own script")
    if blk is not None and blk.norms != 2:
        return f"{m.name}: the extra pre/post-feedforward norms have no Megatron-LM flag"
    if blk is not None and (blk.sinks or blk.o_bias or blk.expert_bias or blk.act == "quick_geglu"):
        return (f"{m.name}: attention sinks, biases on the attention but not the MLP, expert biases or "
                "gpt-oss's clamped gate are not emitted as Megatron-LM flags")
    kind, rs = c.get("rope_scaling_type"), c.get("rope_scaling") or {}
    if kind == "llama3":
        bad = {k: rs[k] for k, v in _LLAMA3_FIXED.items() if k in rs and float(rs[k]) != v}
        if bad:
            return f"{m.name}: llama3 RoPE scaling with {bad}: Megatron fixes {_LLAMA3_FIXED}"
    elif kind == "yarn" and blk is not None and blk.mla:
        bad = {k: rs[k] for k, v in _YARN_FIXED.items() if k in rs and float(rs[k]) != v}
        if bad:
            return f"{m.name}: YaRN RoPE with {bad}: Megatron's MLA fixes {_YARN_FIXED}"
    elif kind is not None:
        return f"{m.name}: RoPE scaling of type {kind!r} has no Megatron-LM flag for this attention"
    return None


def _architecture(m) -> dict:
    """Embedding tying, biases, positions, norms, head size, attention and experts of model
    ``m``, named as megatron-core's TransformerConfig / MLATransformerConfig fields (plus
    GPTModel's ``share_embeddings_and_output_weights``); unset values keep Megatron's defaults."""
    from ..spec.model import tied_embeddings
    c, rope = m.config, m.arch == "llama"
    blk = _typical_block(m)
    lin = bool(c.get("linear_bias", not rope))
    out = {"share_embeddings_and_output_weights": tied_embeddings(c), "add_bias_linear": lin,
           "add_qkv_bias": lin or bool(c.get("qkv_bias")),
           "position_embedding_type": "rope" if rope else "learned_absolute",
           "rotary_base": int(c.get("rope_base", 10000)) if rope else None,
           "rotary_percent": c.get("rotary_percent") if rope else None,
           "rope_scaling_factor": c.get("rope_scaling_factor") if rope else None,
           "layernorm_epsilon": c.get("norm_eps")}
    if blk is None:
        return {k: v for k, v in out.items() if v is not None}
    if blk.mla:
        ql, kvl, nope, rp, v = blk.mla
        rs = c.get("rope_scaling") or {}
        out.update({"multi_latent_attention": True, "q_lora_rank": ql or None, "kv_lora_rank": kvl,
                    "qk_head_dim": nope, "qk_pos_emb_head_dim": rp, "v_head_dim": v,
                    "rope_type": "yarn" if c.get("rope_scaling_type") == "yarn" else "rope",
                    "rotary_scaling_factor": rs.get("factor") if c.get("rope_scaling_type") == "yarn" else None,
                    "mscale": rs.get("mscale"), "mscale_all_dim": rs.get("mscale_all_dim")})
    elif blk.hd * m.heads != m.hidden:
        out["kv_channels"] = blk.hd
    if blk.qk_norm:
        out["qk_layernorm"] = True
    windows = {l.shape.window for l in m.layers if l.shape is not None}
    w = max(windows)
    if w and w < m.seq_len:          # HF's window of W tokens: the token and W-1 before it
        out["window_size"] = [w - 1, 0]
        if 0 in windows:             # local layers with a global one every k (k-1 : 1)
            out["window_attn_skip_freq"] = int(c.get("global_every") or 0) or None
    if blk.experts:
        pattern = [int(bool(l.shape.experts)) for l in m.layers]
        out.update({"num_moe_experts": blk.experts, "moe_router_topk": blk.topk,
                    "moe_ffn_hidden_size": blk.expert_ffn,
                    "moe_shared_expert_intermediate_size": blk.shared_ffn or None,
                    "moe_shared_expert_gate": blk.shared_gate or None,
                    "moe_router_enable_expert_bias": blk.router_bias or None,
                    "moe_router_score_function": c.get("moe_score"),
                    "moe_router_pre_softmax": c.get("moe_pre_softmax") or None,
                    "moe_router_topk_scaling_factor": c.get("moe_scale"),
                    "moe_router_num_groups": c.get("moe_groups"),
                    "moe_router_group_topk": c.get("moe_group_topk"),
                    "moe_layer_freq": 1 if all(pattern) else pattern})
    return {k: v for k, v in out.items() if v is not None}


def _layer_freq(pattern) -> str:
    """``--moe-layer-freq``: 1 (every layer), or Megatron's list expression of the pattern in
    runs, e.g. ([0]*3+[1]*58) (arguments.py moe_freq_type; it allows only digits and ,[]()+*)."""
    if pattern == 1:
        return "1"
    runs, i = [], 0
    while i < len(pattern):
        j = i
        while j < len(pattern) and pattern[j] == pattern[i]:
            j += 1
        runs.append(f"[{pattern[i]}]*{j - i}")
        i = j
    return "(" + "+".join(runs) + ")"


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
    if c.get("rotary_percent") is not None:
        a.append(f"--rotary-percent {c['rotary_percent']}")
    if c.get("rope_scaling_factor"):
        a += ["--use-rope-scaling", f"--rope-scaling-factor {c['rope_scaling_factor']}"]
    if c.get("layernorm_epsilon") is not None:
        a.append(f"--norm-epsilon {c['layernorm_epsilon']}")
    if c.get("kv_channels"):
        a.append(f"--kv-channels {c['kv_channels']}")
    if c.get("multi_latent_attention"):
        a.append("--multi-latent-attention")
        if c.get("q_lora_rank"):
            a.append(f"--q-lora-rank {c['q_lora_rank']}")
        a += [f"--kv-lora-rank {c['kv_lora_rank']}", f"--qk-head-dim {c['qk_head_dim']}",
              f"--qk-pos-emb-head-dim {c['qk_pos_emb_head_dim']}", f"--v-head-dim {c['v_head_dim']}",
              f"--rope-type {c['rope_type']}"]
        for k in ("rotary_scaling_factor", "mscale", "mscale_all_dim"):
            if c.get(k) is not None:
                a.append(f"--{k.replace('_', '-')} {c[k]}")
    if c.get("qk_layernorm"):
        a.append("--qk-layernorm")
    if c.get("window_size"):
        a.append(f"--window-size {c['window_size'][0]},{c['window_size'][1]}")
        if c.get("window_attn_skip_freq"):
            a.append(f"--window-attn-skip-freq {c['window_attn_skip_freq']}")
    if c.get("num_moe_experts"):
        a += [f"--num-experts {c['num_moe_experts']}", f"--moe-router-topk {c['moe_router_topk']}",
              f"--moe-ffn-hidden-size {c['moe_ffn_hidden_size']}",
              f"--moe-layer-freq {_layer_freq(c['moe_layer_freq'])}"]
        if c.get("moe_shared_expert_intermediate_size"):
            a.append(f"--moe-shared-expert-intermediate-size {c['moe_shared_expert_intermediate_size']}")
        if c.get("moe_shared_expert_gate"):
            a.append("--moe-shared-expert-gate")
        if c.get("moe_router_enable_expert_bias"):
            a.append("--moe-router-enable-expert-bias")
        if c.get("moe_router_pre_softmax"):
            a.append("--moe-router-pre-softmax")
        for k in ("moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_num_groups",
                  "moe_router_group_topk"):
            if c.get(k) is not None:
                a.append(f"--{k.replace('_', '-')} {c[k]}")
    return a


def layers_per_rank(plan: Plan) -> list[list[int]]:
    """Stage layer counts grouped by pipeline rank (schedule placement)."""
    sched = _schedule(plan)
    place = sched.placement if sched is not None else [0] * len(plan.layers_per_stage)
    return [[plan.layers_per_stage[s] for s in range(len(place)) if place[s] == r]
            for r in range(plan.pp)]


# the flags a plan decides (megatron_args): ``ds-autoplan launch -- torchrun ...``
# gives the script the plan's, whatever its command line says, and keeps every other flag
PLAN_FLAGS = frozenset((
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
    "--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size",
    "--microbatch-group-size-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--sequence-parallel", "--context-parallel-size",
    "--cp-comm-type", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--moe-token-dispatcher-type", "--use-distributed-optimizer", "--optimizer-cpu-offload",
    "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers"))


def with_plan_flags(argv: list[str], plan) -> list[str]:
    """The script's arguments ``argv`` with every flag of :data:`PLAN_FLAGS` (and its values)
    taken out and ``plan``'s own appended (:func:`plan_flags`).  Flags the plan does not decide (the model, data,
    optimizer, the global batch) stay as the user wrote them and are checked against the
    plan at start-up as always."""
    kept, i = [], 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok.split("=", 1)[0] not in PLAN_FLAGS:
            kept.append(tok)
            continue
        while "=" not in tok and i < len(argv) and not argv[i].startswith("--"):
            i += 1              # the flag's values
    return kept + plan_flags(plan)


def plan_flags(plan) -> list[str]:
    """The flags of :data:`PLAN_FLAGS` for ``plan`` (:func:`megatron_args`), as tokens."""
    return [tok for flag in megatron_args(plan) if flag.split(" ", 1)[0] in PLAN_FLAGS
            for tok in flag.split(" ")]


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
        note = c["autoplan"].get("note_model")
        if note:
            raise NotExpressible(note)
        if c["num_query_groups"] != c["num_attention_heads"]:
            a += ["--group-query-attention", f"--num-query-groups {c['num_query_groups']}"]
        if c["gated_linear_unit"]:
            a.append("--swiglu")           # the only gate left: _inexpressible refused GeGLU
        if c.get("position_embedding_type") == "rope":
            a += ["--normalization RMSNorm", "--position-embedding-type rope"]
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
    if c["context_parallel_size"] > 1:
        a += [f"--context-parallel-size {c['context_parallel_size']}",
              f"--cp-comm-type {c['cp_comm_type']}"]
    if c.get("moe_token_dispatcher_type"):
        a += [f"--expert-model-parallel-size {c['expert_model_parallel_size']}",
              f"--expert-tensor-parallel-size {c['expert_tensor_parallel_size']}",
              f"--moe-token-dispatcher-type {c['moe_token_dispatcher_type']}"]
    if c["use_distributed_optimizer"]:
        a.append("--use-distributed-optimizer")
    if plan.parallel.offload.any:
        from ..cost.offload import check
        why = check("megatron", plan.zero_stage, plan.parallel.offload, plan.pp)
        if why:
            raise NotExpressible(f"offload {plan.offload} (ZeRO-{plan.zero_stage}): {why}; the plan "
                                 "runs in DeepSpeed (ds_config.json)")
    if c["optimizer_cpu_offload"]:
        a += ["--optimizer-cpu-offload", f"--optimizer-offload-fraction {c['optimizer_offload_fraction']:g}",
              "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"]
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
        if flag.startswith("--moe-layer-freq ("):
            continue                         # see the note under _UNQUOTED_SAFE
        if not all(_UNQUOTED_SAFE.fullmatch(tok) for tok in flag.split(" ")):
            raise ValueError(f"Megatron flag {flag!r} would need shell quoting")
    return a
