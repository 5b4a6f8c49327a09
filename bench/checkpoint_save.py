"""What crash-safe checkpoints cost: one process saves the same tensors as
a new tag each round (a) as a plain ``torch.save`` per file into a new folder (what the
runtimes did before: no fsync, no manifest), (b) the same followed by an fsync of each file
(the least a durable save costs), (c) through ``save_atomically`` (staging folder, fsync and
sha256 of every file, ``manifest.json``, rename into place), in alternating rounds (the
previous round's folders removed untimed); then the full verification ``ds-autoplan checkpoint
info`` does (sha256 of every file).

    python bench/checkpoint_save.py [--quick] [--mib 256] [--files 4] [--json out.json]

Prints ``save_ratio`` (c / a) and ``durable_ratio`` (c / b), each paired per round, and
``verify_s_per_gib``.  What (c) adds to (b) is one sha256 pass over the files (the manifest),
the rename and the removal of the replaced copy; the goal ``bound_ratio`` = c / (b + one
verification) at most 1.2: nothing beyond that one extra pass.  On several ranks the hashing
is shared (each rank hashes every world-th file).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _measure import Report, figure, plan_iters, publish, ratio, timed  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 30 s on 2 cores)")
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from ds_autoplan.runtime.checkpoint_files import save_atomically, verify
    mib = 64 if args.quick else args.mib
    per = mib * 2 ** 20 // 4 // args.files
    tensors = {f"layer_{i:02d}.pt": torch.randn(per) for i in range(args.files)}

    def write(folder, sync=False):
        os.makedirs(folder, exist_ok=True)
        for name, t in tensors.items():
            with open(os.path.join(folder, name), "wb") as f:
                torch.save(t, f)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
    root = tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        iters = plan_iters(args.quick)
        plain, durable, safe, checks = [], [], [], []
        for i in range(iters):          # alternating: all see the same load
            dirs = [os.path.join(root, f"{kind}{i}") for kind in ("plain", "durable", "safe")]
            plain += timed(lambda: write(dirs[0]), 1, warmup=0)
            durable += timed(lambda: write(dirs[1], sync=True), 1, warmup=0)
            safe += timed(lambda: save_atomically(dirs[2], write), 1, warmup=0)
            checks += timed(lambda: verify(dirs[2]), 1, warmup=0)
            assert verify(dirs[2]) == []
            for d in dirs:
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rep = Report(iters)
    rep.add("plain_save_s", figure(plain))
    rep.add("durable_save_s", figure(durable))
    rep.add("atomic_save_s", figure(safe))
    rep.add("save_ratio", ratio(safe, plain, paired=True))
    rep.add("durable_ratio", ratio(safe, durable, paired=True))
    r = rep.add("bound_ratio", ratio(safe, [d + c for d, c in zip(durable, checks)], paired=True))
    rep.add("verify_s_per_gib", figure([c * 1024 / mib for c in checks]))
    return publish(rep.finish({"no_more_than_one_hash_pass_beyond_a_durable_save": r <= 1.2},
                              mib=mib, files=args.files), path=args.json)


if __name__ == "__main__":
    sys.exit(main())
