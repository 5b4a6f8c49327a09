"""The host optimizer step of an offloaded plan, predicted and measured here (issue 26 item 6).

The cost model prices ZeRO-Offload's step at ``parameters / (cores x cpu_adam_rate_per_core)``,
capped by the node's DRAM bandwidth (cost/offload.py HostRates).  This bench takes the rate per
core of the ``cpu-1`` preset (the figure written into the presets), predicts the step of
DeepSpeed's ``DeepSpeedCPUAdam`` over 10^7 .. 10^8 fp32 parameters with fp32 gradients and
moments (one rank's offloaded partition) on 1 and on every core of this machine, measures it
(``profile.hardware.cpu_adam_rate``: median of 5 steps after a warm-up) and prints
measured / predicted per size, then one JSON line.  torch's fused AdamW on the host (Megatron's
HybridDeviceOptimizer) is measured beside it against ``TORCH_CPU_ADAM_SPEED``.

    python bench/offload_cpu.py [--quick]

Where a GPU is lent, ``--gpu`` also measures the pinned host<->device copy rate
(profile.hardware.host_link_GBps) against the preset's ``host_link_GBps``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10^7 and 3 x 10^7 parameters only")
    ap.add_argument("--gpu", action="store_true", help="also the host-device copy rate (CUDA)")
    ap.add_argument("--cluster", default="cpu-1", help="preset whose rate per core predicts")
    a = ap.parse_args(argv)
    from ds_autoplan.cost.offload import TORCH_CPU_ADAM_SPEED, HostRates
    from ds_autoplan.profile.hardware import cpu_adam_rate, host_link_GBps
    from ds_autoplan.spec.cluster import load_cluster
    base = load_cluster(a.cluster)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    sizes = [10 ** 7, 3 * 10 ** 7] + ([] if a.quick else [10 ** 8])
    rows = []
    for threads in sorted({1, cores}):
        cl = load_cluster({**base.__dict__, "cpu_cores": threads, "gpus_per_node": 1})
        rate = HostRates.of(cl).cpu                 # parameters per second of one rank's step
        for n in sizes:
            for opt, speed in (("deepspeed", 1.0), ("torch", TORCH_CPU_ADAM_SPEED)):
                m = cpu_adam_rate(n, threads=threads, optimizer=opt, repeats=5)
                pred = n / (rate * speed)
                rows.append({"optimizer": opt, "threads": threads, "params": n,
                             "predicted_s": round(pred, 4), "measured_s": round(m["step_s"], 4),
                             "measured_over_predicted": round(m["step_s"] / pred, 3)})
                print(f"{opt:9} {threads} threads {n:>11,} params: predicted {pred:.3f} s, "
                      f"measured {m['step_s']:.3f} s ({m['step_s'] / pred:.2f}x)", flush=True)
    out = {"bench": "offload_cpu", "cluster": a.cluster, "rate_per_core": base.cpu_adam_rate_per_core,
           "rows": rows}
    if a.gpu:
        import torch
        if not torch.cuda.is_available():
            print("--gpu: no CUDA device here", file=sys.stderr)
            return 2
        link = host_link_GBps("cuda", 1 << 28, repeats=10)
        out["host_link"] = {**link, "preset_GBps": base.host_link_GBps}
        print(f"host link: D2H {link['d2h_GBps']:.1f} GB/s, H2D {link['h2d_GBps']:.1f} GB/s "
              f"(preset {base.host_link_GBps} GB/s)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
