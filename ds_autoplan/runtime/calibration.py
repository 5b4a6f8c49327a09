"""The records of runs as calibration input (docs/calibration.md): a run folder (its plan.json
and the measured.json it wrote), checked against its plan; the fit of a cluster to such
folders and the calibrated cluster file's text.  ``ds-autoplan calibrate`` and
``launch --calibrate`` (runtime/replan.py) both use it; the fit itself is cost/calibrate.py."""
from __future__ import annotations

import datetime
import json
import os

from ..errors import UserError

MAX_RECORD_BYTES = 16 * 1024 * 1024
HEADER = "# ds-autoplan calibrate:"


def _read_json(path: str, what: str) -> dict:
    """A JSON object from a file that may come from elsewhere: a regular file of at most
    16 MiB, UTF-8, no NaN or Infinity; never evaluated or unpickled."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"{what}: {path}: {e.strerror}") from None
    import stat as _stat
    if not _stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
        raise UserError(f"{what}: {path}: not a regular file of at most 16 MiB")

    def bad_constant(c):
        raise ValueError(f"{c} is not a number")
    try:
        with open(path, "rb") as fh:
            obj = json.loads(fh.read().decode("utf-8"), parse_constant=bad_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{what}: {path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what}: {path}: not a JSON object")
    return obj


class Run:
    """One run folder: its plan, its record (checked against the plan)."""

    def __init__(self, folder: str, index: int):
        from ..cost.calibrate import RecordError, check_record
        from ..errors import PlanError
        from ..plan import Plan
        from .common.record import FILE, plan_digest
        self.folder, self.index = folder, index
        if not os.path.isdir(folder):
            raise UserError(f"{folder}: not a run folder")
        plan_path, rec_path = os.path.join(folder, "plan.json"), os.path.join(folder, FILE)
        if not os.path.exists(rec_path):
            raise UserError(f"{folder}: no {FILE} (a run records itself after "
                            "DS_AUTOPLAN_MEASURE_STEPS steps, default 3)")
        rec = _read_json(rec_path, FILE)
        try:
            self.plan = Plan.load(plan_path)
        except (OSError, PlanError, ValueError) as e:
            raise UserError(f"{folder}: cannot read its plan.json: {e}") from None
        try:
            self.rec = check_record(rec, rec_path, self.plan.pp)
        except RecordError as e:
            raise UserError(str(e)) from None
        named = rec["plan"]
        for key in ("model", "cluster", "pp", "dp", "tp", "micro_batch_size", "num_microbatches"):
            if named.get(key) != getattr(self.plan, key):
                raise UserError(f"{rec_path}: the record is of another plan ({key} {named.get(key)!r}, "
                                f"plan.json {getattr(self.plan, key)!r})")
        if named.get("sha256") != plan_digest(plan_path):
            raise UserError(f"{rec_path}: the record is older than its plan.json (the plan was "
                            "replaced after the run); run the plan again")
        self.steps = rec["steps"]
        self.written = rec.get("written")


def recost(plan, cluster, model=None):
    """``plan`` re-costed on ``cluster`` (a ClusterSpec or name): the search with the plan's
    degrees, batch split, ZeRO stage, schedule and recompute fixed (an even layer split where
    the plan's is even); returns the re-costed :class:`~ds_autoplan.plan.Plan`.  ``model``:
    the model description where ``plan.model`` names none."""
    from ..search import SearchOptions, plan_model
    from ..spec import SpecError
    p = plan
    fix = {"dp": p.dp, "mbs": p.micro_batch_size, "zero": p.zero_stage,
           "recompute": "auto" if any(p.recompute_per_stage or ()) else "none"}
    v = p.schedule_options.get("v") if p.schedule_options else None
    if v:
        fix["v"] = v
    even = p.layers_per_stage and max(p.layers_per_stage) - min(p.layers_per_stage) <= 1
    try:
        return plan_model(model or p.model, cluster, p.global_batch_size, p.seq_len,
                          SearchOptions(precision=p.precision, pp=p.pp, tp=p.tp, schedules=[p.schedule],
                                        fix=fix, baselines=False, partitioner="even" if even else "bmw"))
    except (SpecError, ValueError, KeyError) as e:
        name = getattr(cluster, "name", cluster)
        raise UserError(f"cannot cost the plan ({p.model}) on {name}: {e} (--model names the model "
                        "description)") from None


def _predictor(model_arg, runs):
    """``predict(cluster, i) -> (seconds, [GB per pipeline rank], components)``: the plan of
    ``runs[i]`` re-costed on ``cluster`` (:func:`recost`, memoised)."""
    memo: dict = {}

    def predict(cl, i):
        key = (cl, i)
        if key not in memo:
            pr = recost(runs[i].plan, cl, model_arg).predicted
            memo[key] = (pr.iteration_time_s, list(pr.peak_memory_gb_per_stage), pr.components or {})
        return memo[key]
    return predict


def fit_folders(folders, cl0, model=None):
    """The fit (:func:`~ds_autoplan.cost.calibrate.fit`) of the cluster ``cl0`` to the records
    in the run ``folders`` (each checked against its plan and ``cl0``); ``(fit, runs, predict)``."""
    from ..cost.calibrate import fit
    runs = [Run(d, i) for i, d in enumerate(folders)]
    for r in runs:
        if r.plan.cluster != cl0.name:
            raise UserError(f"{r.folder}: its plan is for cluster {r.plan.cluster!r}, --cluster is "
                            f"{cl0.name!r}: calibrate runs on the cluster they ran on")
    models = {r.plan.model for r in runs}
    if len(models) > 1 and model is None:
        raise UserError(f"the runs are of different models ({', '.join(sorted(models))}): calibrate "
                        "runs of one model's plans")
    predict = _predictor(model, runs)
    # the fit is relative to --cluster: each record's predicted figures are re-costed on it
    for r in runs:
        _, _, comps = predict(cl0, r.index)
        for name, c in r.rec["components"].items():
            if comps.get(name) is not None:
                c["predicted"] = list(comps[name])
    return fit([r.rec for r in runs], cl0, predict), runs, predict


def calibrated_yaml(res, runs, source: str, cl0, out: str) -> str:
    """The calibrated cluster file's text: the fitted figures and their ``calibrated:`` section
    (the runs, what moved from what, what the runs did not exercise)."""
    import yaml
    cl1 = res.cluster
    doc = {"cluster": {k: v for k, v in vars(cl1).items() if v is not None},
           "calibrated": {"from": source, "date": datetime.date.today().isoformat(),
                          "runs": [{"folder": os.path.abspath(r.folder), "plan": r.plan.label(),
                                    "steps": r.steps, "recorded": r.written,
                                    "residual": round(e, 6)} for r, e in zip(runs, res.residuals)],
                          "moved": {f: {"from": _plain(b), "to": _plain(a), "why": why}
                                    for f, b, a, why in res.moved},
                          "unchanged": {f: why for f, why in res.unchanged},
                          "disagree": {n: [round(x, 4) for x in r] for n, r in res.disagree}}}
    return (f"{HEADER} `--cluster {out}` plans with the figures fitted to "
            f"{len(runs)} run(s) on {cl0.name}\n" + yaml.safe_dump(doc, sort_keys=False))


def _plain(x):
    return round(float(x), 9) if isinstance(x, float) else x
