"""A stage whose first layer works in place (nn.ReLU(inplace=True)) trains in ds_autoplan's
DeepSpeed engine: received activations are cloned before the stage runs, as DeepSpeed does."""
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from ds_autoplan.runtime.launch import results  # noqa: E402

WORKER = str(Path(__file__).with_name("ds_inplace_worker.py"))


def test_in_place_first_layer_trains_exactly():
    rows = results([WORKER, "1f1b", "v-zb"], 2, timeout=240)
    assert {(d["schedule"], d["rank"]) for d in rows} == {(s, r) for s in ("1f1b", "v-zb") for r in (0, 1)}
    for d in rows:
        assert d["loss_err"] <= 1e-6, d
