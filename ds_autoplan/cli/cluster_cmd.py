"""`ds-autoplan cluster`: the cluster to plan for, detected on this machine or read from
`nvidia-smi` output, printed (datasheet and measured figures side by side) and written as a
cluster YAML that `--cluster FILE` takes.

    ds-autoplan cluster --out cluster.yaml                  # this machine (measured)
    torchrun --nnodes 2 --nproc_per_node 8 ... -m ds_autoplan cluster --out cluster.yaml
                                                            # every node of a launch, links measured
    ds-autoplan cluster --from-smi smi.csv --topo topo.txt --nodes 4 --out cluster.yaml
                                                            # a cluster you are not on

``--cluster auto`` (plan, cost, launch, ``deepspeed --autoplan``, ``ds_autoplan.initialize``)
detects the same way: :func:`resolve` for the commands that plan before any rank runs.
"""
from __future__ import annotations

import os
import sys

from . import UserError

AUTO = "auto"


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="detect this machine (or read nvidia-smi output) into a "
                                       "cluster YAML for --cluster",
                       description=__doc__.splitlines()[0])
    p.add_argument("--out", "-o", default=None, help="write the cluster YAML here (default: print only)")
    p.add_argument("--from-smi", metavar="FILE", default=None,
                   help="read `nvidia-smi --query-gpu=name,memory.total --format=csv` output "
                        "(one node's GPUs) instead of detecting this machine")
    p.add_argument("--topo", metavar="FILE", default=None,
                   help="with --from-smi: `nvidia-smi topo -m` output of that node (NVLink or PCIe "
                        "between its GPUs; default: the GPU kind's usual board)")
    p.add_argument("--nodes", type=int, default=None,
                   help="identical nodes (default: SLURM_JOB_NUM_NODES, else 1; under a launcher: "
                        "the launch's)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node (default: SLURM_GPUS_ON_NODE, else the visible GPUs; "
                        "CPU ranks on a machine without GPUs, default 2)")
    p.add_argument("--inter-node-GBps", type=float, default=None,
                   help="inter-node bandwidth per node when not measured (default 25: one "
                        "200 Gb/s link)")
    p.add_argument("--nic-GBps", type=float, default=None, help="one GPU's own inter-node link (rail)")
    p.add_argument("--name", default=None, help="the cluster's name in plans and reports")
    p.add_argument("--no-measure", action="store_true",
                   help="datasheet figures only for a known GPU (an unknown device and CPU ranks "
                        "are always measured)")
    p.add_argument("--full", action="store_true", help="longer measurements (default: a few seconds)")
    p.set_defaults(func=run)


def _positive(name: str, v):
    if v is not None and not v > 0:
        raise UserError(f"{name} must be positive, got {v}")
    return v


def _env_int(name: str):
    from ..env import env_int
    return env_int(name)


def layout(nodes=None, gpus_per_node=None, world=None) -> tuple[int, int | None]:
    """(nodes, devices per node) for a plan made on this machine: the options, then SLURM's
    allocation (``SLURM_JOB_NUM_NODES``, ``SLURM_GPUS_ON_NODE``), then ``world`` / nodes."""
    nodes = _positive("--nodes", nodes) or _env_int("SLURM_JOB_NUM_NODES") or 1
    per = _positive("--gpus-per-node", gpus_per_node) or _env_int("SLURM_GPUS_ON_NODE")
    if per is None and world:
        if world % nodes:
            raise UserError(f"{world} devices do not split over {nodes} nodes")
        per = world // nodes
    return nodes, per


def resolve(cluster, nodes=None, gpus_per_node=None, world=None, quiet: bool = False,
            folder: str | None = None, remeasure: bool = False):
    """``cluster`` as given, or for ``auto`` the ClusterSpec detected on this machine (known GPU
    kinds: datasheet figures; CPU ranks and unknown devices: measured), with its notes printed
    on stderr.  ``folder``: a run's output folder, where the measured figures are kept and
    reused on this machine (profile/persisted.py) unless ``remeasure``."""
    if cluster != AUTO:
        if nodes or gpus_per_node:
            raise UserError("--nodes / --gpus-per-node go with --cluster auto")
        return cluster
    from ..profile import persisted
    from ..profile.detect import detect_here, facts_here
    from ..spec import ClusterSpec, SpecError
    n, per = layout(nodes, gpus_per_node, world)
    try:
        mach = persisted.machine(facts_here(per, n))
        kept = None if persisted.remeasure(remeasure) else persisted.load(folder, mach)
        if kept is not None:
            fields, notes = persisted.reused(kept, folder)
        else:
            fields, _, notes, _ = detect_here(per, n, measure=False)
        spec = ClusterSpec.from_dict(fields, "--cluster auto")
    except (SpecError, ValueError) as e:
        raise UserError(f"--cluster auto: {e}") from None
    if kept is None:
        persisted.keep(folder, fields, mach, notes)
    if not quiet:
        for note in notes:
            print(f"ds-autoplan: cluster auto: {note}", file=sys.stderr)
    return spec



def _read(path: str, what: str) -> str:
    """A small text file the user names (nvidia-smi output): a regular file, UTF-8, one line
    of refusal otherwise."""
    import stat
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
            raise UserError(f"{what} {path}: not a regular file of nvidia-smi output (at most 1 MiB)")
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError:
        raise UserError(f"{what} {path}: not text (UTF-8)") from None
    except OSError as e:
        raise UserError(f"{what} {path}: {e.strerror}") from None


def _from_smi(args):
    from ..spec.devices import gpu_cluster, kind_of, parse_smi, parse_topo, same_devices, unknown_gpu
    smi = parse_smi(_read(args.from_smi, "--from-smi"), args.from_smi)
    dev = same_devices(smi, args.from_smi)
    kind = kind_of(dev.name, dev.memory_gib)
    if kind is None:
        raise unknown_gpu(dev, args.from_smi)
    link = None
    if args.topo:
        topo = parse_topo(_read(args.topo, "--topo"), args.topo)
        if topo.gpus != len(smi):
            raise UserError(f"--topo {args.topo} shows {topo.gpus} GPUs, --from-smi {args.from_smi} {len(smi)}")
        link = "nvlink" if topo.nvlink else "pcie"
    per = _positive("--gpus-per-node", args.gpus_per_node) or len(smi)
    if per > len(smi):
        raise UserError(f"--gpus-per-node {per}: {args.from_smi} lists {len(smi)} GPUs")
    nodes = _positive("--nodes", args.nodes) or _env_int("SLURM_JOB_NUM_NODES") or 1
    fields, figures, notes = gpu_cluster(dev, nodes, per, kind=kind, link=link,
                                         inter_node_GBps=args.inter_node_GBps, nic_GBps=args.nic_GBps,
                                         name=args.name)
    source = {"from_smi": os.path.abspath(args.from_smi), "topo": args.topo and os.path.abspath(args.topo),
              "link": link or "the kind's board", "devices": [str(d) for d in smi], "kind": kind}
    return fields, figures, notes, source


def _launched() -> bool:
    return int(os.environ.get("WORLD_SIZE") or 1) > 1


def _in_launch(args):
    """Under a launcher (torchrun, deepspeed, srun with WORLD_SIZE): every rank reports, the
    links among the node's ranks and between the nodes are measured; rank 0 reports."""
    import datetime

    import torch
    import torch.distributed as dist

    from ..runtime.nodes import detect, launch_facts, launch_nodes
    if args.nodes or args.gpus_per_node:
        raise UserError("under a launcher the launch gives the nodes and devices per node; drop "
                        "--nodes / --gpus-per-node")
    own = not dist.is_initialized()        # (a caller's group, e.g. main() called in a rank, is used)
    if own:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=300))
    try:
        fields, figures, notes, facts = detect(launch_facts(), launch_nodes(),
                                               quick=not args.full, measure_all=not args.no_measure,
                                               name=args.name)
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()
    if not args.no_measure and int(os.environ.get("RANK") or 0) == 0:
        add_cpu_adam(fields, figures, notes)        # the host's, on the rank that reports
    source = {"launch": f"{len(facts)} ranks", "hosts": sorted({f["host"] for f in facts})}
    return fields, figures, notes, source


def _here(args):
    from ..profile.detect import detect_here
    nodes, per = layout(args.nodes, args.gpus_per_node)
    fields, figures, notes, facts = detect_here(per, nodes, quick=not args.full,
                                                measure=not args.no_measure, name=args.name)
    if not args.no_measure:
        add_cpu_adam(fields, figures, notes)
    fields.update({k: v for k, v in (("inter_node_GBps", args.inter_node_GBps), ("nic_GBps", args.nic_GBps)) if v})
    return fields, figures, notes, {"machine": facts[0]["host"],
                                    "device": facts[0].get("device") or "CPU"}


def add_cpu_adam(fields: dict, figures: dict, notes: list) -> None:
    """DeepSpeedCPUAdam's rate per core (what offloading the optimizer steps at), measured
    here when DeepSpeed's CPU Adam op builds."""
    from ..profile.hardware import cpu_adam_rate
    try:
        rate = float(cpu_adam_rate(1 << 22, threads=fields.get("cpu_cores"), repeats=2)["per_core"])
    except Exception as e:         # no compiler, no DeepSpeed: offloading stays unplanned
        notes.append(f"DeepSpeedCPUAdam not measured ({type(e).__name__}: {str(e)[:120]})")
        return
    fields["cpu_adam_rate_per_core"] = round(rate, -3)
    figures["cpu_adam_rate_per_core"] = {"datasheet": None, "measured": round(rate, -3)}
    notes[:] = [n for n in notes if not n.startswith("host figures not known")]


def _table(fields: dict, figures: dict) -> list[str]:
    rows = [("figure", "datasheet", "measured", "planned with")]
    for k, v in figures.items():
        fmt = (lambda x: "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x))
        rows.append((k, fmt(v.get("datasheet")), fmt(v.get("measured")), fmt(fields.get(k))))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]


def run(args) -> int:
    from ..spec import ClusterSpec, SpecError
    if args.topo and not args.from_smi:
        raise UserError("--topo goes with --from-smi (on this machine the links are measured)")
    if args.out is not None:          # a wrong target is refused before anything is measured
        from ..outputs import resolve_file
        resolve_file(args.out, "--out", create_parent=False)
    try:
        fields, figures, notes, source = (_from_smi(args) if args.from_smi else
                                          _in_launch(args) if _launched() else _here(args))
        spec = ClusterSpec.from_dict(fields, "detected cluster")     # what --cluster will read
    except (SpecError, ValueError) as e:
        raise UserError(str(e)) from None
    if int(os.environ.get("RANK") or 0) != 0 and _launched():
        return 0
    print(f"{spec.name}: {spec.num_nodes} node{'s' if spec.num_nodes > 1 else ''} x "
          f"{spec.gpus_per_node} x {source.get('device') or source.get('kind') or spec.gpu or 'device'}"
          f" ({spec.memory_gb:g} GiB){', GPU kind ' + spec.gpu if spec.gpu else ''}")
    for line in _table(fields, figures):
        print("  " + line)
    for note in notes:
        print(f"  note: {note}")
    if args.out:
        import yaml

        from ..outputs import text, write_file
        doc = {"cluster": fields, "detected": {"source": source, "figures": figures, "notes": notes}}
        write_file(args.out, text("# ds-autoplan cluster: `--cluster " + args.out + "` plans for it; "
                                  "`detected` records where each figure came from\n"
                                  + yaml.safe_dump(doc, sort_keys=False)), what="--out")
        print(f"wrote {args.out}")
    return 0
