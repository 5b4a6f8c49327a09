"""``ds-autoplan calibrate`` (docs/calibration.md): the fit brings a wrong cluster's prediction
of the runs to their measurement and of another plan close to its own; the figures no run
exercised stay; every bad record is refused in one line with nothing written.

The fit is checked twice: against records that the cost model itself writes for a "true"
cluster (exact, no chance involved), and against real runs (sleep-layer compute, real gloo
links, AdamW) of bench/calibration.py's two plans on 2 CPU ranks."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import yaml

from ds_autoplan.cli import main
from ds_autoplan.runtime.calibration import recost
from ds_autoplan.outputs import text, write_folder
from ds_autoplan.runtime.common import record
from ds_autoplan.search import SearchOptions, plan_model
from ds_autoplan.spec.cluster import ClusterSpec, load_cluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
WRONG = {"name": "calib-test-1x2", "num_nodes": 1, "gpus_per_node": 2, "memory_gb": 8.0,
         "reserve_gb": 0.5, "peak_tflops": 0.05, "compute_efficiency": 1.0,
         "intra_node_GBps": 20.0, "inter_node_GBps": 20.0, "intra_latency_us": 5.0,
         "inter_latency_us": 5.0, "host_memory_gb": 16.0, "cpu_cores": 2,
         "cpu_adam_rate_per_core": 5e8, "host_link_GBps": 10.0}
# the machine the records come from: compute 3x slower, links 20x slower, a fixed cost per
# iteration and per device memory the file does not have
TRUE = {**WRONG, "peak_tflops": 0.05 / 3, "intra_node_GBps": 1.0, "inter_node_GBps": 1.0,
        "intra_latency_us": 100.0, "inter_latency_us": 100.0, "step_overhead_ms": 4.0,
        "memory_overhead_gb": 0.25}


def _plan(cluster, out, mbs=2, m=4, schedule="1f1b", pp=2):
    plan = plan_model("gpt-tiny", cluster, mbs * m, options=SearchOptions(
        precision="fp32", pp=pp, schedules=[schedule], fix={"dp": 2 // pp, "mbs": mbs, "recompute": "none"},
        partitioner="even", baselines=False))
    write_folder(str(out), {"plan.json": text(plan.to_json() + "\n")}, complete=False)
    return plan


def _write_cluster(path, d):
    path.write_text(yaml.safe_dump({"cluster": d}, sort_keys=False))
    return str(path)


def _modelled_record(folder, plan, true: ClusterSpec, steps=3):
    """measured.json as a run on ``true`` would write it if the cost model were exact: the
    plan re-costed there gives each pipeline rank's component seconds and peak, the probe
    the true link's one-way times."""
    t = recost(plan, true).predicted
    comps = t.components
    P = plan.pp
    rows = []
    for p in range(P):
        r = record.Recorder(str(folder), plan, p, "modelled", steps)
        own = [comps[n][p] for n in record.NAMES]
        n_f = comps["actions"][p] / (3 if any(comps["weight_grad"]) else 2)
        count = [n_f if n in ("forward", "input_grad") or (n == "weight_grad" and comps[n][p]) else 0
                 for n in record.NAMES]
        r.own, r.count, r.step_s, r.step = [x * (steps - 1) for x in own], [c * (steps - 1) for c in count], \
            t.iteration_time_s * (steps - 1), steps - 1
        r.peak = t.peak_memory_gb_per_stage[p] * record.GB
        ends = [k * t.iteration_time_s for k in range(steps)]
        r.begins = [e - t.iteration_time_s for e in ends]
        r.ends, r.lasts = ends, [e - max(comps["step_tail"]) for e in ends]
        if p + 1 < P:
            X = 2 * 64 * 64 * 4
            r.link = (X, X / (true.intra_node_GBps * 1e9) + true.intra_latency_us * 1e-6,
                      4 / (true.intra_node_GBps * 1e9) + true.intra_latency_us * 1e-6)
        rows.append(r._row())
    record.write_record(str(folder), plan, rows, "modelled")


@pytest.fixture
def modelled(tmp_path):
    wrong = _write_cluster(tmp_path / "wrong.yaml", WRONG)
    true = ClusterSpec.from_dict(TRUE)
    plans = {"A": _plan(wrong, tmp_path / "A"), "B": _plan(wrong, tmp_path / "B", schedule="zb-h1"),
             "C": _plan(wrong, tmp_path / "C", mbs=1, m=8)}
    for k in ("A", "C"):
        _modelled_record(tmp_path / k, plans[k], true)
    return tmp_path, wrong, true, plans


def _err(plan, cluster, true):
    got = recost(plan, cluster).predicted.iteration_time_s
    want = recost(plan, true).predicted.iteration_time_s
    return abs(got - want) / want


def test_fit_to_the_model_own_records(modelled, capsys):
    """From the wrong file, one run's record brings its plan's prediction to the measurement
    and a second plan's (another schedule) within 1%; two runs of different micro-batch sizes
    also fit the fixed cost of an action; memory follows the measured peaks.  The host
    figures no run exercised are unchanged, and the file says so."""
    tmp, wrong, true, plans = modelled
    out = tmp / "c2.yaml"
    assert _err(plans["A"], wrong, true) > 0.5          # the wrong file is far off
    assert main(["calibrate", str(tmp / "A"), "--cluster", wrong, "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "moved compute_efficiency: 1 -> 0.333" in shown, shown
    assert "moved intra_latency_us: 5 -> 100" in shown, shown
    for k, tol in (("A", 0.005), ("B", 0.01)):
        assert _err(plans[k], str(out), true) <= tol, (k, _err(plans[k], str(out), true))
    c2 = load_cluster(str(out))
    a = recost(plans["A"], c2).predicted.peak_memory_gb_per_stage
    b = recost(plans["A"], true).predicted.peak_memory_gb_per_stage
    assert max(abs(x - y) / y for x, y in zip(a, b)) <= 0.02, (a, b)
    doc = yaml.safe_load(out.read_text())
    for f in ("host_memory_gb", "cpu_cores", "cpu_adam_rate_per_core", "host_link_GBps", "reserve_gb"):
        assert getattr(c2, f) == WRONG[f], f
    assert "action_overhead_us" in doc["calibrated"]["unchanged"]
    assert doc["calibrated"]["runs"][0]["plan"].startswith("pp=2 tp=1 dp=1 ZeRO-0 micro-batch 2 x 4")
    assert c2.calibration_runs == 1 and c2.calibration_error <= 0.005
    # the plan's error band now names the calibration
    band = recost(plans["A"], c2).predicted.error_band
    assert band["source"] == "calibration" and band["rows"] == 1
    # two micro-batch sizes: the per-action cost moves too, both runs are reproduced
    out2 = tmp / "c3.yaml"
    assert main(["calibrate", str(tmp / "A"), str(tmp / "C"), "--cluster", wrong, "--out", str(out2)]) == 0
    assert "moved action_overhead_us" in capsys.readouterr().out
    for k in ("A", "B", "C"):
        assert _err(plans[k], str(out2), true) <= 0.02, (k, _err(plans[k], str(out2), true))


def test_a_calibrated_file_is_rewritten_but_no_other_file(modelled, capsys):
    tmp, wrong, _, _ = modelled
    mine = tmp / "mine.yaml"
    mine.write_text("my notes\n")
    assert main(["calibrate", str(tmp / "A"), "--cluster", wrong, "--out", str(mine)]) == 2
    assert "was not written by ds-autoplan calibrate" in capsys.readouterr().err
    assert mine.read_text() == "my notes\n"
    out = tmp / "c.yaml"
    for _ in range(2):           # its own file: replaced
        assert main(["calibrate", str(tmp / "A"), "--cluster", wrong, "--out", str(out)]) == 0
    assert "cluster" in yaml.safe_load(out.read_text())


def _break(folder, how):
    path = folder / "measured.json"
    rec = json.loads(path.read_text())
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_text(path.read_text()[:200])
    elif how == "not-json":
        path.write_bytes(b"\x80\x81 not json")
    elif how == "nan":
        path.write_text(path.read_text().replace('"measured": [', '"measured": [NaN, ', 1))
    elif how == "negative":
        rec["components"]["forward"]["measured"][0] = -1.0
        path.write_text(json.dumps(rec))
    elif how == "absurd":
        rec["iteration_time_s"]["measured"] = 1e12
        path.write_text(json.dumps(rec))
    elif how == "stages":
        for c in rec["components"].values():
            c["measured"] = c["measured"][:1]
        path.write_text(json.dumps(rec))
    elif how == "model":
        rec["plan"]["model"] = "llama2-7b"
        path.write_text(json.dumps(rec))
    elif how == "older":                   # the plan replaced after the run
        plan = json.loads((folder / "plan.json").read_text())
        plan["notes"] = ["re-planned"]
        (folder / "plan.json").write_text(json.dumps(plan))
    elif how == "pickle":
        path.write_bytes(b"\x80\x04\x95\x00")
    return how


@pytest.mark.parametrize("how,needle", [
    ("missing", "no measured.json"), ("truncated", "not valid JSON"), ("not-json", "not valid JSON"),
    ("nan", "not valid JSON"), ("negative", "is not a time or size"), ("absurd", "is not a time or size"),
    ("stages", "must list 2 pipeline ranks"), ("model", "the record is of another plan"),
    ("older", "older than its plan.json"), ("pickle", "not valid JSON")])
def test_bad_records_are_refused_in_one_line(modelled, capsys, how, needle):
    tmp, wrong, _, _ = modelled
    _break(tmp / "A", how)
    out = tmp / "c.yaml"
    assert main(["calibrate", str(tmp / "A"), "--cluster", wrong, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ds-autoplan calibrate: error: "), err
    assert needle in err, err
    assert not out.exists()


def test_other_cluster_and_not_a_run_folder(modelled, capsys, tmp_path):
    tmp, wrong, _, _ = modelled
    other = _write_cluster(tmp / "other.yaml", {**WRONG, "name": "another-1x2"})
    for argv, needle in (([str(tmp / "A"), "--cluster", other], "calibrate runs on the cluster they ran on"),
                         ([str(tmp / "nowhere"), "--cluster", wrong], "not a run folder"),
                         ([str(tmp / "B"), "--cluster", wrong], "no measured.json")):
        assert main(["calibrate", *argv, "--out", str(tmp / "c.yaml")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp / "c.yaml").exists()


def test_record_steps_variable(monkeypatch, tmp_path):
    """DS_AUTOPLAN_MEASURE_STEPS: 0 records nothing, 1 is refused (the first step is warm-up),
    a bad value is one EnvError line; without an output folder nothing is recorded."""
    from ds_autoplan.env import EnvError
    plan = _plan(_write_cluster(tmp_path / "w.yaml", WRONG), tmp_path / "A")
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path / "A"))
    monkeypatch.setenv("DS_AUTOPLAN_MEASURE_STEPS", "0")
    assert record.from_env(plan, 0, "t") is None
    for bad, needle in (("1", "at least 2"), ("abc", "not a whole number"), ("999", "at most")):
        monkeypatch.setenv("DS_AUTOPLAN_MEASURE_STEPS", bad)
        with pytest.raises(EnvError, match=needle):
            record.from_env(plan, 0, "t")
    monkeypatch.delenv("DS_AUTOPLAN_MEASURE_STEPS")
    assert record.from_env(plan, 0, "t").steps == 3
    monkeypatch.delenv("DS_AUTOPLAN_OUT")
    monkeypatch.delenv("DS_AUTOPLAN_PLAN", raising=False)
    assert record.from_env(plan, 0, "t") is None


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_calibration", ROOT / "bench" / "calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_calibrated_from_a_real_run(tmp_path, capsys):
    """bench/calibration.py's machine (sleep-layer compute, real gloo, AdamW, DeepSpeed's
    pipeline engine through the adapter, 2 ranks): plan A's record, calibrated from a file
    with compute 3x and links 20x too fast (predicted about 3.5x too fast), predicts A within
    3% (the fit reproduces its run), plan B (ZB-H1) within 25% and both plans' peaks (bytes,
    measured exactly) within 2%.  B's 5% goal is the benchmark's (``bench/calibration.py``,
    on a quiet machine): a timed bound this tight fails by chance on two loaded cores
    (DEVELOPERS.md: speed targets are benchmarks, never timed unit tests); 25% holds with
    two busy loops beside the ranks (seen: up to 13%), where the uncalibrated file misses by
    about 70%."""
    b = _bench()
    wrong = str(tmp_path / "wrong.yaml")
    b.wrong_cluster(wrong)
    plans = {k: b.make_plan(wrong, str(tmp_path / k), v["mbs"], v["m"], v["schedule"])
             for k, v in b.PLANS.items()}
    recs = dict(zip(plans, b.run_plans([str(tmp_path / k) for k in plans], wrong, 6)))
    for key in ("iteration_time_s", "peak_memory_gb", "components", "links"):
        assert key in recs["A"], key
    assert recs["A"]["components"]["forward"]["count"] == [4, 4]      # m F per stage per rank
    assert recs["B"]["components"]["weight_grad"]["count"] == [4, 4]
    before = recost(plans["B"], wrong).predicted.iteration_time_s
    meas_b = recs["B"]["iteration_time_s"]["measured"]
    assert abs(before - meas_b) / meas_b > 0.5, (before, meas_b)
    out = str(tmp_path / "c2.yaml")
    assert main(["calibrate", str(tmp_path / "A"), "--cluster", wrong, "--out", out]) == 0
    print(capsys.readouterr().out)
    for k, tol in (("A", 0.03), ("B", 0.25)):
        after = recost(plans[k], out).predicted
        meas = recs[k]["iteration_time_s"]["measured"]
        assert abs(after.iteration_time_s - meas) / meas <= tol, (k, after.iteration_time_s, meas)
        for p, m in zip(after.peak_memory_gb_per_stage, recs[k]["peak_memory_gb"]["measured"]):
            assert abs(p - m) / m <= 0.02, (k, after.peak_memory_gb_per_stage, recs[k]["peak_memory_gb"])


def test_plain_engine_records_itself_and_calibrates(tmp_path, capsys):
    """A plan without a pipeline (dp=2 ZeRO-2) in DeepSpeed's plain engine (the sleep layers of
    bench/calibration.py, real gloo gradient reduction, AdamW): its record (one F and one fused
    BW per micro-batch, the peak with the forward's saved activations) calibrates the wrong
    cluster so that it predicts the run (the fit reproduces its own record) and its peak
    within 2% (bytes, measured exactly)."""
    from harness.records import run_record
    b = _bench()
    wrong = str(tmp_path / "wrong.yaml")
    b.wrong_cluster(wrong)
    folder = tmp_path / "plain"
    plan = plan_model(b.MODEL, wrong, 8, options=SearchOptions(
        precision="fp32", pp=1, fix={"dp": 2, "zero": 2, "mbs": 2, "recompute": "none"}, baselines=False))
    assert (plan.pp, plan.dp, plan.zero_stage, plan.num_microbatches) == (1, 2, 2, 2)
    write_folder(str(folder), {"plan.json": text(plan.to_json() + "\n")}, complete=False)
    b.run_plans([str(folder)], wrong, 4)
    rec = run_record(folder, "deepspeed-plain", counted_steps=3)
    assert rec["components"]["forward"]["count"] == [2] and rec["components"]["input_grad"]["count"] == [2]
    assert rec["peak_memory_gb"]["activations_tracked"]
    states, peak = rec["peak_memory_gb"]["model_states_gb"][0], rec["peak_memory_gb"]["measured"][0]
    assert peak > states
    # the cost model's memory of the plain engine, before any calibration (the sleep layers
    # save the activation bytes the model gives them): the measured peak
    assert abs(plan.predicted.peak_memory_gb_per_stage[0] - peak) / peak <= 0.02, \
        (plan.predicted.peak_memory_gb_per_stage, peak)
    out = str(tmp_path / "c2.yaml")
    assert main(["calibrate", str(folder), "--cluster", wrong, "--out", out]) == 0
    print(capsys.readouterr().out)
    after = recost(plan, out).predicted
    meas = rec["iteration_time_s"]["measured"]
    assert abs(after.iteration_time_s - meas) / meas <= 0.03, (after.iteration_time_s, meas)
    assert abs(after.peak_memory_gb_per_stage[0] - peak) / peak <= 0.02, (after.peak_memory_gb_per_stage, peak)


def test_an_action_before_the_first_step_is_not_counted(tmp_path):
    """An action outside any step (``eval_batch`` before the first ``train_batch`` runs the same
    action table) neither fails nor enters the record's sums."""
    from ds_autoplan.runtime.common.record import NAMES, Recorder
    from ds_autoplan.schedule.ir import Kind
    r = Recorder(str(tmp_path), _plan(ClusterSpec.from_dict(WRONG), tmp_path), 0, "modelled", 3)
    r.action(Kind.F, 0.5, 0.0)
    r.step_begin()
    assert r._own_step == [0.0] * len(NAMES) and r.own == [0.0] * len(NAMES)


def test_an_evaluation_forward_is_no_part_of_the_recorded_step(tmp_path, monkeypatch):
    """DeepSpeed's plain engine under the record: a forward under ``no_grad`` (an evaluation
    between training steps) begins no step and counts no F; a training forward does."""
    import torch

    from ds_autoplan.runtime.deepspeed.measure import record_engine
    from ds_autoplan.search import plan_model
    monkeypatch.setenv("DS_AUTOPLAN_OUT", str(tmp_path))
    monkeypatch.setenv("DS_AUTOPLAN_MEASURE_STEPS", "3")
    lin = torch.nn.Linear(2, 2)

    class Engine:
        module, optimizer = lin, None

        def forward(self, x):
            return lin(x)

        def backward(self, loss):
            loss.backward()

        def step(self):
            pass

        def is_gradient_accumulation_boundary(self):
            return True
    engine = Engine()
    rec = record_engine(engine, plan_model("gpt-tiny", "cpu-2", 8))
    with torch.no_grad():
        engine.forward(torch.ones(1, 2))
    assert rec.step == -1 and sum(rec._count_step) == 0
    engine.backward(engine.forward(torch.ones(1, 2)).sum())
    assert rec.step == 0 and sum(rec._count_step) == 2
