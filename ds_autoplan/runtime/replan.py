"""``ds-autoplan launch --calibrate N``: the launch measures its plan, re-plans on what it
measured and carries on under the faster plan (docs/calibration.md, "The loop in one command").

The launcher plans before launch (``--model``) and writes ``replan.json`` (:data:`STATE`) into
the run's output folder: the planning request (model, cluster, batch, restrictions), N, and
the decisions so far.  Every rank reads it (``DS_AUTOPLAN_REPLAN``, set by the bootstrap):

1. After N steps (the record's, ``DS_AUTOPLAN_MEASURE_STEPS=N``: the first is warm-up) the run's
   record is written; rank 0 then :func:`decide`\\ s: calibrate the cluster from the record
   (``cluster.calibrated.yaml`` in the folder), re-plan on it, re-cost the running plan on it.
   The re-plan is taken only if predicted faster by more than the calibration's own residual
   band (at least :data:`MIN_BAND`); every rank learns the decision from rank 0.
2. Taken: every rank saves ds_autoplan's plan-independent checkpoint
   (``replan_checkpoint/<tag>``, the data position is the engine's step and sample counters)
   and the script finishes its step; as the next begins, rank 0 writes the new plan as
   ``plan.json`` and ``replan.json`` says where to resume, the ranks end the script
   (:class:`Restart`, caught by the bootstrap) and the launcher starts them again: the engine
   loads the checkpoint in ``initialize`` and the script's loop goes on from
   ``engine.global_steps``.
3. The new plan's record (N steps after the resume) is compared with the old one's measured
   time: faster, it is kept; slower, the run switches back the same way.  One switch per
   launch, or up to K with ``--calibrate-rounds K``: a kept switch starts the next round at
   once, calibrated on every plan measured so far (their records kept under
   ``replan_runs/step<K>/``); a round that keeps its plan, or a switch back, ends the loop.
   ``measured.json`` holds every decision under ``"replans"``.
"""
from __future__ import annotations

import json
import os

from ..errors import UserError

STATE = "replan.json"
ENV = "DS_AUTOPLAN_REPLAN"
CHECKPOINT = "replan_checkpoint"
CALIBRATED = "cluster.calibrated.yaml"
RUNS = "replan_runs"     # each measured plan's plan.json and record, the fits' input
MIN_BAND = 0.03          # a re-plan predicted faster by less is within any calibration's error
FORMAT = 1


class Restart(SystemExit):
    """Raised on every rank after the switch's checkpoint: the script ends here, the bootstrap
    tears the process group down and exits 0, and the launcher starts the ranks again."""

    def __init__(self):
        super().__init__(0)


# what makes two plans train differently (Plan's fields): not the cluster they were costed on,
# their predictions or notes
RUN_FIELDS = ("parallel", "precision", "schedule", "schedule_options", "layers_per_stage",
              "recompute_per_stage", "selective_recompute", "layer_strategies")


def same_run(a, b) -> bool:
    """Whether plans ``a`` and ``b`` train the same way: degrees, batch split, ZeRO and
    offload (``parallel``), precision, schedule, layer split and recomputation.  Two plans
    with one :meth:`Plan.label` can differ in the last two: a re-plan that moves layers between
    stages or recomputes less is another plan."""
    return all(getattr(a, f) == getattr(b, f) for f in RUN_FIELDS)


def _shown(new, now) -> str:
    """``new``'s label, with its layer split and recomputation where only they differ."""
    if new.label() != now.label():
        return new.label()
    return (f"{new.label()} layers {list(new.layers_per_stage)} recompute "
            f"{[round(float(x), 3) for x in new.recompute_per_stage]}")


def _integer(flag: str, n, what: str) -> int:
    try:
        v = int(n)
        if str(v) != str(n).strip():
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{flag} {n}: give {what}") from None
    return v


def check_steps(n) -> int:
    """``--calibrate N``: an integer of at least 2 (the record's first step is warm-up)."""
    v = _integer("--calibrate", n, "the number of steps to measure (an integer, at least 2)")
    if v < 2:
        raise UserError(f"--calibrate {v}: at least 2 steps (the first is warm-up, not measured)")
    from .common.record import MAX_STEPS
    if v > MAX_STEPS:
        raise UserError(f"--calibrate {v}: at most {MAX_STEPS} steps are recorded")
    return v


def check_rounds(k) -> int:
    """``--calibrate-rounds K``: how many switches the launch may make, 1 to 8."""
    v = _integer("--calibrate-rounds", k, "the number of re-plans (an integer, 1 to 8)")
    if not 1 <= v <= 8:
        raise UserError(f"--calibrate-rounds {v}: 1 to 8 (each switch is a checkpoint and a restart)")
    return v


# -- the state file -------------------------------------------------------------------------------
def read_state(path: str) -> dict:
    with open(path) as fh:
        state = json.load(fh)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path}: not a ds-autoplan re-plan state")
    return state


def write_state(folder: str, state: dict) -> str:
    from ..outputs import json_text, write_folder
    write_folder(folder, {STATE: json_text(state)}, complete=False, what="the run's output folder")
    return os.path.join(folder, STATE)


def start(folder: str, steps: int, request: dict, rounds: int = 1) -> str:
    """The launcher's: the state of a launch that will measure ``steps`` steps of the plan
    ``request`` made (:func:`plan_request`; model, cluster, global_batch, pp, tp, schedules,
    offload), switchable by construction, and switch at most ``rounds`` times."""
    return write_state(folder, {"format": FORMAT, "steps": steps, "rounds": rounds, "request": request,
                                "phase": "measure", "resume": None, "restart": False, "replans": [],
                                "before": None, "records": []})


def launch_loop(state: str | None, start) -> int:
    """The launcher's: ``start()`` runs the ranks once (their exit status), again while they
    stopped to switch plans (the state ``state``, None: no ``--calibrate``); then the launch's
    end (:func:`finish`: its note printed, its error raised).  Returns the last status."""
    rc = start()
    while rc == 0 and state is not None and restart_due(state):
        print("ds-autoplan: restarting the ranks under the switched plan (resumed from "
              f"{os.path.join(os.path.dirname(state), CHECKPOINT)})", flush=True)
        rc = start()
    if rc == 0 and state is not None:
        error, note = finish(state)
        if note:
            print(f"ds-autoplan: {note}", flush=True)
        if error:
            raise UserError(error)
    return rc


def restart_due(path: str) -> bool:
    """The launcher's, after the ranks ended: whether they stopped to switch (and clear it)."""
    if not os.path.exists(path):
        return False
    state = read_state(path)
    if not state.get("restart"):
        return False
    state["restart"] = False
    write_state(os.path.dirname(path), state)
    return True


def finish(path: str) -> tuple[str | None, str | None]:
    """The launcher's, once the ranks ended for good: ``(error, note)``.  The error: the run
    ended before its N steps were measured (nothing re-planned).  The note: a switch was decided
    at the run's last step, so the run ended on the plan it had (the record says which:
    ``ended_on`` of the last decision, the plan ``plan.json`` holds)."""
    from ..plan import Plan
    folder = os.path.dirname(path)
    state = read_state(path)
    if state["phase"] == "measure":
        return (f"--calibrate {state['steps']}: the run ended before {state['steps']} steps were "
                "measured; nothing re-planned (give fewer steps, or train longer)"), None
    if not state["replans"]:
        return None, None
    ran = Plan.load(os.path.join(folder, "plan.json")).label()
    state["replans"][-1]["ended_on"] = ran
    note = None
    if state.pop("next", None) is not None:
        note = f"the run ended before the switch it had decided; it ended on {ran} (plan.json)"
        state["phase"] = "done"
    try:
        _with_replans(folder, state["replans"])
    except OSError:
        pass                    # the last run wrote no record: the state still says it
    write_state(folder, state)
    return None, note


# -- rank 0's decision ----------------------------------------------------------------------------
def switchable_plan(best, base: dict):
    """``best(fix)``'s plan among those a switch resumes (ds_autoplan's plan-independent
    checkpoint, written by the pipeline engine): ZeRO-2/3 without a pipeline runs in DeepSpeed's
    plain engine, so there ZeRO-1 instead, said in the plan's notes."""
    from ..emit.deepspeed import runs_plain
    p = best(base)
    if runs_plain(p):
        p = best({**base, "zero": 1})
        p.notes.append("ZeRO-1 (--calibrate): ZeRO-2/3 without a pipeline runs in DeepSpeed's plain "
                       "engine, whose checkpoint a switch of plans does not resume")
    return p


def plan_request(request: dict, cluster, switchable: bool = True):
    """The plan ``request`` (model, global_batch, pp, tp, schedules, offload, precision) asks for on
    ``cluster`` (a file or a Cluster): the launcher's before launch, rank 0's re-plan after the
    record; ``switchable``: among the plans a switch resumes (:func:`switchable_plan`)."""
    from ..search import SearchOptions, plan_model

    extra = {"precision": request["precision"]} if request.get("precision") else {}

    def best(fix):
        return plan_model(request["model"], cluster, request["global_batch"], options=SearchOptions(
            pp=request.get("pp"), tp=request.get("tp"), schedules=request.get("schedules"), fix=fix or None,
            **extra))
    base = {"offload": request["offload"]} if request.get("offload") else {}
    return switchable_plan(best, base) if switchable else best(base)


def _replan(request: dict, cluster):
    from ..spec import SpecError
    try:
        return plan_request(request, cluster), None
    except (SpecError, ValueError, KeyError, UserError) as e:
        return None, str(e)


def _moved(res) -> str:
    return ", ".join(f"{f} {float(b):.3g} -> {float(a):.3g}" for f, b, a, _ in res.moved) or "nothing moved"


def _with_replans(folder: str, replans: list) -> None:
    """``measured.json`` of the run now (rank 0) with the decisions so far."""
    from ..outputs import json_text, write_folder
    from .common.record import FILE
    path = os.path.join(folder, FILE)
    with open(path) as fh:
        rec = json.load(fh)
    rec["replans"] = replans
    write_folder(folder, {FILE: json_text(rec)}, complete=False, what="the run's output folder")


def _keep_record(folder: str, state: dict, step: int) -> None:
    """The running plan's plan.json and record, kept as ``replan_runs/step<step>/`` for the
    fits of this launch's later rounds (``state["records"]``: this launch's, none older)."""
    from ..outputs import text, write_folder
    from .common.record import FILE
    name = os.path.join(RUNS, f"step{step}")
    files = {}
    for f in ("plan.json", FILE):           # as they are: the record names its plan's digest
        with open(os.path.join(folder, f), encoding="utf-8", newline="") as fh:
            files[f] = text(fh.read())
    write_folder(os.path.join(folder, name), files, complete=False, what="the run's output folder")
    if name not in state["records"]:
        state["records"].append(name)


def _in_round(state: dict, k: int, line: str) -> str:
    """A decision's line, with its round where the launch has several (--calibrate-rounds)."""
    return f"round {k}/{state['rounds']}: {line}" if state.get("rounds", 1) > 1 else line


def _round(state: dict, folder: str, step: int, now, measured: float, out: dict) -> None:
    """A re-plan of the running plan ``now`` (measured ``measured`` s/it): calibrate on every
    record of this launch, re-plan, switch or keep (``out``; ``state`` updated)."""
    from .calibration import calibrated_yaml, fit_folders, recost
    from ..outputs import text, write_folder
    from ..spec.cluster import load_cluster
    req = state["request"]

    def say(line):
        return _in_round(state, len(state["replans"]) + 1, line)
    state["phase"] = "done"
    try:
        cl0 = load_cluster(req["cluster"])
        res, runs, _ = fit_folders([os.path.join(folder, r) for r in state["records"]], cl0, req["model"])
    except (UserError, OSError, ValueError) as e:
        out["lines"].append(say(f"keeping the plan: the run's record does not calibrate ({e})"))
        return
    write_folder(folder, {CALIBRATED: text(calibrated_yaml(res, runs, req["cluster"], cl0, CALIBRATED))},
                 complete=False, what="the run's output folder")
    band = max(MIN_BAND, max((abs(x) for x in res.residuals), default=0.0))
    mine = recost(now, res.cluster, req["model"]).predicted.iteration_time_s
    new, why = _replan(req, res.cluster)
    head = (f"measured {measured:.4g} s/it vs predicted {now.predicted.iteration_time_s:.4g} s "
            f"(calibrated{f' on {len(runs)} runs' if len(runs) > 1 else ''}: {_moved(res)})")
    entry = {"step": step, "from": now.label(), "to": now.label(), "predicted_s": mine,
             "measured_before_s": measured, "measured_after_s": None, "kept": True}
    if new is None:
        out["lines"].append(say(f"{head}; keeping the plan: the re-plan does not fit ({why})"))
    elif same_run(new, now) or new.predicted.iteration_time_s >= mine * (1 - band):
        out["lines"].append(say(f"{head}; keeping the plan: the re-plan ({_shown(new, now)}: predicted "
                                f"{new.predicted.iteration_time_s:.4g} s vs {mine:.4g} s) is within the band "
                                f"(+-{100 * band:.1f}%)"))
        entry["re_planned"] = new.label()
    else:
        out.update(switch=True, tag=f"step{step}-to-replan")
        out["lines"].append(say(f"{head}; re-planned {_shown(new, now)}: predicted {new.predicted.iteration_time_s:.4g} s "
                                f"(the plan: {mine:.4g} s); switching at step {step}"))
        entry.update(to=new.label(), predicted_s=new.predicted.iteration_time_s, kept=None)
        state.update(phase="after", next=new.to_dict(),
                     before={"plan": now.to_dict(), "measured_s": measured, "step": step})
    state["replans"].append(entry)


def decide(path: str, step: int) -> dict:
    """Rank 0, after the run's record is written at ``step``: ``{"switch": bool, "lines":
    [str], "tag": checkpoint tag}`` (module docstring); the state and the record updated."""
    from ..plan import Plan
    from .common.record import FILE
    folder = os.path.dirname(path)
    state = read_state(path)
    state.setdefault("records", [])
    with open(os.path.join(folder, FILE)) as fh:
        measured = float(json.load(fh)["iteration_time_s"]["measured"])
    now = Plan.load(os.path.join(folder, "plan.json"))
    phase, out = state["phase"], {"switch": False, "lines": [], "tag": None}
    if phase in ("measure", "after"):
        _keep_record(folder, state, step)
    if phase == "measure":
        _round(state, folder, step, now, measured, out)
    elif phase == "after":
        entry, before = state["replans"][-1], state["before"]
        entry["measured_after_s"] = measured
        if measured < before["measured_s"]:
            entry["kept"] = True
            out["lines"].append(_in_round(state, len(state["replans"]), (
                f"the re-plan measured {measured:.4g} s/it vs {before['measured_s']:.4g} s before: keeping it")))
            state["phase"] = "done"
            if len(state["replans"]) < state.get("rounds", 1):
                _round(state, folder, step, now, measured, out)      # the next round, at once
        else:
            entry["kept"] = False
            out.update(switch=True, tag=f"step{step}-back")
            out["lines"].append(_in_round(state, len(state["replans"]), (
                f"the re-plan measured {measured:.4g} s/it, not faster than {before['measured_s']:.4g} s "
                f"before: switching back to {entry['from']} at step {step}")))
            state.update(phase="back", next=before["plan"])
    elif phase == "back":
        state["phase"] = "done"
    _with_replans(folder, state["replans"])
    write_state(folder, state)
    return out


def switch_files(path: str, tag: str) -> None:
    """Rank 0, after every rank saved the checkpoint ``tag``: the next plan becomes ``plan.json``
    (and its DeepSpeed config) and the state says to restart from the checkpoint."""
    from ..emit.deepspeed import MERGED_CONFIG, ds_config
    from ..outputs import json_text, text, write_folder
    from ..plan import Plan
    folder = os.path.dirname(path)
    state = read_state(path)
    nxt = Plan.from_dict(state.pop("next"))
    write_folder(folder, {"plan.json": text(nxt.to_json() + "\n"), MERGED_CONFIG: json_text(ds_config(nxt))},
                 complete=False, what="the run's output folder")
    state.update(resume={"dir": os.path.join(folder, CHECKPOINT), "tag": tag}, restart=True)
    write_state(folder, state)


def abandon(path: str, why: str) -> None:
    """Rank 0: the switch decided did not happen; the running plan stays, the record says why."""
    folder = os.path.dirname(path)
    state = read_state(path)
    state.pop("next", None)
    entry = state["replans"][-1]
    entry.update(kept=False, not_switched=why)
    state["phase"] = "done"
    _with_replans(folder, state["replans"])
    write_state(folder, state)


def _failed(path: str, why: str) -> None:
    """Rank 0: the decision itself failed (a file it reads or writes): the run keeps its plan
    and the launch ends as one that decided, not as one never measured (the state unchanged by
    the failed :func:`decide`, which writes it last)."""
    try:
        state = read_state(path)
        state.update(phase="done", failed=why)
        write_state(os.path.dirname(path), state)
    except (OSError, UserError):
        pass                    # the state cannot be written either: finish says what it holds


# -- every rank -----------------------------------------------------------------------------------
def from_env():
    """This rank's re-plan state file (``DS_AUTOPLAN_REPLAN``), or None."""
    from ..env import env_str
    return env_str(ENV)


def attach(engine) -> None:
    """In ``initialize`` (every rank): resume from the switch's checkpoint when the state names
    one, and decide after the run's record (:func:`decide`) when its steps are in."""
    path = from_env()
    rec = getattr(engine, "ap_recorder", None)
    if path is None:
        return
    state = read_state(path)
    if state.get("resume"):
        r = state["resume"]
        engine.load_checkpoint(r["dir"], tag=r["tag"])
    if rec is not None and state["phase"] != "done":
        rec.on_record = lambda: _at_record(engine, path)


def _at_record(engine, path: str) -> None:
    d = decided(path, int(engine.global_steps))
    if d["switch"] and saved(path, d["tag"], lambda folder, tag: engine.save_checkpoint(
            folder, tag=tag, client_state={"replan": tag})):
        # the script finishes this step (its loss printed, its own bookkeeping done); the ranks
        # stop as the next one begins
        engine.ap_recorder.on_step = lambda: restart(path, d["tag"])


def decided(path: str, step: int) -> dict:
    """Every rank, once the run's record is written after ``step`` steps: rank 0 decides
    (:func:`decide`) and prints the decision's lines, every rank learns it (``{"switch",
    "lines", "tag"}``)."""
    import torch.distributed as dist

    from .common.collectives import broadcast_text
    me = dist.get_rank()
    text_ = ""
    if me == 0:
        try:
            text_ = json.dumps(decide(path, step))
        except (UserError, OSError) as e:
            text_ = json.dumps({"switch": False, "lines": [f"keeping the plan: the re-plan failed ({e})"]})
            _failed(path, str(e))
    d = json.loads(broadcast_text(text_))
    if me == 0:
        for line in d["lines"]:
            print(f"ds-autoplan: {line}", flush=True)
    return d


def saved(path: str, tag: str, save) -> bool:
    """Every rank: ``save(folder, tag)`` writes this rank's part of the switch's checkpoint
    (``replan_checkpoint/<tag>``); True when every rank's part is written, else the switch is
    abandoned (the record says why) and the running plan goes on."""
    import torch
    import torch.distributed as dist

    from .common.collectives import device
    me = dist.get_rank()
    try:
        save(os.path.join(os.path.dirname(path), CHECKPOINT), tag)
        ok = 1
    except (OSError, UserError) as e:
        if me == 0:
            print(f"ds-autoplan: keeping the plan: the switch's checkpoint cannot be written ({e})", flush=True)
        ok = 0
    flag = torch.tensor([ok], dtype=torch.int64, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item() and me == 0:
        abandon(path, "its checkpoint could not be written")
    return bool(flag.item())


def restart(path: str, tag: str) -> None:
    """Every rank, after the switch's checkpoint: rank 0 makes the next plan ``plan.json``
    (:func:`switch_files`), then every rank ends the script (:class:`Restart`)."""
    import torch.distributed as dist
    if dist.get_rank() == 0:
        switch_files(path, tag)
    dist.barrier()
    raise Restart()
