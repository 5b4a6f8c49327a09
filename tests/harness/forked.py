"""Cases that SIGKILL a rank, all in one launch (tests).

    python -m harness.forked JOB.json        # on every rank (ds_autoplan.runtime.launch.spawn)

``JOB``: ``{"warm": [module, ...], "kills": [case, ...], "then": CASES.json}``.  A rank imports
the ``warm`` modules and every kill case's function once, then runs each kill case in a forked
child process: the children of all ranks form a process group of their own (a file store
beside the case's ``dir``), so a case may SIGKILL a rank (``DS_AUTOPLAN_CHECKPOINT_FAULT``)
without ending the launch, and the next case does not pay the ranks' start-up (seconds of
imports) again.  A case is ``{"name", "fn", ...}`` as for :func:`ds_autoplan.runtime.launch.launch`;
the child prints ``fn``'s result with ``"kill": name`` added, and the rank then prints the
child's exit status, ``{"kill": name, "rank": r, "exit": status, "seconds": s}`` (-9:
SIGKILLed).

Then each rank writes ``JOB.json.done<rank>``, waits for the ``then`` file (the test writes it
from what the kills left) and runs those cases in the launch's own process group, as
``python -m ds_autoplan.runtime.launch CASES.json`` does.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import signal
import sys
import time
import traceback

from ds_autoplan.runtime import launch

CHILD_TIMEOUT = 240.0     # a kill case's children end in seconds; past this they are killed


def _child(case: dict, rank: int, world: int) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{case['dir']}.store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=90))
    row = launch.import_fn(case["fn"])(case)
    print(launch.RESULT + json.dumps({**row, "kill": case["name"]}), flush=True)


def _forked(case: dict, rank: int, world: int) -> int:
    """Run ``case`` in a child process; its exit status (negative: the signal that ended it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(case, rank, world)
        except BaseException:
            traceback.print_exc()
            code = 1
        launch._exit(code)
    deadline = time.time() + CHILD_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def main(job_path: str) -> None:
    import torch
    torch.set_num_threads(1)
    with open(job_path) as f:
        job = json.load(f)
    for mod in job.get("warm", []):
        importlib.import_module(mod)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for case in job["kills"]:
        launch.import_fn(case["fn"])
    for case in job["kills"]:
        start = time.time()
        status = _forked(case, rank, world)
        print(launch.RESULT + json.dumps({"kill": case["name"], "rank": rank, "exit": status,
                                          "seconds": round(time.time() - start, 2)}), flush=True)
    with open(f"{job_path}.done{rank}", "w"):
        pass
    _wait_for(job["then"])
    launch._worker(job["then"])


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        launch._exit(1)
    launch._exit(0)
