"""The planner's report: chosen strategy per layer group, predicted time/throughput/MFU,
per-stage memory, baselines, wide-mode gain, alternatives and partitioners, plots."""
from __future__ import annotations

import itertools

GB = 1024 ** 3


def _groups(labels: list[str]) -> list[tuple[int, int, str]]:
    out, i = [], 0
    for lab, grp in itertools.groupby(labels):
        n = len(list(grp))
        out.append((i, i + n - 1, lab))
        i += n
    return out


def _fmt(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _sp(on) -> str:
    """Sequence parallelism (Megatron only; the DeepSpeed runtime has tp = 1)."""
    return "on" if on else "off"


def _schedule(name: str, options: dict) -> str:
    """``interleaved v=10``."""
    return " ".join([name, *(f"{k}={v}" for k, v in (options or {}).items())])


def _same(c, best) -> bool:
    """``c`` is the chosen plan (costed once in the search, once more in full for the report)."""
    return c is best or (c.par == best.par and c.schedule == best.schedule
                         and c.ok and abs(c.time - best.time) <= 1e-9 * best.time)


def plot_stage_memory(peaks_gb: list[float], budget_gb: float, path: str, title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(peaks_gb) + 2), 3.2))
    ax.bar(range(len(peaks_gb)), peaks_gb, color="#4C72B0")
    ax.axhline(budget_gb, color="#C44E52", linestyle="--", label=f"budget {budget_gb:.1f} GB")
    ax.set_xticks(range(len(peaks_gb)))       # one tick per rank, none between them
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak memory (GB)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_files(res) -> dict:
    """report.md (+ gantt.png, memory.png, memory_per_stage.png): file name -> a function
    writing it at the path it is given (``ds_autoplan.outputs.write_folder`` puts them in
    place)."""
    from ..outputs import text
    plan, best, pred = res.plan, res.best, res.plan.predicted
    fills = {}
    budget = pred.memory_budget_gb
    if best.sim is not None:
        sched, costs, sim = best.sim
        from ..schedule.plots import plot_gantt, plot_memory
        fills["gantt.png"] = lambda p: plot_gantt(
            sched, sim, p, title=f"{plan.schedule}: pp={plan.pp}, shown with "
                                 f"{sched.num_microbatches} of {plan.num_microbatches} micro-batches (seconds)")
        fills["memory.png"] = lambda p: plot_memory(sched, sim, p)
    fills["memory_per_stage.png"] = lambda p: plot_stage_memory(
        pred.peak_memory_gb_per_stage, budget, p, f"{plan.model}: peak memory per pipeline rank")
    files = list(fills)
    L = []
    w = L.append
    w(f"# ds-autoplan plan: {plan.model} on {plan.cluster}\n")
    w(f"Global batch {plan.global_batch_size}, sequence {plan.seq_len}, precision {plan.precision}, "
      f"memory budget {budget:.1f} GB per device (headroom {pred.memory_headroom_gb or 0.0:.1f} GB "
      f"kept free below it; {pred.memory_runtime or 'any'} engine accounting), {plan.world_size} devices. "
      f"Search took {pred.search_time_s:.2f} s ({pred.candidates_evaluated} configurations costed).\n")
    if getattr(res, "model", None) is not None:
        tot, act = res.model.total_params, res.model.active_params
        w(f"Model: {tot:,.0f} parameters" + (f", {act:,.0f} active per token (mixture of experts)"
                                             if act != tot else "") + ".\n")
    w("## Chosen plan\n")
    w("| pp | tp | sequence parallel | dp | ZeRO | schedule | micro-batch | micro-batches | partitioner |")
    w("|---|---|---|---|---|---|---|---|---|")
    w(f"| {plan.pp} | {plan.tp} | {_sp(plan.sequence_parallel)} | {plan.dp} | {plan.zero_stage} | "
      f"{_schedule(plan.schedule_label, plan.schedule_options)} | {plan.micro_batch_size} | "
      f"{plan.num_microbatches} | {plan.partitioner} |\n")
    w(f"Each iteration trains the global batch of {plan.global_batch_size} samples as micro-batches of "
      f"{plan.micro_batch_size}: {plan.num_microbatches} per data-parallel rank "
      f"({'pipelined' if plan.pp > 1 else 'gradient accumulation'}), on {plan.dp} data-parallel "
      f"rank{'s' if plan.dp > 1 else ''}.\n")
    if plan.ep > 1 or plan.cp > 1:
        w(f"Expert parallelism {plan.ep} (expert tensor parallelism {plan.etp}, expert data "
          f"parallelism {plan.parallel.expert_dp}); context parallelism {plan.cp}"
          + (f" ({'ring attention' if plan.cp_comm == 'p2p' else 'Ulysses all-to-all'})" if plan.cp > 1 else "")
          + ".\n")
    w(f"Predicted iteration time **{pred.iteration_time_s:.4g} s**, throughput "
      f"**{pred.throughput_tokens_per_s:.6g} tokens/s** ({pred.samples_per_s:.4g} samples/s), "
      f"MFU {pred.mfu:.1%}.")
    if pred.ratio_vs_best_baseline:
        w(f" Versus the best baseline: **{pred.ratio_vs_best_baseline:.3f}x**.")
    if pred.execution:
        from ..cost.engines import band_text
        w(f" Execution model: {pred.execution}; {band_text(pred.error_band)}.")
    off = pred.offload or {}
    if off.get("what", "none") != "none":
        w(f"\nOffload: **{off['label']}** (DeepSpeed `offload_optimizer` / `offload_param` / "
          f"`activation_checkpointing.cpu_checkpointing`, Megatron `--optimizer-cpu-offload`); host memory {off['host_memory_gb_per_node']:.1f} GB of "
          f"{off['host_budget_gb_per_node']:.0f} GB usable per node; it adds {off['step_s']:.3g} s "
          "per iteration (host optimizer step, host-device copies; docs/offload.md).")
    elif off.get("why"):
        w(f"\nOffload: none ({off['why']}).")
    w("\n## Layers, recompute and memory per stage\n")
    if plan.num_stages > plan.pp:
        w(f"{plan.num_stages} stages, {plan.num_stages // plan.pp} per pipeline rank "
          f"({plan.schedule}'s placement).\n")
    w("| stage | pipeline rank | layers | recomputed fraction |")
    w("|---|---|---|---|")
    for i, (rank, n, r) in enumerate(zip(plan.stage_placement(), plan.layers_per_stage,
                                         plan.recompute_per_stage)):
        w(f"| {i} | {rank} | {n} | {r:.2f} |")
    w("\n| pipeline rank | peak memory (GB) |")
    w("|---|---|")
    for r, g in enumerate(pred.peak_memory_gb_per_stage):
        w(f"| {r} | {g:.2f} |")
    if plan.layer_strategies:
        w("\n## Strategy per layer group (unit 0 = embedding, last = head)\n")
        w("| units | strategy |")
        w("|---|---|")
        for a, b, lab in _groups(plan.layer_strategies):
            w(f"| {a}-{b} | {lab} |")
    w("\n## Baselines (same cost model)\n")
    w("| baseline | pp | tp | SP | dp | ZeRO | offload | schedule | micro-batches | tokens/s | plan / baseline |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, b in pred.baselines.items():
        if b is None or not b["iteration_time_s"]:
            w(f"| {name} | - | - | - | - | - | - | - | - | OOM | - |")
            continue
        w(f"| {name} | {b['pp']} | {b['tp']} | {_sp(b.get('sequence_parallel'))} | {b['dp']} | "
          f"{b['zero_stage']} | {b.get('offload', 'none')} | {b['schedule']} | "
          f"{b['num_microbatches']} | {b['throughput_tokens_per_s']:.6g} | "
          f"{pred.throughput_tokens_per_s / b['throughput_tokens_per_s']:.3f} |")
    wide = pred.wide or {}
    if wide.get("bmw"):
        wb, ws = wide["bmw"], wide.get("base")
        w("\n## Wide Galvatron-BMW mode\n")
        w("Per-layer TP/DP/SDP/ZeRO-1/2 mixtures (docs/planner.md §1; mixtures run in neither "
          "DeepSpeed nor Megatron-core), costed like the executable plans (1F1B simulated); the "
          "executable space is part of it, so it is never slower:\n")
        w(f"* Galvatron-BMW ({wb.get('source', 'per-layer search')}): pp={wb['pp']}, "
          f"{wb['num_microbatches']} micro-batches, split "
          f"{wb['layers_per_stage']}, {wb['throughput_tokens_per_s']:.6g} tokens/s "
          f"(**{pred.wide_gain or 0:.3f}x** the executable plan"
          + (f", {pred.wide_gain_vs_1f1b:.3f}x its best 1F1B configuration" if pred.wide_gain_vs_1f1b else "")
          + ")")
        if ws:
            w(f"* Galvatron-Base (even split): pp={ws['pp']}, {ws['throughput_tokens_per_s']:.6g} tokens/s")
        w("\n| units | strategy |")
        w("|---|---|")
        for a, b, lab in _groups(wb["strategies"]):
            w(f"| {a}-{b} | {lab} |")
    if pred.schedules_tried:
        w("\n## Schedules tried for the chosen configuration\n")
        w("| schedule | iteration (s) | fits | layers per stage | recomputed layers |")
        w("|---|---|---|---|---|")
        for e in pred.schedules_tried:
            why = "" if e["fits"] else " (over budget)"
            w(f"| {e['schedule']} | {_fmt(e['iteration_time_s'], 4)}{why} | {e['fits']} | "
              f"{e['layers_per_stage']} | {e['recompute_layers']} |")
    if res.partitioners:
        w("\n## Partitioners (1F1B, same configuration)\n")
        w("| partitioner | iteration (s) | layers per stage |")
        w("|---|---|---|")
        for pn, c in res.partitioners.items():
            w(f"| {pn} | {_fmt(c.time if c.ok else None, 4)} | {list(c.parts)} |")
    w("\n## Alternatives costed\n")
    w("Configurations the search costed, fastest first, and why each lost to the chosen plan "
      f"({best.time:.4g} s per iteration).\n")
    w("| pp | tp | SP | dp | ZeRO | offload | micro-batch | micro-batches | best schedule | "
      "recomputed blocks | iteration (s) | why it lost |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in sorted((c for c in res.alternatives if not _same(c, best)), key=lambda c: c.time):
        why = (c.note or "does not fit") if not c.ok else f"{c.time / best.time:.3f}x slower"
        w(f"| {c.pp} | {c.tp} | {_sp(c.sp)} | {c.dp} | {c.zero} | {c.offload.text()} | {c.micro_batch} | "
          f"{c.num_microbatches} | {c.schedule if c.ok else '-'} | "
          f"{sum(c.recompute) if c.ok else '-'} | {_fmt(c.time if c.ok else None, 4)} | {why} |")
    w("\n## Plots\n")
    for f in files:
        w(f"![{f}]({f})")
    return {"report.md": text("\n".join(L) + "\n"), **fills}
