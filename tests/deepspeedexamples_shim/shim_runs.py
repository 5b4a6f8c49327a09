"""Test-side: the unchanged ``train.py`` of the working folder run several times, one after the
other, in the ranks of one launch (``deepspeed --num_gpus N shim_runs.py``, ``SHIM_RUNS`` a JSON
list of the script's argument lists): reference runs in DeepSpeed's own engines share one
launcher and one start-up of the ranks.  Each run is ``python train.py [--local_rank=N] ARGS``
as the launcher would start it, with the script's own seeding; the previous run's objects are
collected first; after the last the rank ends (ds_autoplan.runtime.ending.finish)."""
import gc
import json
import os
import runpy
import sys

from ds_autoplan.runtime.ending import finish


def main() -> None:
    inserted = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    script = os.path.abspath("train.py")
    sys.path.insert(0, os.path.dirname(script))       # as `python train.py` (its alexnet.py)
    for argv in json.loads(os.environ["SHIM_RUNS"]):
        sys.argv = [script, *inserted, *argv]
        runpy.run_path(script, run_name="__main__")
        gc.collect()
    finish(0)


if __name__ == "__main__":
    main()
