"""The run's record (``measured.json``, runtime/common/record.py) a test's run wrote, checked
as ``ds-autoplan calibrate`` reads it, against the plan beside it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def run_record(folder, runtime: str, counted_steps: int = 2) -> dict:
    """``folder``'s measured.json: a record ``calibrate`` accepts (cost/calibrate.check_record)
    of the plan.json beside it (sha256, pipeline degree), written by ``runtime`` over
    ``counted_steps`` steps after the warm-up, with a positive measured iteration and peak per
    pipeline rank and each compute action of every counted step counted."""
    from ds_autoplan.cost.calibrate import check_record
    folder = Path(folder)
    plan_bytes = (folder / "plan.json").read_bytes()
    plan = json.loads(plan_bytes)
    rec = check_record(json.loads((folder / "measured.json").read_text()), str(folder), plan["pp"])
    assert rec["runtime"] == runtime, rec["runtime"]
    assert rec["plan"]["sha256"] == hashlib.sha256(plan_bytes).hexdigest()
    assert rec["steps"] == counted_steps and rec["world_size"] == plan["world_size"], rec
    it = rec["iteration_time_s"]
    assert it["measured"] > 0 and it["predicted"] == plan["predicted"]["iteration_time_s"], it
    peaks = rec["peak_memory_gb"]["measured"]
    assert len(peaks) == plan["pp"] and all(p > 0 for p in peaks), rec["peak_memory_gb"]
    fwd = rec["components"]["forward"]
    assert all(c > 0 for c in fwd["count"]) and all(s > 0 for s in fwd["measured"]), fwd
    return rec
