"""Cases in process groups of their own, all in one launch (tests): cases that kill, fail or
hang a rank, and cases on fewer ranks than the launch.

    python -m harness.forked JOB.json        # on every rank (ds_autoplan.runtime.launch.spawn)

``JOB``: ``{"warm": [module, ...], "forked": [case, ...], "then": CASES.json}``.  A rank
imports the ``warm`` modules and every forked case's function once, then runs each forked case
in a child process (``os.fork``): the children form a process group of their own (a file store
beside JOB), so a case may SIGKILL, fail or hang a rank without ending the launch, and the next
case does not pay the ranks' start-up (seconds of imports) again.

A case is ``{"name", "fn", ...}`` as for :func:`ds_autoplan.runtime.launch.launch`, with
optional ``"world"`` (its ranks: the launch's first ones, default all), ``"env"`` (set in the
child before ``fn`` runs) and ``"grace"`` (default 5 s).  As the launcher does for ranks: once
one rank's child has failed, every other rank's child still running gets ``grace`` seconds to
end by itself, then is killed.  The child prints ``fn``'s result with ``"forked": name``
added; its output goes to ``JOB.json.<i>.out<rank>`` and is then copied to the rank's; the
rank prints ``{"forked": name, "rank": r, "exit": status, "out": that file}`` (status -9:
SIGKILLed).

Then each rank writes ``JOB.json.done<rank>``, waits for the ``then`` file (the test may write
it from what the forked cases left) and runs those cases in the launch's own process group, as
``python -m ds_autoplan.runtime.launch CASES.json`` does, adding ``"then": name`` to each result.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import time
import traceback

from ds_autoplan.runtime import launch, reaper

# what the DeepSpeed and the Megatron-core runtimes' cases import (warm)
DEEPSPEED = ["deepspeed", "ds_autoplan.runtime.deepspeed.api", "torch._dynamo"]
MEGATRON = ["megatron.core.optimizer", "megatron.core.distributed", "ds_autoplan.runtime.megatron.checkpoint",
            "ds_autoplan.models.megatron_gpt"]
CHILD_TIMEOUT = 300.0     # a forked case's children end in seconds; past this they are killed


def exit_now(code: int) -> None:
    """End this rank now that its script is done (:func:`ds_autoplan.runtime.ending.leave`: the
    atexit handlers, e.g. the removal of the rank's /dev/shm file, multiprocessing's end of
    data-loader workers, then a flush and no interpreter teardown; that also skips the teardown
    of the imported module graph, about 1 s of CPU per rank and launch, measured).  While a
    non-daemon thread still runs, return instead."""
    from ds_autoplan.runtime.ending import leave
    leave(code)


def fork_wait(child, out: str, timeout: float, hurry=None, grace: float = 5.0) -> int:
    """Run ``child()`` in a forked process whose stdout and stderr go to ``out`` (appended: the
    children of several ranks may share it); its exit status (``child``'s return value, 1 if it
    raised; negative: the signal that ended it).  Past ``timeout`` seconds the child is killed;
    once ``hurry()`` is true it gets ``grace`` seconds more at most.  The child leads a process
    group of its own, killed whole once the child has ended: what it started and left running
    (a killed child's Manager server: Megatron's dist_checkpointing writer) ends with it.  Out
    of the caller's group it no longer gets the terminal's Ctrl-C: it dies with the caller
    instead (Linux's parent-death signal)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            reaper.die_with_parent()
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = child() or 0
        except BaseException:
            traceback.print_exc()
        launch._exit(code)
    try:
        os.setpgid(pid, pid)                # (both sides: whichever runs first)
    except OSError:
        pass
    deadline = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            reaper.sweep(pid)
            return os.waitstatus_to_exitcode(status)
        if hurry is not None and deadline > time.time() + grace and hurry():
            deadline = time.time() + grace
        if time.time() > deadline:
            reaper.sweep(pid)
        time.sleep(0.05)


def _child(case: dict, files: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    os.environ.update(case.get("env", {}))
    if "world" in case:          # a smaller world than the launch's: its ranks on one node
        os.environ.update(WORLD_SIZE=str(world), LOCAL_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{files}.store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=90))
    row = launch.import_fn(case["fn"])(case)
    print(launch.RESULT + json.dumps({**row, "forked": case["name"]}), flush=True)


def _peer_failed(files: str, rank: int, world: int) -> bool:
    for r in range(world):
        try:
            with open(f"{files}.exit{r}") as f:
                if r != rank and int(f.read()) != 0:
                    return True
        except (OSError, ValueError):      # not there yet, or being written
            pass
    return False


def _forked(case: dict, files: str, rank: int, world: int) -> int:
    """Run ``case`` in a child process; its exit status (negative: the signal that ended it)."""
    code = fork_wait(lambda: _child(case, files, rank, world), f"{files}.out{rank}", CHILD_TIMEOUT,
                     hurry=lambda: _peer_failed(files, rank, world), grace=case.get("grace", 5.0))
    with open(f"{files}.exit{rank}.tmp", "w") as f:
        f.write(str(code))
    os.replace(f"{files}.exit{rank}.tmp", f"{files}.exit{rank}")
    with open(f"{files}.out{rank}") as f:
        sys.stdout.write(f.read())
    return code


def run(folder, forked: list, then, warm=(), world: int = 2, env: dict | None = None,
        **kw) -> list[tuple[int, str]]:
    """Launcher side: :func:`~ds_autoplan.runtime.launch.spawn` a job of ``forked`` cases on
    ``world`` ranks (files in ``folder``); ``then``: the cases of the launch's own process group,
    or a function returning them once every forked case is over (it runs here, e.g. to copy and
    damage what they left).  Every rank's ``(returncode, output)``; ``env`` (beside
    :data:`harness.ENV`) and ``kw`` go to spawn."""
    import threading

    from harness import ENV
    job, then_path = os.path.join(folder, "job.json"), os.path.join(folder, "then.json")
    with open(job, "w") as f:
        json.dump({"warm": list(warm), "forked": forked, "then": then_path}, f)
    box: dict = {}
    ranks = threading.Thread(target=lambda: box.update(outs=launch.spawn(
        ["-m", __name__, job], world, env={**ENV, **(env or {})}, **kw)))
    ranks.start()
    cases: list = []
    try:
        while ranks.is_alive() and not all(os.path.exists(f"{job}.done{r}") for r in range(world)):
            time.sleep(0.1)
        if ranks.is_alive():
            cases = then() if callable(then) else then
    finally:                  # always written: the ranks wait for it ([] lets them end)
        with open(f"{then_path}.tmp", "w") as f:
            json.dump(cases, f)
        os.replace(f"{then_path}.tmp", then_path)
        ranks.join()
    return box["outs"]


def rows(outs) -> list[dict]:
    """Every ``AUTOPLAN_RESULT`` row of :func:`run`'s outputs (all ranks and cases)."""
    n = len(launch.RESULT)
    return [json.loads(ln[n:]) for _, out in outs for ln in out.splitlines() if ln.startswith(launch.RESULT)]


def main(job_path: str) -> None:
    import torch
    torch.set_num_threads(1)
    with open(job_path) as f:
        job = json.load(f)
    for mod in job.get("warm", []):
        importlib.import_module(mod)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for case in job["forked"]:
        launch.import_fn(case["fn"])
    for i, case in enumerate(job["forked"]):
        files = f"{job_path}.{i}"
        if rank < case.get("world", world):
            status = _forked(case, files, rank, case.get("world", world))
            print(launch.RESULT + json.dumps({"forked": case["name"], "rank": rank, "exit": status,
                                              "out": f"{files}.out{rank}"}), flush=True)
    with open(f"{job_path}.done{rank}", "w"):
        pass
    while not os.path.exists(job["then"]):
        time.sleep(0.05)
    with open(job["then"]) as f:
        cases = json.load(f)
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    launch.report_runs((lambda c=c: {**launch.import_fn(c["fn"])(c), "then": c.get("name")}) for c in cases)


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        launch._exit(1)
    launch._exit(0)
