"""Re-plan and resume (issue 13, item 6): a checkpoint saved under plan A loads under plan B
(other schedule, partition, pp, dp, ZeRO stage) and training continues exactly as the
uninterrupted run under A (fp32, Adam: the optimizer state must travel too).  Batched into
one 2-rank and one 4-rank process group; the 4-rank group also loads a checkpoint the 2-rank
group wrote (pp2 dp1 -> pp2 dp2, pp2 -> pp4)."""
import json
import pathlib

import pytest

pytest.importorskip("deepspeed")

from ds_autoplan.runtime.deepspeed.spawn import results  # noqa: E402

WORKER = str(pathlib.Path(__file__).with_name("resume_deepspeed.py"))
TOL = 1e-6


def spec(schedule, pp=2, dp=1, zero=0):
    return {"schedule": schedule, "pp": pp, "dp": dp, "zero": zero}


def _run(world, cases, tmp, timeout):
    path = tmp / f"cases{world}.json"
    path.write_text(json.dumps(cases))
    rows = results([WORKER, str(path)], world, timeout=timeout)
    return {(r["name"], r["rank"]): r for r in rows}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def two_ranks(ckpt):
    cases = [dict(name="v-half->1f1b", dir=str(ckpt / "vhalf"), a=spec("v-half"), b=spec("1f1b")),
             dict(name="1f1b->v-zb", dir=str(ckpt / "pp2dp1"), a=spec("1f1b"), b=spec("v-zb"))]
    return _run(2, cases, ckpt, 300)


@pytest.fixture(scope="module")
def four_ranks(ckpt, two_ranks):
    pp2dp1 = str(ckpt / "pp2dp1")        # written by the 2-rank group
    cases = [dict(name="pp2 dp1->pp2 dp2", dir=pp2dp1, b=spec("1f1b", dp=2)),
             dict(name="pp2->pp4", dir=pp2dp1, b=spec("1f1b", pp=4)),
             dict(name="ZeRO-0->ZeRO-1", dir=str(ckpt / "zero0"), a=spec("1f1b", dp=2),
                  b=spec("1f1b", dp=2, zero=1)),
             dict(name="pp2 ZeRO-1->pp4 ZeRO-0", dir=str(ckpt / "zero1"),
                  a=spec("v-half", dp=2, zero=1), b=spec("1f1b", pp=4))]
    return _run(4, cases, ckpt, 400)


def _close(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOL


@pytest.mark.parametrize("name", ["v-half->1f1b", "1f1b->v-zb"])
def test_resume_under_another_schedule_two_ranks(two_ranks, name):
    for r in range(2):
        row = two_ranks[(name, r)]
        assert _close(row["resumed"], row["uninterrupted"][3:]), row
        assert row["saved_under"] == name.split("->")[0]
    # the partitions really differ: V placement vs sequential stages
    assert two_ranks[("v-half->1f1b", 0)]["layers"] != two_ranks[("1f1b->v-zb", 0)]["layers"]


@pytest.mark.parametrize("name", ["pp2 dp1->pp2 dp2", "pp2->pp4"])
def test_resume_on_more_ranks(two_ranks, four_ranks, name):
    want = two_ranks[("1f1b->v-zb", 0)]["uninterrupted"][3:]      # uninterrupted run, 2 ranks
    for r in range(4):
        assert _close(four_ranks[(name, r)]["resumed"], want), four_ranks[(name, r)]


@pytest.mark.parametrize("name", ["ZeRO-0->ZeRO-1", "pp2 ZeRO-1->pp4 ZeRO-0"])
def test_resume_across_zero_stages(four_ranks, name):
    for r in range(4):
        row = four_ranks[(name, r)]
        assert _close(row["resumed"], row["uninterrupted"][3:]), row
    # the pp4 plan holds fewer layers per rank than the pp2 plan it was saved under
    assert len(four_ranks[("pp2->pp4", 0)]["layers"]) < len(four_ranks[("pp2 dp1->pp2 dp2", 0)]["layers"])


def test_checkpoint_info_names_the_plan(two_ranks, ckpt, capsys):
    from ds_autoplan.cli import main
    assert main(["checkpoint", "info", str(ckpt / "vhalf")]) == 0
    out = capsys.readouterr().out
    assert "deepspeed, step 3, 8 layers" in out
    assert "schedule v-half" in out and "pp 2 tp 1 dp 1, ZeRO 0, fp32" in out
    assert main(["checkpoint", "info", "--json", str(ckpt / "vhalf")]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["plan"]["layers_per_stage"] == [2, 2, 1, 1] and meta["optimizer"]["class"] == "Adam"


def test_not_a_checkpoint_is_one_clear_error(tmp_path, capsys):
    from ds_autoplan.cli import main
    assert main(["checkpoint", "info", str(tmp_path)]) == 2
    assert "is not a ds_autoplan checkpoint" in capsys.readouterr().err


def test_wrong_framework_or_model_is_refused(two_ranks, ckpt):
    from ds_autoplan.runtime.checkpoint import CheckpointError, read_meta
    with pytest.raises(CheckpointError, match="saved by the deepspeed runtime"):
        read_meta(ckpt / "vhalf", framework="megatron")
    with pytest.raises(CheckpointError, match="8 layers, this model has 10"):
        read_meta(ckpt / "vhalf", framework="deepspeed", num_layers=10)
