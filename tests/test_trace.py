"""Chrome / Perfetto traces: ``simulate --trace`` writes the simulated timeline, both runtimes
record the measured one with ``DS_AUTOPLAN_TRACE=dir``; every file passes the Trace Event
Format check (required keys, one named track per rank, no overlap on a track) and holds the
actions the schedule gives each rank, in its order."""
import json
import subprocess
import sys

import pytest

from ds_autoplan.schedule import Costs, Kind, build, simulate
from ds_autoplan.schedule.trace import check_trace, trace_events


def _compute(sched, rank):
    return [(a.kind.value, a.stage, a.mb) for a in sched.ranks[rank] if a.kind.is_compute]


def _events(obj, pid=None):
    return [e for e in obj["traceEvents"] if e["ph"] == "X" and (pid is None or e["pid"] == pid)]


def test_simulate_trace_is_the_simulated_timeline(tmp_path):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, "-m", "ds_autoplan", "simulate", "--compare", "1f1b,v-zb",
                    "-d", "3", "-n", "6", "--times", "1,2,1", "--trace", str(out)], check=True,
                   capture_output=True)
    obj = json.loads(out.read_text())
    tracks = check_trace(obj)
    assert sorted(tracks) == [(p, r) for p in (0, 1) for r in range(3)]     # one per rank
    names = {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "1f1b", 1: "v-zb"}
    for pid, name in names.items():
        sched = build(name, 3, 6)
        res = simulate(sched, Costs.uniform(sched, 1, 2, 1))
        evs = _events(obj, pid)
        assert len(evs) == sum(len(_compute(sched, r)) for r in range(3))
        want = {(row["rank"], f"{row['kind']}{row['stage']}.{row['mb']}"): row for row in res.timeline()}
        for e in evs:            # 1 time unit = 1 ms = 1000 us
            row = want[(e["tid"], e["name"])]
            assert e["ts"] == pytest.approx(row["start"] * 1e3)
            assert e["dur"] == pytest.approx((row["end"] - row["start"]) * 1e3)
        assert max(e["ts"] + e["dur"] for e in evs) == pytest.approx(res.makespan * 1e3)


@pytest.mark.parametrize("bad,msg", [
    ({}, "traceEvents"),
    ({"traceEvents": [{"ph": "X", "name": "F0.0", "ts": 0, "pid": 0, "tid": 0}]}, "missing dur"),
    ({"traceEvents": [{"ph": "X", "name": "F0.0", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]},
     "no thread_name"),
    ({"traceEvents": [{"ph": "B", "name": "F0.0", "ts": 0, "pid": 0, "tid": 0}]}, "phase"),
    ({"traceEvents": [{"ph": "X", "name": "F0.0", "ts": -1, "dur": 1, "pid": 0, "tid": 0}]},
     "non-negative"),
])
def test_check_trace_refuses_malformed_traces(bad, msg):
    with pytest.raises(ValueError, match=msg):
        check_trace(bad)


def test_check_trace_refuses_overlapping_actions_on_one_rank():
    rows = [{"rank": 0, "kind": "F", "stage": 0, "mb": 0, "start": 0.0, "end": 2.0},
            {"rank": 0, "kind": "F", "stage": 0, "mb": 1, "start": 1.0, "end": 3.0}]
    with pytest.raises(ValueError, match="overlap"):
        check_trace(trace_events([("x", rows)]))
    rows[1]["start"] = 2.0
    assert check_trace(trace_events([("x", rows)])) == {(0, 0): 2}


def _measured(folder, world):
    out = []
    for r in range(world):
        obj = json.loads((folder / f"trace-rank{r}.json").read_text())
        assert list(check_trace(obj)) == [(0, r)]          # this rank's one track
        out.append(_events(obj))
    return out


def _step0(events):
    return [(e["cat"], e["args"]["stage"], e["args"]["mb"]) for e in events if e["args"]["step"] == 0]


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_deepspeed_runtime_records_its_timeline(tmp_path):
    pytest.importorskip("deepspeed")
    from ds_autoplan.runtime.launch import results
    from harness import ENV
    results(["-m", "harness.ds_pipeline", "--schedules", "v-zb", "--n", "4"], 2, timeout=180,
            env={**ENV, "DS_AUTOPLAN_TRACE": str(tmp_path)})
    sched = build("v-zb", 2, 4)
    for r, events in enumerate(_measured(tmp_path, 2)):
        assert _step0(events) == _compute(sched, r)
        assert {e["args"]["step"] for e in events} >= {0, 1}        # the harness runs 2 steps


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_megatron_runtime_records_its_timeline(tmp_path):
    pytest.importorskip("megatron.core")
    from harness.megatron_cases import launch
    from harness import ENV
    launch(2, [dict(pp=2, n=4, schedule="zb-h1", layers=[1, 1])], timeout=180,
           env={**ENV, "DS_AUTOPLAN_TRACE": str(tmp_path)})
    sched = build("zb-h1", 2, 4)
    for r, events in enumerate(_measured(tmp_path, 2)):
        assert _step0(events) == _compute(sched, r)
        assert any(e["cat"] == Kind.W.value for e in events)
