"""Every rank of ``deepspeed --autoplan`` / ``ds-autoplan launch``::

    python -m ds_autoplan.clients.bootstrap [--local_rank=N] --ds-autoplan=B64JSON train.py ARGS

installs the ``deepspeed.initialize`` hook (:mod:`.deepspeed_hook`) with the launcher's options
(urlsafe base64 of JSON: plan, cluster, global_batch, pp, schedules, out, module), then runs the unchanged
script as ``python train.py [--local_rank=N] ARGS`` would (``-m`` for a module).  A refusal
is one line on rank 0 and exit status 2."""
from __future__ import annotations

import base64
import json
import os
import runpy
import sys

FLAG = "--ds-autoplan="


def split_argv(argv: list[str]) -> tuple[dict, list[str], list[str]]:
    """(options, launcher-inserted args, script argv) from the bootstrap's own argv."""
    opts, inserted = None, []
    rest = list(argv)
    while rest and (rest[0].startswith(FLAG) or rest[0].startswith("--local_rank=")):
        tok = rest.pop(0)
        if tok.startswith(FLAG):
            opts = json.loads(base64.urlsafe_b64decode(tok[len(FLAG):]))
        else:
            inserted.append(tok)
    if opts is None or not rest:
        raise SystemExit("usage: python -m ds_autoplan.clients.bootstrap [--local_rank=N] "
                         f"{FLAG}JSON SCRIPT [ARGS]")
    return opts, inserted, [rest[0], *inserted, *rest[1:]]


def main(argv: list[str] | None = None) -> int:
    from ..runtime.reaper import die_with_me
    die_with_me(parent=os.getppid())   # first: nothing this rank starts outlives it, nor it its launcher
    from ..runtime.ending import one_line_errors
    from .deepspeed_hook import install
    opts, _, script_argv = split_argv(sys.argv[1:] if argv is None else argv)
    if opts.get("out"):         # where this rank's run records itself (runtime/common/record.py)
        os.environ["DS_AUTOPLAN_OUT"] = opts["out"]
    if opts.get("replan"):      # launch --calibrate N: measure N steps, then decide (runtime/replan.py)
        from ..runtime.replan import ENV
        os.environ[ENV] = opts["replan"]["state"]
        os.environ["DS_AUTOPLAN_MEASURE_STEPS"] = str(opts["replan"]["steps"])
    install(opts)
    from ..runtime.deepspeed.shm import unlink_at_exit
    unlink_at_exit()        # DeepSpeed's CPU allreduce op leaves its shared-memory file otherwise
    sys.argv = script_argv
    from ..runtime.replan import Restart
    try:
        with one_line_errors("ds-autoplan"):         # a refusal: one line, exit status 2
            if opts.get("module"):
                runpy.run_module(script_argv[0], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(script_argv[0]))
                runpy.run_path(script_argv[0], run_name="__main__")
    except Restart:         # the ranks stop to switch plans; the launcher starts them again
        pass
    # the script's process group torn down once every rank has finished the script, and the
    # rank left without the interpreter's finalization, where a gloo thread of a group the
    # script's libraries still hold can abort the process (runtime/ending.py)
    from ..runtime.ending import finish
    finish(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
