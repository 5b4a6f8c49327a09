"""DynaPipe's dynamic micro-batches in the DeepSpeed runtime: per-iteration plans
with different micro-batch counts and padded lengths train exactly like the unpipelined
model on the same samples, with the plan's shapes (no shape handshake), ZeRO-0/1, DP."""
import json
import pathlib
import types

import pytest
import torch

pytest.importorskip("deepspeed")

from ds_autoplan.runtime.launch import results, spawn  # noqa: E402
from harness import ENV, group_fixture, joined_groups  # noqa: E402

WORKER = ["-m", "harness.ds_dynamic"]
TOL = 1e-5
# SCHEDULE:ZERO:LOSS-WEIGHT[:RECOMPUTE]; the first four must equal the unpipelined run
RUNS = ["dynapipe:0:tokens", "dynapipe:1:tokens", "1f1b:0:tokens", "dynapipe:1:tokens:1.0",
        "dynapipe:0:samples", "dynapipe:0:uniform"]


KW = dict(grace=20, env={**ENV, "DS_AUTOPLAN_P2P_TIMEOUT": "30"})


def run_groups(world, *groups, timeout=150):
    """Each option group's rows, ``{"SCHEDULE:ZERO:WEIGHT[:RECOMPUTE]": [row per rank]}`` per
    group: all groups in one process group (harness.ds_dynamic's ``--then``)."""
    res = [{} for _ in groups]
    for d in results(WORKER + joined_groups(groups), world, timeout=timeout, **KW):
        key = f"{d['schedule']}:{d['zero']}:{d['weight']}"
        key += f":{d['recompute']}" if d["recompute"] else ""
        res[d["group"]].setdefault(key, []).append(d)
    return res


@pytest.fixture(scope="module")
def two_ranks():
    # 12 samples per step from the real length distribution, max length 256
    return run_groups(2, ["--runs", ",".join(RUNS), "--misuse"])[0]


@pytest.fixture(scope="module")
def four_rank_groups():
    """One 4-rank process group: pp 2 x dp 2 with ZeRO-1, each replica planning its own share
    (its own micro-batch count); then pp 4, whose middle ranks read no data and still know
    every shape from the plan."""
    return run_groups(4, ["--dp", "2", "--gbs", "16", "--runs", "dynapipe:1:tokens"],
                      ["--blocks", "6", "--gbs", "16", "--runs", "dynapipe:0:tokens"], timeout=300)


pipeline_and_data_parallel = group_fixture("four_rank_groups", 0)
four_stages = group_fixture("four_rank_groups", 1)


def _equal(rows):
    for d in rows:
        assert d["loss_err"] <= TOL and d["param_err"] <= TOL, d
        assert d["moved"] > 1e-4, d                    # the optimizer really stepped
        assert d["handshakes"] == 0, d                 # shapes came from the plan


@pytest.mark.parametrize("run", RUNS[:4])
def test_dynamic_plans_equal_to_unpipelined(two_ranks, run):
    rows = two_ranks[run]
    assert len(rows) == 2
    _equal(rows)
    shapes = rows[0]["shapes"]
    assert rows[1]["shapes"] == shapes                 # both pipeline ranks ran the same plan
    # the two iterations differ in micro-batch count and padded lengths; sizes are unequal
    assert len(shapes[0]) != len(shapes[1])
    assert {L for _, L in shapes[0]} != {L for _, L in shapes[1]}
    assert all(len({m for m, _ in st}) > 1 and len({L for _, L in st}) > 1 for st in shapes)
    assert rows[0]["gas"] == len(shapes[-1])           # DeepSpeed's accumulation count followed
    assert all((d["recomputed_layers"] > 0) == run.endswith(":1.0") for d in rows)


def test_loss_weights_matter(two_ranks):
    # samples-weighted and DeepSpeed's 1/num_microbatches weighting of token-mean losses are
    # *not* the unpipelined token-mean gradient: the token weighting is what makes it exact
    for run in ("dynapipe:0:samples", "dynapipe:0:uniform"):
        for d in two_ranks[run]:
            assert d["param_err"] > 100 * TOL and d["loss_err"] > 10 * TOL, d


def test_misuse_is_reported(two_ranks):
    for d in two_ranks["dynapipe:0:tokens"]:
        assert "placement" in d["errors"]["placement"]
        assert "the plan says" in d["errors"]["shape"]
        assert "different iteration plans" in d["errors"]["mismatch"]


def test_pipeline_with_data_parallel_replicas_of_different_plans(pipeline_and_data_parallel):
    rows = pipeline_and_data_parallel["dynapipe:1:tokens"]
    assert sorted(d["dp_rank"] for d in rows) == [0, 0, 1, 1]
    _equal(rows)
    by_replica = {d["dp_rank"]: d["shapes"] for d in rows}
    assert by_replica[0] != by_replica[1]


def test_loss_factors_weight_by_share_of_tokens():
    from ds_autoplan.runtime.deepspeed.dynamic import gpt_shapes, loss_factors
    eng = types.SimpleNamespace(dp_world_size=1)
    y1 = torch.tensor([[1, 2, -100, -100]])            # 2 tokens
    y2 = torch.tensor([[1, 2, 3, 4], [5, 6, -100, -100]])  # 6 tokens
    f = loss_factors(eng, [(None, y1), (None, y2)])
    # DeepSpeed divides by gradient_accumulation_steps = 2: effective weights 2/8 and 6/8
    assert f == pytest.approx([2 * 2 / 8, 2 * 6 / 8])
    assert loss_factors(eng, [(None, y1), (None, y2)], "samples") == pytest.approx([2 / 3, 4 / 3])
    assert loss_factors(eng, [None, None], [1.0, 3.0]) == pytest.approx([0.5, 1.5])
    with pytest.raises(ValueError):
        loss_factors(eng, [(None, torch.full((1, 3), -100))])
    assert gpt_shapes(16, torch.float32)(1, (3, 40)) == (True, [(torch.float32, (3, 40, 16))])
    with pytest.raises(ValueError):
        gpt_shapes(16, torch.float32)(1, (3, (40, 8)))


def test_four_stage_pipeline(four_stages):
    rows = four_stages["dynapipe:0:tokens"]
    assert len(rows) == 4
    _equal(rows)
    assert len({json.dumps(d["shapes"]) for d in rows}) == 1


def test_example_trains_on_two_ranks():
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_dynamic.py"
    outs = spawn([str(script), "--steps", "2", "--global-batch", "12"], 2, timeout=150, **KW)
    assert all(rc == 0 for rc, _ in outs), outs[0][1]
    lines = [ln for ln in outs[0][1].splitlines() if ln.startswith("step ")]
    assert len(lines) == 2 and all("micro-batches" in ln for ln in lines), outs[0][1]
