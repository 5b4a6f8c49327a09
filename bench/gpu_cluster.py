"""What ``ds-autoplan cluster`` detects on a lent GPU machine, beside the built-in preset of the
same GPU kind (issue 27; needs CUDA GPUs, refuses with exit status 2 elsewhere).

    python bench/gpu_cluster.py [--full] [--out bench/data/gpu_cluster_<kind>.json]

Runs the detection ``ds-autoplan cluster`` runs on this machine (every visible GPU; measured:
the bf16 matmul rate, a device-to-device copy, the host <-> device copy and, with two or more
GPUs, an all-reduce among them in nccl-tests' bus-bandwidth convention) and writes, per figure,
the datasheet value of the kind (data/gpus.yaml), the measured one, their ratio and the preset's
(configs/clusters: the first preset naming the kind).  One JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _preset_of(kind: str) -> tuple[str | None, dict]:
    from ds_autoplan.spec.presets import preset_names, resolve
    for name in preset_names("clusters"):
        d, _ = resolve(name, "clusters")
        if d.get("gpu") == kind:
            return name, d
    return None, {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="longer measurements")
    p.add_argument("--out", default=None, help="default bench/data/gpu_cluster_<kind>.json")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_cluster.py: needs a CUDA GPU (torch.cuda.is_available() is False here); it "
              "compares what `ds-autoplan cluster` detects on a GPU machine with the preset of "
              "its kind. On a CPU machine run `ds-autoplan cluster` itself.", file=sys.stderr)
        return 2
    from ds_autoplan.cli.cluster_cmd import add_cpu_adam
    from ds_autoplan.profile.detect import detect_here
    t0 = time.time()
    fields, figures, notes, facts = detect_here(quick=not args.full, measure=True)
    add_cpu_adam(fields, figures, notes)
    kind = fields.get("gpu")
    preset_name, preset = _preset_of(kind) if kind else (None, {})
    rows = {}
    for k, v in figures.items():
        ds, me = v.get("datasheet"), v.get("measured")
        rows[k] = {"datasheet": ds, "measured": me, "preset": preset.get(k),
                   "measured_over_datasheet": round(me / ds, 4) if ds and me else None,
                   "measured_over_preset": round(me / preset[k], 4) if me and preset.get(k) else None}
        print(f"{k:24s} datasheet {ds!s:>10} measured {me!s:>10} preset {preset.get(k)!s:>10}")
    res = {"device": facts[0]["device"], "kind": kind, "gpus": fields["gpus_per_node"],
           "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
           "seconds": round(time.time() - t0, 1), "preset": preset_name, "cluster": fields,
           "figures": rows, "notes": notes, "method": __doc__}
    out = args.out or os.path.join(ROOT, "bench", "data", f"gpu_cluster_{kind or 'unknown'}.json")
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({"kind": kind, "preset": preset_name, "out": out,
                      **{k: r["measured_over_datasheet"] for k, r in rows.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
