"""`ds-autoplan profile`: trace a model with torch.fx, measure per-unit costs on this device,
write profile.json (reused when it matches); optionally benchmark the hardware into a cluster
spec YAML."""
from __future__ import annotations

import os

from . import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("profile",
                       help="profile a model (fx trace + measured costs) and/or the hardware",
                       description="Trace MODEL with torch.fx (transformer blocks are kept whole), "
                                   "measure each partition unit's forward/backward time, saved "
                                   "activation bytes and boundary bytes on this device, and write "
                                   "a profile for `ds-autoplan plan --profile`.")
    p.add_argument("model", nargs="?",
                   help="built-in model (gpt-tiny, gpt-tiny-4, megatron-gpt-tiny, hf-gpt2-tiny, "
                        "hf-llama-tiny; hf-* need transformers) or module:path.to.factory")
    p.add_argument("--out", "-o", default="profile.json",
                   help="profile file (default profile.json)")
    p.add_argument("--batch-size", "--mbs", type=int, default=1, help="micro-batch size profiled")
    p.add_argument("--leaf", action="append", default=[], metavar="CLASS",
                   help="module class kept whole (one node); repeatable")
    p.add_argument("--no-auto-leaf", action="store_true",
                   help="do not keep detected transformer blocks whole")
    p.add_argument("--granularity", choices=("block", "node"), default="block",
                   help="block: layer list [pre, blocks, post]; "
                        "node: fine-grained chain (DawnPiper)")
    p.add_argument("--max-cross", type=int, default=1,
                   help="tensors allowed across a cut (node granularity)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    p.add_argument("--timing", choices=("chain", "isolated"), default="chain",
                   help="chain: time units inside whole-model steps (hooks); isolated: each "
                        "unit alone in a loop")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed repeats")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    p.add_argument("--force", action="store_true",
                   help="re-measure even if --out exists; replace an existing --hardware file")
    p.add_argument("--hardware", metavar="CLUSTER_YAML",
                   help="also benchmark matmul FLOP/s, collectives, the CPU optimizer (DeepSpeedCPUAdam) and the host-device copy into this cluster spec")
    p.add_argument("--world", type=int, default=2, help="processes for the collective benchmark")
    p.add_argument("--quick", action="store_true", help="small hardware benchmark")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    g = p.add_argument_group("DawnPiper partition and memory policy of the profile "
                             "(docs/dawnpiper.md §6-7)")
    g.add_argument("--stages", type=int, default=0,
                   help="cut the profiled units into this many pipeline stages")
    g.add_argument("--mem-cap", type=float, default=None, metavar="GB",
                   help="per-stage memory cap (default: no cap)")
    g.add_argument("--schedule", default="1f1b", help="schedule giving in-flight copies")
    g.add_argument("--microbatches", type=int, default=None, help="default 2 x stages")
    g.add_argument("--per-tensor", action="store_true",
                   help="keep / recompute / swap per saved tensor (default: per unit)")
    g.add_argument("--swap-GBps", type=float, default=12.0,
                   help="host link bandwidth for swapping; 0 disables swapping")
    g.add_argument("--policy-out", default=None,
                   help="also write the partition report (JSON) to this file (default: printed "
                        "only; `profile` writes no file it was not given)")
    p.set_defaults(func=run)


def _print_profile(prof) -> None:
    rows = [(u.name, u.kind, f"{u.params:,}", f"{u.fwd_s * 1e3:.3f}", f"{u.bwd_s * 1e3:.3f}",
             f"{u.act_bytes / 1024:.1f}", f"{u.out_bytes / 1024:.1f}") for u in prof.units]
    if prof.loss:
        rows.append(("(loss)", "post", "0", f"{prof.loss['fwd_s'] * 1e3:.3f}",
                     f"{prof.loss['bwd_s'] * 1e3:.3f}", f"{prof.loss['act_bytes'] / 1024:.1f}",
                     "-"))
    head = ("unit", "kind", "params", "fwd ms", "bwd ms", "saved KiB", "out KiB")
    try:
        from rich.console import Console
        from rich.table import Table
        t = Table(title=f"{prof.model} on {prof.device.get('name')} "
                        f"(micro-batch {prof.batch_size})")
        for h in head:
            t.add_column(h, justify="left" if h in ("unit", "kind") else "right")
        for r in rows:
            t.add_row(*r)
        Console().print(t)
    except ImportError:  # pragma: no cover
        print("  ".join(head))
        for r in rows:
            print("  ".join(r))


def _partition(prof, args) -> None:
    from ..search.dawnpiper import partition_report
    from ..schedule import ScheduleError
    if args.stages > prof.num_units or (args.mem_cap or 1) <= 0 or args.swap_GBps < 0:
        raise UserError(f"--stages must be <= {prof.num_units} units, --mem-cap > 0, "
                        "--swap-GBps >= 0")
    cap = args.mem_cap * 2 ** 30 if args.mem_cap else float("inf")
    try:
        rep = partition_report(prof, args.stages, cap, schedule=args.schedule,
                               microbatches=args.microbatches, per_tensor=args.per_tensor,
                               swap_GBps=args.swap_GBps or None,
                               prefix_only=True)   # what recompute_per_stage executes
    except (KeyError, ScheduleError, ValueError) as e:
        raise UserError(f"cannot partition: {e}") from None
    from ..outputs import json_text, write_file
    path = args.policy_out
    if path is not None:
        write_file(path, json_text(rep, indent=1), what="--policy-out")
    print(f"{'wrote ' + path if path else 'partition'}: units per stage {rep['units_per_stage']}, recompute "
          f"{[round(x, 2) for x in rep['recompute_per_stage']]}, swap bytes "
          f"{rep['swap_bytes_per_stage']}" + ("" if rep["feasible"] else " (cap NOT met)"))


def run(args) -> int:
    if args.model is None and not args.hardware:
        raise UserError("give a MODEL to profile and/or --hardware CLUSTER_YAML")
    if args.batch_size < 1 or args.repeats < 1 or args.warmup < 0 or \
            (args.threads is not None and args.threads < 1):
        raise UserError("--batch-size, --repeats and --threads must be >= 1, --warmup >= 0")
    from ..outputs import resolve_file
    for opt, path in (("--out", args.out if args.model else None), ("--policy-out", args.policy_out),
                      ("--hardware", args.hardware)):
        if path is not None:            # a wrong target is refused before anything is measured
            resolve_file(path, opt, create_parent=False)     # (and before torch's import: ~2 s)
    if args.hardware and os.path.lexists(args.hardware) and not args.force:
        raise UserError(f"--hardware {args.hardware} exists: refusing to replace it (a cluster file "
                        "to read is given with --cluster to plan/cost); pass --force to measure "
                        "again and overwrite it")
    import torch
    from ..models import resolve_model
    from ..profile import hardware_cluster_spec, profile_model
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here")
    if args.model:
        existed = os.path.exists(args.out) and not args.force
        prof = profile_model(resolve_model(args.model), batch_size=args.batch_size, leaf_classes=args.leaf,
                             auto_leaves=not args.no_auto_leaf, granularity=args.granularity,
                             max_cross=args.max_cross, device=args.device, repeats=args.repeats,
                             warmup=args.warmup, out=args.out, reuse=not args.force,
                             timing=args.timing)
        if args.json:
            import json
            print(json.dumps(prof.to_dict(), indent=1))
        else:
            _print_profile(prof)
            print(f"{'reused' if existed else 'wrote'} {args.out} ({prof.num_units} units, "
                  f"{prof.total_params:,} parameters)")
        if args.stages:
            _partition(prof, args)
    elif args.stages:
        raise UserError("--stages needs a MODEL")
    if args.hardware:
        import yaml
        spec = hardware_cluster_spec(world=args.world, device=args.device, quick=args.quick)
        from ..outputs import text, write_file
        write_file(args.hardware, text(yaml.safe_dump(spec, sort_keys=False)), what="--hardware")
        c = spec["cluster"]
        print(f"wrote {args.hardware}: matmul {c['peak_tflops'] * 1e3:.1f} GFLOP/s, all-reduce "
              f"{c['intra_node_GBps']:.2f} GB/s, p2p {c['p2p_GBps']:.2f} GB/s "
              f"({spec['measured']['backend']}, {args.world} processes); host: "
              + (f"CPU Adam {c['cpu_adam_rate_per_core'] / 1e6:.0f} M params/s per core x {c['cpu_cores']}"
                 if c.get("cpu_adam_rate_per_core") else
                 f"no CPU Adam rate ({spec['measured']['cpu_adam'].get('error', 'not measured')})")
              + f", copy {c['host_link_GBps']:.1f} GB/s")
    return 0
