"""Sustained over burst bf16 GEMM rate on one CUDA GPU (the factor data/gpus.yaml applies to
the burst layer-GEMM medians of bench/gpu_kernels.py).

    python bench/gpu_sustained.py OUT.json [--seconds 100]

For each shape (the 8192^3 GEMM and a Megatron FC1 GEMM, h 8192 -> 4h, 8192 tokens): the burst
rate (median of 20 timed repeats after warm-up, as gpu_kernels.py times) and then the rate of
back-to-back repeats over ``--seconds`` of continuous load, in one-second windows (CUDA events);
sustained = the median of the last half of the windows.  Inputs rotate among three random
sets (never zeros).  nvidia-smi's clocks, power and temperature are read at the start and the
end when it is on PATH.  Plain torch, no ds_autoplan import: runs on the device image.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time


def smi() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    q = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip() or r.stderr.strip()


def main(out: str, seconds: float) -> None:
    import torch
    dev, dt = torch.device("cuda"), torch.bfloat16
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": time.strftime("%Y-%m-%d"), "method": __doc__, "seconds": seconds,
           "smi_start": smi(), "shapes": []}
    for name, (M, K, N) in (("8192^3", (8192, 8192, 8192)), ("fc1 h8192 tokens8192", (8192, 8192, 32768))):
        A = [torch.randn(M, K, device=dev, dtype=dt) for _ in range(3)]
        B = [torch.randn(K, N, device=dev, dtype=dt) for _ in range(3)]
        fl = 2.0 * M * N * K
        for i in range(10):
            A[i % 3] @ B[i % 3]
        torch.cuda.synchronize()
        burst = []
        for i in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            A[i % 3] @ B[i % 3]
            b.record()
            torch.cuda.synchronize()
            burst.append(fl / (a.elapsed_time(b) / 1e3) / 1e12)
        windows, t_end, i = [], time.time() + seconds, 0
        while time.time() < t_end:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 0
            a.record()
            t0 = time.time()
            while time.time() - t0 < 1.0:
                for _ in range(20):
                    A[i % 3] @ B[i % 3]
                    i += 1
                    n += 1
                torch.cuda.synchronize()
            b.record()
            torch.cuda.synchronize()
            windows.append(n * fl / (a.elapsed_time(b) / 1e3) / 1e12)
        half = windows[len(windows) // 2:]
        row = {"shape": name, "M": M, "K": K, "N": N, "burst_tflops": statistics.median(burst),
               "window_tflops": [round(w, 1) for w in windows], "sustained_tflops": statistics.median(half)}
        row["sustained_over_burst"] = row["sustained_tflops"] / row["burst_tflops"]
        res["shapes"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "window_tflops"}), flush=True)
    res["smi_end"] = smi()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(res["smi_start"], "|", res["smi_end"])


if __name__ == "__main__":
    args = sys.argv[1:]
    secs = float(args[args.index("--seconds") + 1]) if "--seconds" in args else 100.0
    main(args[0], secs)
