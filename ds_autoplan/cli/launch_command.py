"""``ds-autoplan launch [ds-autoplan options] -- torchrun [torchrun options] pretrain_gpt.py
[flags]``: plan ``--model`` for the command's ranks, run the command (Megatron-LM's patched
``pretrain_gpt.py``, or any script that reads ``DS_AUTOPLAN_PLAN``) with the plan named, and
with ``--calibrate N`` run it again under each switched plan (runtime/replan.py: every start
takes the parallel flags from the plan it runs, ``emit.megatron.with_plan_flags``).
"""
from __future__ import annotations

import os
import subprocess

from . import UserError

V_SCHEDULES_NEED = "--untie-embeddings-and-output-weights"


def torchrun_ranks(cmd: list[str]) -> tuple[int, list[str]]:
    """The ranks ``cmd`` (``torchrun ...`` or ``python -m torch.distributed.run ...``) starts
    on this node, and the script's arguments; one line where it cannot be counted."""
    if os.path.basename(cmd[0]) == "torchrun":
        rest = cmd[1:]
    elif len(cmd) > 2 and cmd[1:3] == ["-m", "torch.distributed.run"]:
        rest = cmd[3:]
    else:
        raise UserError(f"the command after -- is {cmd[0]!r}: give torchrun (or python -m "
                        "torch.distributed.run), whose ranks the plan is made for")
    from torch.distributed.run import get_args_parser
    try:
        a = get_args_parser().parse_args(rest)
    except SystemExit:
        raise UserError("could not parse the torchrun arguments after --") from None
    if str(a.nnodes) not in ("1", "1:1"):
        raise UserError(f"--nnodes {a.nnodes}: one torchrun command starts one node; plan several "
                        "with ds-autoplan plan --nodes N and run the plan on each (DS_AUTOPLAN_PLAN)")
    try:
        n = int(a.nproc_per_node)
    except ValueError:
        raise UserError(f"--nproc_per_node {a.nproc_per_node}: give the number of ranks") from None
    if n < 1:
        raise UserError(f"--nproc_per_node {n}: give at least 1")
    return n, list(a.training_script_args)


def _flag_value(args: list[str], flag: str):
    for i, tok in enumerate(args):
        if tok == flag and i + 1 < len(args):
            return args[i + 1]
        if tok.startswith(flag + "="):
            return tok.split("=", 1)[1]
    return None


def global_batch(own, script_args: list[str]) -> int:
    """``--global-batch`` or the script's ``--global-batch-size`` (refused when they differ)."""
    theirs = _flag_value(script_args, "--global-batch-size")
    if theirs is not None:
        try:
            theirs = int(theirs)
        except ValueError:
            raise UserError(f"--global-batch-size {theirs}: not an integer") from None
    if own.global_batch is not None and theirs is not None and own.global_batch != theirs:
        raise UserError(f"--global-batch {own.global_batch} and the script's --global-batch-size {theirs} "
                        "differ: give one")
    return own.global_batch or theirs or 8


def schedules_for(own_scheds, script_args: list[str]):
    """The candidate schedules: a V placement needs untied embeddings in Megatron-LM, so
    without the flag the V schedules are no candidates (a switch to one could not start)."""
    if V_SCHEDULES_NEED in script_args:
        return own_scheds
    from ..schedule.builders import builder_info, searched_by_default
    names = own_scheds if own_scheds is not None else searched_by_default()
    kept = [s for s in names if builder_info(s).placement != "v"]
    if not kept:
        raise UserError(f"the schedules {', '.join(names)} are V placements, which Megatron-LM runs "
                        f"only with {V_SCHEDULES_NEED}: add it to the script's flags")
    return kept


def planned_command(cmd: list[str], script_args: list[str], plan_path: str) -> list[str]:
    """``cmd`` with the script's parallel flags those of the plan ``plan_path`` holds now
    (``emit.megatron.with_plan_flags``), which are printed on one line."""
    from ..emit.megatron import plan_flags, with_plan_flags
    from ..plan import Plan
    plan = Plan.load(plan_path)
    print(f"ds-autoplan: the script runs with the plan's {' '.join(plan_flags(plan))}", flush=True)
    return cmd[:len(cmd) - len(script_args)] + with_plan_flags(script_args, plan)


def run_command(own, cmd: list[str], planner_options) -> int:
    """The launch of ``cmd`` (module docstring); ``own``: ds-autoplan's parsed options (its
    ``out`` already --out, else DS_AUTOPLAN_OUT, else the default), ``planner_options``:
    launch_cmd's checks of them (``(steps, rounds, schedules, offload)``)."""
    from ..outputs import check_folder, hold_for_launch, release_launch
    from ..runtime import replan
    from ..runtime.common.record import STEPS_ENV
    from .launch_plan import OUT_FILES, PLAN_ENV, _plan_model_now, replan_request
    if not cmd:
        raise UserError("give the command after --, e.g. -- torchrun --nproc_per_node 2 pretrain_gpt.py ...")
    if not own.model:
        raise UserError("-- COMMAND runs the plan made before launch: give --model (the model the script builds)")
    if own.profile:
        raise UserError("--profile is for a DeepSpeed script's PipelineModule; the command runs --model's plan")
    nproc, script_args = torchrun_ranks(cmd)
    steps, rounds, scheds, offload = planner_options
    gb = global_batch(own, script_args)
    scheds = schedules_for(scheds, script_args)
    out = own.out
    check_folder(out, OUT_FILES)
    out, created = hold_for_launch(out)
    # Megatron-LM's precision is the script's flag; the plan is costed for it
    precision = "bf16" if "--bf16" in script_args else "fp16" if "--fp16" in script_args else "fp32"
    opts = {"cluster": own.cluster or "auto", "global_batch": gb, "pp": own.pp, "tp": own.tp,
            "schedules": scheds, "offload": offload, "out": out, "precision": precision}
    try:
        plan_path = _plan_model_now(own.model, opts["cluster"], gb, own.pp, scheds,
                                    {"localhost": list(range(nproc))}, out, offload, own.tp,
                                    own.remeasure, switchable=steps is not None, precision=precision)
        env = dict(os.environ, **{PLAN_ENV: os.path.abspath(plan_path), "DS_AUTOPLAN_OUT": out})
        state = None
        if steps is not None:
            state = replan.start(out, steps, replan_request(own.model, opts), rounds)
            env.update({replan.ENV: state, STEPS_ENV: str(steps)})
    except BaseException:
        release_launch(out, remove=True, created=created)
        raise
    try:
        rc = replan.launch_loop(state, lambda: subprocess.call(planned_command(cmd, script_args, plan_path),
                                                               env=env))
        if rc:
            raise UserError(f"{os.path.basename(cmd[0])} exited with status {rc}")
    finally:
        release_launch(out)
    return 0
