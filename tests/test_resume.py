"""Re-plan and resume: a checkpoint saved under plan A loads under plan B
(other schedule, partition, pp, dp, ZeRO stage) and training continues exactly as the
uninterrupted run under A (fp32, Adam: the optimizer state must travel too).  Per framework
one 2-rank and one 4-rank process group (all in one launch); the 4-rank group also loads a
checkpoint the 2-rank group wrote (pp2 dp1 -> pp2 dp2, pp2 -> pp4).  With a warm-up/decay learning-rate scheduler
(DeepSpeed's WarmupDecayLR, Megatron-core's OptimizerParamScheduler) the learning rates continue
too; with dropout, a resume under the same plan draws the same masks (each rank's generators are
saved).  DeepSpeed: tests/resume_deepspeed.py (also through ``engine.save_checkpoint`` /
``engine.load_checkpoint``); Megatron-core (its DDP, optimizer and dist_checkpointing):
tests/resume_megatron.py."""
import json
import pathlib

import pytest

pytest.importorskip("deepspeed")

from resume_deepspeed import SCHEDULER  # noqa: E402  (the workers' WarmupDecayLR config)

DS_CASES = str(pathlib.Path(__file__).with_name("resume_deepspeed.py")) + ":cases_case"
MEGATRON_CASES = str(pathlib.Path(__file__).with_name("resume_megatron.py")) + ":resume_cases"
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_deepspeed.py"
TOL = 1e-6
SCHED = "v-half->1f1b warm-up/decay lr"
DROPOUT = "v-half->v-half dropout"


def spec(schedule, pp=2, dp=1, zero=0, sched=False, dropout=0.0):
    return {"schedule": schedule, "pp": pp, "dp": dp, "zero": zero, "sched": sched, "dropout": dropout}


def cases(ckpt, world, tag):
    """The A -> B cases of one process group; ``tag`` keeps each framework's folders apart.
    The 4-rank group loads the pp2 dp1 checkpoint the 2-rank group wrote."""
    def d(name):
        return str(ckpt / f"{tag}-{name}")
    if world == 2:
        return [dict(name="v-half->1f1b", dir=d("vhalf"), a=spec("v-half"), b=spec("1f1b")),
                dict(name="1f1b->v-zb", dir=d("pp2dp1"), a=spec("1f1b"), b=spec("v-zb")),
                # DeepSpeed: through engine.save_checkpoint / engine.load_checkpoint
                dict(name=SCHED, dir=d("sched"), a=spec("v-half", sched=True), b=spec("1f1b", sched=True),
                     api="engine"),
                dict(name=DROPOUT, dir=d("dropout"), a=spec("v-half", dropout=0.2),
                     b=spec("v-half", dropout=0.2))]
    return [dict(name="pp2 dp1->pp2 dp2", dir=d("pp2dp1"), b=spec("1f1b", dp=2)),
            dict(name="pp2->pp4", dir=d("pp2dp1"), b=spec("1f1b", pp=4)),
            # Megatron: ZeRO-1 = its DistributedOptimizer
            dict(name="ZeRO-0->ZeRO-1", dir=d("zero0"), a=spec("1f1b", dp=2, sched=True),
                 b=spec("1f1b", dp=2, zero=1, sched=True)),
            dict(name="pp2 ZeRO-1->pp4 ZeRO-0", dir=d("zero1"), a=spec("v-half", dp=2, zero=1, sched=True),
                 b=spec("1f1b", pp=4, sched=True))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def groups(ckpt):
    """One 4-rank launch (tests/harness/forked.py): ranks 0 and 1 run both frameworks' 2-rank
    cases in forked children (a 2-rank process group of their own), then the four ranks run
    the 4-rank cases, which load checkpoints the 2-rank ones wrote.  Per group ("ds2", "ds4",
    "m2", "m4"), ``{(case name, rank): row}``."""
    import importlib.util

    from harness import forked
    megatron = importlib.util.find_spec("megatron.core") is not None
    two = [{"name": "ds2", "fn": DS_CASES, "cases": cases(ckpt, 2, "ds"), "world": 2}]
    four = [{"name": "ds4", "fn": DS_CASES, "cases": cases(ckpt, 4, "ds")}]
    if megatron:
        two.append({"name": "m2", "fn": MEGATRON_CASES, "cases": cases(ckpt, 2, "m"), "world": 2})
        four.append({"name": "m4", "fn": MEGATRON_CASES, "cases": cases(ckpt, 4, "m")})
    outs = forked.run(ckpt, two, four, forked.DEEPSPEED + (forked.MEGATRON if megatron else []),
                      world=4, timeout=1200, grace=5)
    assert all(rc == 0 for rc, _ in outs), "\n".join(out for _, out in outs)
    rows = forked.rows(outs)
    bad = [r for r in rows if r.get("exit", 0) != 0]
    assert not bad, "\n".join(open(r["out"]).read() for r in bad)
    res: dict = {}
    for row in rows:
        if "rows" in row:
            res.setdefault(row.get("forked") or row["then"], {}).update(
                {(r["name"], r["rank"]): r for r in row["rows"]})
    return res


@pytest.fixture(scope="module")
def two_ranks(groups):
    return groups["ds2"]


@pytest.fixture(scope="module")
def four_ranks(groups):
    return groups["ds4"]


@pytest.fixture(scope="module")
def megatron_two_ranks(groups):
    if "m2" not in groups:       # (not imported here: seconds, for a name)
        pytest.skip("megatron-core is not installed")
    return groups["m2"]


@pytest.fixture(scope="module")
def megatron_four_ranks(groups):
    if "m4" not in groups:
        pytest.skip("megatron-core is not installed")
    return groups["m4"]


def _close(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= TOL


def _assert_resumed(res, name, world, want=None):
    """Every rank's resumed losses equal ``want`` (default: its own uninterrupted run's), and so
    do the learning rates its steps ran at."""
    for r in range(world):
        row = res[(name, r)]
        assert _close(row["resumed"], want or row["uninterrupted"][3:]), row
        if row.get("lr_a"):
            assert _close(row["lr_b"], row["lr_a"][3:]), row


@pytest.mark.timeout(900)      # the first test pays for the fixture's launch
@pytest.mark.parametrize("name", ["v-half->1f1b", "1f1b->v-zb"])
def test_resume_under_another_schedule_two_ranks(two_ranks, name):
    _assert_resumed(two_ranks, name, 2)
    assert two_ranks[(name, 0)]["saved_under"] == name.split("->")[0]
    # the partitions really differ: V placement vs sequential stages
    assert two_ranks[("v-half->1f1b", 0)]["layers"] != two_ranks[("1f1b->v-zb", 0)]["layers"]


@pytest.mark.parametrize("name", ["pp2 dp1->pp2 dp2", "pp2->pp4"])
def test_resume_on_more_ranks(two_ranks, four_ranks, name):
    # against the uninterrupted run on 2 ranks
    _assert_resumed(four_ranks, name, 4, two_ranks[("1f1b->v-zb", 0)]["uninterrupted"][3:])
    # pp4 holds fewer layers per rank than the pp2 plan the checkpoint was saved under
    assert four_ranks[("pp2->pp4", 0)]["layers"] == [0, 1, 2]
    assert four_ranks[("pp2 dp1->pp2 dp2", 0)]["layers"] == [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["ZeRO-0->ZeRO-1", "pp2 ZeRO-1->pp4 ZeRO-0"])
@pytest.mark.parametrize("group", ["four_ranks", "megatron_four_ranks"])
def test_resume_across_zero_stages(request, group, name):
    res = request.getfixturevalue(group)
    _assert_resumed(res, name, 4)
    lrs = res[(name, 0)]["lr_a"]                    # the scheduler changes the rate each step
    assert len(set(lrs[3:])) == 3 and not set(lrs[3:]) & set(lrs[:3]), lrs


@pytest.mark.parametrize("group", ["two_ranks", "megatron_two_ranks"])
def test_scheduler_continues_under_another_plan(request, group):
    """Losses and learning rates of V-Half -> 1F1B with a warm-up/decay scheduler equal the
    uninterrupted run's; a restarted schedule would run steps 4-6 at the rates of steps 1-3."""
    res = request.getfixturevalue(group)
    _assert_resumed(res, SCHED, 2)
    lrs = res[(SCHED, 0)]["lr_a"]
    assert len(set(lrs[3:])) == 3 and not set(lrs[3:]) & set(lrs[:3]), lrs
    # DeepSpeed: each rank gets back the client_state it saved (as DeepSpeed's engine does)
    assert all(res[(SCHED, r)]["client_state"] == ({"epoch": 7, "rank": r} if group == "two_ranks"
                                                   else {"epoch": 7}) for r in range(2))


def test_engine_checkpoint_methods(two_ranks, ckpt):
    """engine.save_checkpoint / engine.load_checkpoint keep DeepSpeed's signature and layout
    (tag folder, ``latest``, each rank's own client_state returned, step counters), and
    load under another plan; what they cannot do is refused by name."""
    assert (ckpt / "ds-sched" / "latest").read_text() == "global_step3"
    for r in range(2):
        row = two_ranks[(SCHED, r)]
        assert row["load_path"] == str(ckpt / "ds-sched" / "global_step3")
        assert row["counters"] == [3, 3 * 8, 0]           # global_steps, global_samples, skipped
        assert row["no_checkpoint"] == [None, None]       # as DeepSpeed: no latest, no tag
        assert "exclude_frozen_parameters=True is not supported" in row["refused"]
        assert row["module_only"] == {} and row["module_only_steps"] == 0   # weights only
    from ds_autoplan.runtime.checkpoint import CheckpointError, read_meta
    with pytest.raises(CheckpointError, match="its latest checkpoint is .*global_step3"):
        read_meta(ckpt / "ds-sched")
    meta = read_meta(ckpt / "ds-sched" / "global_step3")
    assert meta["lr_scheduler"] == "WarmupDecayLR" and meta["step"] == 3
    assert meta["counters"] == {"global_samples": 24, "skipped_steps": 0} and meta["world_size"] == 2


def test_deepspeeds_own_checkpoint_is_refused(tmp_path):
    from ds_autoplan.runtime.checkpoint import CheckpointError
    from ds_autoplan.runtime.deepspeed.checkpoint import _refuse_native
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="checkpoint of DeepSpeed's own engine"):
        _refuse_native(str(tmp_path))


@pytest.mark.parametrize("group", ["two_ranks", "megatron_two_ranks"])
def test_dropout_is_reproduced_under_the_same_plan(request, group):
    """Each rank's generators are saved: a resume draws the uninterrupted run's dropout masks
    (plan B starts from another seed, so without them the losses differ)."""
    res = request.getfixturevalue(group)
    _assert_resumed(res, DROPOUT, 2)
    # dropout is really on: the same plan without it (same weights, data) trains differently
    plain = "v-half->1f1b"
    assert not _close(res[(DROPOUT, 0)]["uninterrupted"], res[(plain, 0)]["uninterrupted"])


def test_host_generators_continue(two_ranks, four_ranks):
    """Python's and NumPy's global generators are saved per rank: after a load, rank r draws
    what saved rank r mod (saved world) drew after the save (plan B seeded them otherwise)."""
    saved = {r: two_ranks[("1f1b->v-zb", r)]["host_draws_a"] for r in range(2)}
    for name in ("v-half->1f1b", "1f1b->v-zb", SCHED, DROPOUT):
        for r in range(2):
            row = two_ranks[(name, r)]
            assert row["host_draws_b"] == row["host_draws_a"], (name, r)
    assert [four_ranks[("pp2->pp4", r)]["host_draws_b"] for r in range(4)] == \
        [saved[r % 2] for r in range(4)]
    assert saved[0] != saved[1]


def test_checkpoint_info_names_the_plan(two_ranks, ckpt, capsys):
    from ds_autoplan.cli import main
    assert main(["checkpoint", "info", str(ckpt / "ds-vhalf")]) == 0
    out = capsys.readouterr().out
    assert "deepspeed, step 3, 8 layers" in out
    assert "schedule v-half" in out and "pp 2 tp 1 dp 1, ZeRO 0, fp32" in out
    assert main(["checkpoint", "info", "--json", str(ckpt / "ds-vhalf")]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["plan"]["layers_per_stage"] == [2, 2, 1, 1] and meta["optimizer"]["class"] == "Adam"


def test_not_a_checkpoint_is_one_clear_error(tmp_path, capsys):
    from ds_autoplan.cli import main
    assert main(["checkpoint", "info", str(tmp_path)]) == 2
    assert "is not a ds_autoplan checkpoint" in capsys.readouterr().err


def test_wrong_framework_or_model_is_refused(two_ranks, ckpt):
    from ds_autoplan.runtime.checkpoint import CheckpointError, read_meta
    with pytest.raises(CheckpointError, match="saved by the deepspeed runtime"):
        read_meta(ckpt / "ds-vhalf", framework="megatron")
    with pytest.raises(CheckpointError, match="8 layers, this model has 10"):
        read_meta(ckpt / "ds-vhalf", framework="deepspeed", num_layers=10)


@pytest.mark.parametrize("name", ["v-half->1f1b", "1f1b->v-zb"])
def test_megatron_resume_under_another_schedule(megatron_two_ranks, name):
    _assert_resumed(megatron_two_ranks, name, 2)
    assert megatron_two_ranks[(name, 0)]["saved_under"] == name.split("->")[0]
    # V placement: rank 0 holds the first and the last stage
    assert megatron_two_ranks[("1f1b->v-zb", 0)]["stages"] == [0, 3]


@pytest.mark.parametrize("name", ["pp2 dp1->pp2 dp2", "pp2->pp4"])
def test_megatron_resume_on_more_ranks(megatron_two_ranks, megatron_four_ranks, name):
    _assert_resumed(megatron_four_ranks, name, 4,
                    megatron_two_ranks[("1f1b->v-zb", 0)]["uninterrupted"][3:])


@pytest.mark.parametrize("group", ["four_ranks", "megatron_four_ranks"])
def test_more_ranks_continue_the_saved_generators(request, group):
    """4 ranks resuming a 2-rank checkpoint: rank r continues saved rank r mod 2's generators."""
    res = request.getfixturevalue(group)
    assert [res[("pp2->pp4", r)]["rng_from"] for r in range(4)] == [0, 1, 0, 1]


def test_megatron_pp4_holds_one_stage_per_rank(megatron_four_ranks):
    assert [megatron_four_ranks[("pp2->pp4", r)]["stages"] for r in range(4)] == [[0], [1], [2], [3]]


def test_checkpoint_info_names_the_megatron_plan(megatron_two_ranks, ckpt, capsys):
    from ds_autoplan.cli import main
    assert main(["checkpoint", "info", str(ckpt / "m-vhalf")]) == 0
    out = capsys.readouterr().out
    assert "megatron, step 3, 4 layers" in out and "schedule v-half" in out
    assert main(["checkpoint", "info", str(ckpt / "m-sched")]) == 0
    assert "lr scheduler OptimizerParamScheduler" in capsys.readouterr().out


def _example(args, cfg):
    """Rank 0's output and ``(step, loss, next lr)`` of examples/train_deepspeed.py on 2 ranks."""
    from ds_autoplan.runtime.launch import spawn
    outs = spawn([str(EXAMPLE), "--deepspeed_config", str(cfg), *args], 2, timeout=240)
    assert all(rc == 0 for rc, _ in outs), outs[0][1]
    lines = outs[0][1].splitlines()
    return outs[0][1], [(float(ln.split()[1]), float(ln.split()[3]), float(nxt.split()[-1]))
                        for ln, nxt in zip(lines, lines[1:]) if ln.startswith("step ")]


def test_unchanged_user_script_resumes_under_another_schedule(tmp_path):
    """A DeepSpeed script that calls engine.save_checkpoint / engine.load_checkpoint (the
    example's --save / --load) and a WarmupDecayLR config: 2 steps under V-Half, then 2 more
    after resuming under 1F1B, equal the 4 uninterrupted V-Half steps (losses and rates)."""
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps({"scheduler": SCHEDULER}))
    _, whole = _example(["--schedule", "v-half", "--steps", "4"], cfg)
    _, first = _example(["--schedule", "v-half", "--steps", "2", "--save", str(tmp_path / "ckpt")], cfg)
    out, rest = _example(["--schedule", "1f1b", "--steps", "4", "--load", str(tmp_path / "ckpt")], cfg)
    assert f"resumed from {tmp_path / 'ckpt' / 'global_step2'} ({{'schedule': 'v-half'}}) at step 2" in out
    assert [s for s, _, _ in first + rest] == [0, 1, 2, 3]
    # printed to 6 decimals: 1e-6 apart (the workers' tolerance) may print up to 2e-6 apart
    assert max(abs(a - b) for x, y in zip(whole, first + rest, strict=True) for a, b in zip(x, y)) <= 3e-6
    assert len({lr for _, _, lr in whole}) == 4            # the schedule moves the rate every step


def test_scheduler_and_parameter_group_mismatches_are_refused():
    import torch

    from ds_autoplan.runtime.checkpoint import CheckpointError, load_scheduler, restore_param_groups
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(CheckpointError, match="saved without a learning-rate scheduler.*"
                                              "load_lr_scheduler_states=False"):
        load_scheduler(sched, {"scheduler": None}, "ckpt")
    load_scheduler(None, {"scheduler": {"last_epoch": 3}}, "ckpt")     # no scheduler: nothing to do
    restore_param_groups(opt, [{"lr": 0.5}, {"lr": 0.5}], "ckpt")       # one shared setting
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(CheckpointError, match="2 parameter groups with different settings"):
        restore_param_groups(opt, [{"lr": 0.5}, {"lr": 0.25}], "ckpt")
