"""`ds-autoplan launch [planner options] [deepspeed launcher options] train.py [args]`: run
DeepSpeed's own launcher with every rank going through ``ds_autoplan.clients.bootstrap``,
which plans the model the unchanged script builds when it calls ``deepspeed.initialize``
(docs/runtimes.md §1.8) and merges the plan into the script's own DeepSpeed config.  With
``--model`` (a preset, YAML or HF config.json) the plan is made here, before launch, and
``DS_AUTOPLAN_PLAN`` points every rank to it.  ``deepspeed --autoplan`` (after ``ds-autoplan
patch deepspeed``) calls :func:`apply_autoplan`.  ``ds-autoplan launch --model M ... -- torchrun
... pretrain_gpt.py ...`` runs a torchrun command with the plan instead (cli/launch_command.py).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import sys

from ..emit.deepspeed import MERGED_CONFIG   # the script's ds_config.json is never written
from . import UserError, doc_description
from .launch_plan import OUT_FILES, PLAN_ENV, _plan_model_now, replan_request  # noqa: F401 (their home)

BOOTSTRAP = "ds_autoplan.clients.bootstrap"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE = 40.0     # DeepSpeed's per-node launcher gives its ranks 30 s after SIGTERM


def stop_launch_on_signals(prog: str) -> dict:
    """Make SIGINT (Ctrl-C), SIGTERM and SIGHUP to this launcher process stop the whole launch;
    returns the handlers it replaced.  DeepSpeed's runner handles no signal on a local launch:
    its per-node launcher (``deepspeed.launcher.launch``) was reparented to PID 1 and kept the
    ranks training.  Here the signal is passed on to this process's children (the per-node
    launcher stops its ranks on it), every descendant gets :data:`STOP_GRACE` seconds to end,
    what is left is killed (at once on a second signal), and the launcher exits 128 + the
    signal's number after one line (``SystemExit``: ``finally`` blocks run).  A signal this
    process ignores (``nohup``'s SIGHUP, SIGINT in a background job) stays ignored."""
    import psutil
    stopping = []

    def kill(procs) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=5)

    def handler(signum, frame):
        me = psutil.Process()
        procs = me.children(recursive=True)
        if stopping:                        # a second signal while the first one waits
            kill(procs)
            return
        stopping.append(signum)
        for child in me.children():
            with contextlib.suppress(psutil.Error):
                child.send_signal(signum)
        _, alive = psutil.wait_procs(procs, timeout=STOP_GRACE)
        kill(alive)
        print(f"{prog}: interrupted ({signal.Signals(signum).name}): stopped the launch "
              f"({len(procs)} processes)", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS
            if signal.getsignal(s) is not signal.SIG_IGN}


@contextlib.contextmanager
def launch_stops_on_signals(prog: str):
    """:func:`stop_launch_on_signals` while the block runs (the caller's handlers after it)."""
    old = stop_launch_on_signals(prog)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _planner_options(env) -> dict:
    """Planner options from the environment (``deepspeed --autoplan`` has no flags of ours),
    each variable checked by :mod:`ds_autoplan.env` (a bad value is named in one line)."""
    from ..env import env_int, env_list, env_str
    return {"model": env_str("DS_AUTOPLAN_MODEL", env=env),
            "cluster": env_str("DS_AUTOPLAN_CLUSTER", env=env),
            "global_batch": env_int("DS_AUTOPLAN_GLOBAL_BATCH", env=env),
            "out": env_str("DS_AUTOPLAN_OUT", "ds_autoplan_out", env=env),
            "pp": env_int("DS_AUTOPLAN_PP", env=env),
            "tp": env_int("DS_AUTOPLAN_TP", env=env),
            "schedules": _known_schedules(env_list("DS_AUTOPLAN_SCHEDULES", env=env),
                                          "DS_AUTOPLAN_SCHEDULES"),
            "offload": _known_offload(env_str("DS_AUTOPLAN_OFFLOAD", env=env), "DS_AUTOPLAN_OFFLOAD"),
            "profile": env_str("DS_AUTOPLAN_PROFILE", env=env)}


def _known_offload(text, where: str):
    """An offload restriction in spec.parallel.Offload's text form (None: the planner's
    choice), refused in one line when malformed."""
    if text is None:
        return None
    from ..spec import SpecError
    from ..spec.parallel import Offload
    try:
        return Offload.parse(text).text()
    except SpecError as e:
        raise UserError(f"{where}: {e}") from None


def _known_schedules(scheds, where: str):
    """``scheds`` (None: the planner's default), refused in one line naming the registered
    builders when one is unknown (the builder registry answers)."""
    from ..schedule.builders import check_names
    try:
        return check_names(scheds)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def apply_autoplan(args, resources: dict, env, model=None, cluster=None, global_batch=None,
                   out=None, pp=None, schedules=None, via: str = "env", offload=None, tp=None,
                   remeasure: bool = False, profile=None, switchable: bool = False) -> dict:
    """Rewrite the parsed launcher ``args`` so every rank runs the script through the
    bootstrap with the planner options (``--ds-autoplan=`` base64 JSON, shell-safe for
    multi-node launchers); with a ``model`` description, plan it now.  ``via``: how the user
    gave the options ("env": ``deepspeed --autoplan`` with DS_AUTOPLAN_* variables, "launch":
    ``ds-autoplan launch`` flags), so refusals name the restriction in that form.  ``resources``:
    the launch's ``{host: slots}`` (:func:`launch_resources`); ``switchable``: plan what
    ``--calibrate`` can switch from (runtime/replan.py).  Returns the options."""
    o = _planner_options(env)
    if getattr(args, "no_python", False):
        raise UserError("--autoplan runs the script in Python ranks; drop --no_python")
    from ..outputs import check_folder, hold_for_launch, release_launch
    out = out if out is not None else o["out"]
    check_folder(out, OUT_FILES)         # refused before planning
    # this launch's folder while it runs: a second launch into it is refused by name
    out, created = hold_for_launch(out)
    profile = profile or o["profile"]
    opts = {"cluster": cluster or o["cluster"], "global_batch": global_batch or o["global_batch"],
            "pp": pp or o["pp"], "tp": tp or o["tp"], "schedules": schedules or o["schedules"], "out": out,
            "offload": offload or o["offload"], "module": bool(args.module), "via": via,
            "remeasure": bool(remeasure), "profile": os.path.abspath(profile) if profile else None}
    model = model or o["model"]
    try:
        if not model and env.get(PLAN_ENV):
            _check_given_plan(env[PLAN_ENV], sum(len(v) for v in resources.values()))
        if model:
            opts["plan"] = env[PLAN_ENV] = _plan_model_now(
                model, opts["cluster"] or "auto", opts["global_batch"] or 8, opts["pp"],
                opts["schedules"], resources, out, opts["offload"], opts["tp"], remeasure, switchable)
    except BaseException:
        release_launch(out, remove=True, created=created)   # nothing of it stays: the lock, a folder it made
        raise
    args.user_args = [_blob(opts), args.user_script, *args.user_args]
    args.user_script, args.module = BOOTSTRAP, True
    return opts


def _blob(opts: dict) -> str:
    """The bootstrap's argument carrying the options (urlsafe base64 JSON: shell-safe)."""
    return "--ds-autoplan=" + base64.urlsafe_b64encode(json.dumps(opts).encode()).decode()


def _calibrating(a, own, opts, steps, rounds) -> str | None:
    """``--calibrate N``: the re-plan state (runtime/replan.py) for the plan made before launch,
    its path handed to every rank in the bootstrap's options; None without it."""
    if own.calibrate is None:
        return None
    from ..runtime import replan
    state = replan.start(opts["out"], steps, replan_request(own.model, opts), rounds)
    opts["replan"] = {"state": state, "steps": steps}
    a.user_args[0] = _blob(opts)
    return state


def _check_given_plan(path: str, world: int) -> None:
    """The plan ``DS_AUTOPLAN_PLAN`` names, read and checked against the launch's ranks before
    any rank starts (a missing or broken file, or a plan for another world size, used to be
    found by each rank after DeepSpeed's launcher had started them)."""
    from ..errors import PlanError
    from ..plan import Plan
    try:
        plan = Plan.load(path)
    except PlanError as e:
        raise UserError(f"{e} (named by {PLAN_ENV})") from None
    if plan.world != world:
        raise UserError(f"the plan {path} ({PLAN_ENV}) uses {plan.world} ranks (cluster {plan.cluster}) "
                        f"but the launch has {world}: plan it for this launch, or launch {plan.world} ranks")


def autoplan_in_runner(args, world: int, env) -> dict:
    """:func:`apply_autoplan` for ``deepspeed --autoplan`` (called by the patched DeepSpeed
    launcher once it knows the launch's ``world``, which :func:`launch_resources` counts again
    with the nodes): a refusal is one ``ds-autoplan: error:`` line and exit 2, not a traceback.
    From here on, a signal to the runner stops the launch (:func:`stop_launch_on_signals`)."""
    stop_launch_on_signals("ds-autoplan")
    try:
        if env.get("DS_AUTOPLAN_CALIBRATE"):
            sys.exit(_calibrate_in_runner(env))
        check_launch(args)
        return apply_autoplan(args, launch_resources(args), env)
    except UserError as e:
        print(f"ds-autoplan: error: {e}", file=sys.stderr)
        sys.exit(2)


def _calibrate_in_runner(env) -> int:
    """``deepspeed --autoplan`` with ``DS_AUTOPLAN_CALIBRATE=N`` (and ``DS_AUTOPLAN_CALIBRATE_ROUNDS=K``):
    DeepSpeed's runner starts the ranks once, and a switch restarts them, so the launch is
    ``ds-autoplan launch --calibrate N``'s (its restart loop), run from here on the runner's own
    arguments (``--autoplan`` taken out) with the same ``DS_AUTOPLAN_*`` planner variables."""
    from ..env import env_str
    if not env_str("DS_AUTOPLAN_MODEL", env=env):
        raise UserError("DS_AUTOPLAN_CALIBRATE re-plans the plan made before launch: set DS_AUTOPLAN_MODEL "
                        "(the model description the script builds)")
    own = ["--calibrate", env_str("DS_AUTOPLAN_CALIBRATE", env=env)]
    for var, flag in (("DS_AUTOPLAN_CALIBRATE_ROUNDS", "--calibrate-rounds"), ("DS_AUTOPLAN_MODEL", "--model")):
        if env_str(var, env=env):
            own += [flag, env_str(var, env=env)]
    return _run(argparse.Namespace(argv=own + [a for a in sys.argv[1:] if a != "--autoplan"]))


def check_launch(a) -> None:
    """Refuse, before any rank starts, what DeepSpeed's launcher would run wrongly: no devices
    (``--num_gpus 0`` / ``--num_nodes 0``: it ran one rank), and a local launch whose master
    port is taken (another launch on this node: its rank 0 could not listen there and the
    other ranks would join the other launch's rendezvous)."""
    import errno
    import socket

    from deepspeed.launcher import runner
    for flag, v in (("--num_gpus", a.num_gpus), ("--num_nodes", a.num_nodes)):
        if v == 0 or v < -1:
            raise UserError(f"{flag} {v}: give at least 1 (or leave it out: all)")
    if runner.fetch_hostfile(a.hostfile):          # nodes of a hostfile: the master is elsewhere
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as torch's TCPStore
        try:
            s.bind(("", a.master_port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise UserError(f"port {a.master_port} (--master_port) is in use on this node (another "
                            "launch?): pass --master_port with a free port") from None


def launch_resources(a) -> dict:
    """``{host: [slots]}`` DeepSpeed's launcher will start for parsed launcher args ``a`` (its
    own resource functions: hostfile, include/exclude, num_nodes/num_gpus).  Nodes with
    different slot counts are refused naming the odd one: the plan's nodes are identical."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner
    pool = runner.fetch_hostfile(a.hostfile) or {"localhost": get_accelerator().device_count()}
    active = runner.parse_inclusion_exclusion(pool, a.include, a.exclude)
    active = dict(runner.apply_num_nodes_and_gpus(active, a.num_nodes, a.num_gpus))
    counts = [len(v) for v in active.values()]
    if len(set(counts)) > 1:
        common = max(set(counts), key=counts.count)
        odd = next(h for h, v in active.items() if len(v) != common)
        raise UserError(f"node {odd} has {len(active[odd])} slots, the other nodes {common}: "
                        "ds_autoplan plans identical nodes; give every node the same slots "
                        f"(hostfile, --include/--exclude) or leave {odd} out (--exclude {odd})")
    return active


def _own_parser():
    p = argparse.ArgumentParser(
        prog="ds-autoplan launch", add_help=False,
        usage="ds-autoplan launch [ds-autoplan options] [deepspeed launcher options] "
              "train.py [script args]\n       ds-autoplan launch --model M [ds-autoplan options] -- "
              "torchrun [torchrun options] pretrain_gpt.py [flags]",
        description="Plan the model the unchanged script builds and run DeepSpeed's own launcher "
                    "with the plan merged into the script's DeepSpeed config (docs/runtimes.md "
                    "§1.8). ds-autoplan's options come first, then DeepSpeed's, then the script.")
    p.add_argument("--model", default=None,
                   help="plan this model description (preset, YAML, HF config.json) before launch; "
                        "default: the model the script builds, profiled at deepspeed.initialize")
    p.add_argument("--cluster", default=None,
                   help="cluster preset or file (default auto: the launch's nodes and ranks per "
                        "node, the devices detected)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="default: the script's DeepSpeed config (train_batch_size)")
    p.add_argument("--pp", type=int, default=None, help="restrict the search to this pipeline degree")
    p.add_argument("--tp", type=int, default=None,
                   help="restrict the search to this tensor degree (a module DeepSpeed's engine "
                        "runs: AutoTP, docs/huggingface.md)")
    p.add_argument("--schedules", default=None, help="comma-separated candidate schedules")
    p.add_argument("--offload", default=None,
                   help="what the plan offloads: none, opt, opt:FRACTION, opt+param (docs/offload.md); "
                        "default: the planner's choice")
    p.add_argument("--out", default=None,
                   help=f"folder for plan.json, {MERGED_CONFIG} (the script's config merged with "
                        "the plan) and profile.json (default ds_autoplan_out); the run's record "
                        "(measured.json) and the detected cluster (cluster.detected.yaml) go there "
                        "too; nothing else in it is touched")
    p.add_argument("--profile", default=None,
                   help="the script's PipelineModule layers as this profile.json (one an earlier launch "
                        "wrote) measured them, instead of profiling them again")
    p.add_argument("--remeasure", action="store_true",
                   help="--cluster auto: measure the machine again (default: the figures a launch "
                        "from this folder measured on this machine, cluster.detected.yaml)")
    p.add_argument("--calibrate", default=None, metavar="N",
                   help="measure the plan's first N steps, calibrate the cluster from them, re-plan, and "
                        "switch (through a checkpoint and a restart of the ranks) when the re-plan is "
                        "predicted faster beyond the calibration's band; the faster of the two, as "
                        "measured, is kept (with --model; docs/calibration.md)")
    p.add_argument("--calibrate-rounds", default=None, metavar="K",
                   help="--calibrate: up to K switches (default 1); a kept switch re-plans again at once, "
                        "calibrated on every plan measured so far")
    p.add_argument("-h", "--help", action="store_true", help="show this help (both parts) and exit")
    return p


def add_parser(subparsers):
    # every argument is passed through untouched ("+" is no option prefix for deepspeed or us):
    # ours (--model, --cluster, --global-batch, --pp, --tp, --schedules, --offload, --out, --profile, --remeasure,
    # --calibrate, --calibrate-rounds) are taken from the part before the script
    p = subparsers.add_parser("launch", prefix_chars="+", add_help=False,
                              help="run the deepspeed launcher with the script's model planned "
                                   "(options: --model --cluster --global-batch --pp --tp --schedules "
                                   "--offload --out --profile --remeasure --calibrate --calibrate-rounds, "
                                   "then deepspeed launcher options, script, script args)",
                              description=doc_description(__doc__))
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def print_help() -> None:
    """ds-autoplan's options, then DeepSpeed's launcher's (its own parser's help)."""
    import contextlib
    import io
    from deepspeed.launcher import runner
    print(_own_parser().format_help())
    ds = io.StringIO()
    with contextlib.redirect_stdout(ds):
        try:
            runner.parse_args(["--help"])
        except SystemExit:
            pass
    text = ds.getvalue()
    # its usage names the running program; the options are the part to read
    print("deepspeed launcher options (DeepSpeed's own help):")
    print(text[text.find("\n\n") + 2:] if "\n\n" in text else text, end="")


def run(args) -> int:
    with launch_stops_on_signals("ds-autoplan launch"):
        return _run(args)


def _run(args) -> int:
    from deepspeed.launcher import runner

    from ..outputs import release_launch
    from ..runtime.checkpoint_files import fault_settings
    argv = list(args.argv)
    command = None
    if "--" in argv:            # -- torchrun ...: a command run as given (cli/launch_command.py)
        argv, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    # the script is the first token runner.parse_args leaves as user_script; split there
    own, rest = _own_parser().parse_known_args(
        argv if command is not None or not _has_script(argv) else _before_script(argv))
    if own.help:
        print_help()
        return 0
    env_options = _planner_options(os.environ)     # a bad DS_AUTOPLAN_* value: refused before anything runs
    fault_settings(os.environ)
    if command is not None:
        if rest:
            raise UserError(f"before --, only ds-autoplan's options (the launcher's go after it): {' '.join(rest)}")
        from .launch_command import run_command
        own.out = own.out or env_options["out"]     # --out, else DS_AUTOPLAN_OUT, else ds_autoplan_out
        return run_command(own, command, _checked_options(own))
    if not argv:
        raise UserError("give the training script, e.g. ds-autoplan launch --num_gpus 2 train.py")
    argv = rest + argv[len(_before_script(argv)):]
    try:
        a = runner.parse_args(argv)
    except SystemExit:
        raise UserError("could not parse the deepspeed launcher arguments") from None
    if not a.module and not os.path.exists(a.user_script):
        raise UserError(f"training script not found: {a.user_script}")
    check_launch(a)
    steps, rounds, scheds, offload = _checked_options(own)
    cut = len(argv) - len(a.user_args) - 1
    opts = apply_autoplan(a, launch_resources(a), os.environ, own.model, own.cluster, own.global_batch,
                          own.out, own.pp, scheds, via="launch", offload=offload, tp=own.tp,
                          remeasure=own.remeasure, profile=own.profile, switchable=own.calibrate is not None)
    from ..runtime.deepspeed.shm import sweep
    try:
        state = _calibrating(a, own, opts, steps, rounds)
        cmd = argv[:cut] + ["--module", a.user_script] + a.user_args
        from ..runtime.replan import launch_loop

        def start() -> int:
            sweep(port=a.master_port)    # a restart: what the ranks before it left
            runner.main(cmd)             # (a failed rank: SystemExit with its status)
            return 0
        launch_loop(state, start)
    finally:
        release_launch(opts["out"])
        # the shared-memory files of this launch's ranks that did not exit by themselves (not
        # those of another launch, which may be starting beside this one)
        sweep(port=a.master_port)
    return 0


def _checked_options(own) -> tuple:
    """ds-autoplan's own options, each refused in one line before anything is planned:
    ``(calibrate steps or None, rounds, schedules, offload)``."""
    for flag, v in (("--global-batch", own.global_batch), ("--pp", own.pp), ("--tp", own.tp)):
        if v is not None and v < 1:
            raise UserError(f"{flag} must be at least 1, got {v}")
    steps, rounds = None, 1
    if own.calibrate_rounds is not None and own.calibrate is None:
        raise UserError("--calibrate-rounds counts the re-plans of --calibrate N: give --calibrate too")
    if own.calibrate is not None:
        from ..runtime.replan import check_rounds, check_steps
        steps = check_steps(own.calibrate)
        if own.calibrate_rounds is not None:
            rounds = check_rounds(own.calibrate_rounds)
        if not own.model:
            raise UserError("--calibrate re-plans the plan made before launch: give --model (the model "
                            "description the script builds)")
    scheds = _known_schedules([x.strip() for x in own.schedules.split(",") if x.strip()]
                              if own.schedules else None, "--schedules")
    return steps, rounds, scheds, _known_offload(own.offload, "--offload")


def _has_script(argv) -> bool:
    """A token that names the script: one ending in .py, or a last token that is no option."""
    return any(tok.endswith(".py") for tok in argv) or bool(argv) and not argv[-1].startswith("-")


def _before_script(argv):
    """The launcher/planner options: everything before the first token ending in .py (or
    the first non-option token)."""
    for i, tok in enumerate(argv):
        if tok.endswith(".py"):
            return argv[:i]
    return argv[:-1]
