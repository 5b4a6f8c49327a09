"""The DeepSpeed adapter on real CPU ranks (gloo): every schedule trains exactly like the
non-pipelined model, measured activation memory matches the simulator, failures surface."""

import pytest

pytest.importorskip("deepspeed")

from ds_autoplan.runtime.launch import results, spawn  # noqa: E402
from harness import ENV, group_fixture, joined_groups, registered  # noqa: E402

WORKER = ["-m", "harness.ds_pipeline"]
SCHEDULES = registered()        # every registered builder but the listed exclusions
TOL = 1e-5


def run_groups(world, *groups, timeout=240):
    """Each option group's results, ``{(schedule, rank): row}`` per group: all groups in one
    process group (harness.ds_pipeline's ``--then``)."""
    res = [{} for _ in groups]
    for d in results(WORKER + joined_groups(groups), world, timeout=timeout, env=ENV):
        res[d.get("group", 0)][(d["schedule"], d.get("rank"))] = d
    return res


@pytest.fixture(scope="module")
def two_rank_groups():
    """Plain, ZeRO-1 with stage-aware recompute, DeepSpeed's uniform checkpointing: one
    2-rank process group."""
    return run_groups(2, ["--schedules", ",".join(SCHEDULES), "--n", "4"],
                      ["--schedules", ",".join(SCHEDULES), "--n", "4", "--zero", "1", "--recompute", "1.0"],
                      ["--ds-ckpt", "1", "--n", "4", "--schedules", "ds-train,1f1b,v-zb"], timeout=400)


two_ranks = group_fixture("two_rank_groups", 0)
two_ranks_zero1_recompute = group_fixture("two_rank_groups", 1)
deepspeed_uniform_checkpointing = group_fixture("two_rank_groups", 2)


@pytest.fixture(scope="module")
def four_rank_groups():
    """One 4-rank process group: identical blocks (uniform stages, so the paper's memory
    ratios apply; n = 16) for every schedule and TrainSchedule, then pp 2 x dp 2 with ZeRO-1
    over the data-parallel replicas."""
    return run_groups(4, ["--model", "blocks", "--blocks", "8", "--n", "16", "--schedules",
                          "ds-train," + ",".join(SCHEDULES)],
                      ["--dp", "2", "--zero", "1", "--n", "4", "--schedules", "v-zb,interleaved"], timeout=500)


four_ranks = group_fixture("four_rank_groups", 0)
pipeline_and_data_parallel = group_fixture("four_rank_groups", 1)


def _ranks(res, name, world):
    assert (name, None) not in res, f"schedule {name!r} is not registered"
    return [res[(name, r)] for r in range(world)]


def _check_equal_and_memory(rows):
    for d in rows:
        assert d["loss_err"] <= TOL, d
        assert d["param_err"] <= TOL, d
        assert d["eval_err"] <= TOL, d
        assert abs(d["peak"] - d["sim_peak"]) <= 0.10 * d["sim_peak"], d


@pytest.mark.parametrize("name", SCHEDULES)
def test_two_ranks_equal_to_unpipelined(two_ranks, name):
    _check_equal_and_memory(_ranks(two_ranks, name, 2))


def test_plan_partition_and_placement_are_honoured(two_ranks):
    # 8 layers, plan layers_per_stage [3, 5] (harness/ds_pipeline.py makes 2-stage plans uneven on purpose)
    assert [d["layers"] for d in _ranks(two_ranks, "1f1b", 2)] == [[0, 1, 2], [3, 4, 5, 6, 7]]
    # V placement: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (2 layers each)
    assert [d["layers"] for d in _ranks(two_ranks, "v-zb", 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # interleaved: stage s on rank s mod 2
    assert [d["layers"] for d in _ranks(two_ranks, "interleaved", 2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_add_recompute_and_parts():
    from ds_autoplan.runtime.deepspeed.module import PartitionError, parts_from
    from ds_autoplan.schedule import Kind, build, validate
    from ds_autoplan.schedule.passes import add_recompute
    s = add_recompute(build("1f1b", 2, 3), [2, 0])
    validate(s)
    assert s.meta["recompute_layers"] == [2, 0]
    r0 = [a.short() for a in s.ranks[0]]
    assert r0.count("R0.0") == 1 and r0.index("R0.0") + 1 == r0.index("BW0.0")
    assert not any(a.kind == Kind.R for a in s.ranks[1])
    assert parts_from([3, 5], 8) == [0, 3, 8]
    assert parts_from([2, 4], 8) == [0, 3, 8]          # blocks-only counts: + embedding, + head
    with pytest.raises(PartitionError):
        parts_from([2, 2], 8)


@pytest.mark.parametrize("name", SCHEDULES)
def test_two_ranks_zero1_and_stage_aware_recompute(two_ranks_zero1_recompute, name):
    _check_equal_and_memory(_ranks(two_ranks_zero1_recompute, name, 2))


def test_recompute_lowers_memory(two_ranks, two_ranks_zero1_recompute):
    plain = max(d["peak"] for d in _ranks(two_ranks, "interleaved", 2))
    rec = max(d["peak"] for d in _ranks(two_ranks_zero1_recompute, "interleaved", 2))
    assert rec < 0.8 * plain


@pytest.mark.parametrize("name", SCHEDULES)
def test_four_ranks_equal_to_unpipelined(four_ranks, name):
    _check_equal_and_memory(_ranks(four_ranks, name, 4))


@pytest.mark.parametrize("name", ["v-zb", "interleaved"])
def test_pipeline_with_data_parallel(pipeline_and_data_parallel, name):
    rows = _ranks(pipeline_and_data_parallel, name, 4)
    _check_equal_and_memory(rows)
    assert sorted(d["dp_rank"] for d in rows) == [0, 0, 1, 1]


@pytest.mark.parametrize("name", ["1f1b", "v-zb"])
def test_deepspeed_uniform_checkpointing_baseline(deepspeed_uniform_checkpointing, two_ranks, name):
    rows = _ranks(deepspeed_uniform_checkpointing, name, 2)
    for d in rows:
        assert d["loss_err"] <= TOL and d["param_err"] <= TOL and d["eval_err"] <= TOL, d
    # checkpointing every layer keeps only layer inputs: less than without it
    assert max(d["peak"] for d in rows) < max(d["peak"] for d in _ranks(two_ranks, name, 2))


@pytest.mark.parametrize("name,ratio", [("v-min", 0.5), ("v-half", 0.75)])
def test_four_ranks_v_memory_vs_trainschedule(four_ranks, name, ratio):
    # docs/schedules.md §2.5: floor((d+4)/3)/d = 0.5 and floor((d+2)/2)/d = 0.75 of TrainSchedule's peak, d = 4
    base = max(d["peak"] for d in _ranks(four_ranks, "ds-train", 4))
    ours = max(d["peak"] for d in _ranks(four_ranks, name, 4))
    assert abs(ours / base - ratio) <= 0.1 * ratio, (ours, base)


def test_our_1f1b_matches_deepspeed_trainschedule(four_ranks):
    for a, b in zip(_ranks(four_ranks, "1f1b", 4), _ranks(four_ranks, "ds-train", 4)):
        assert a["losses"] == b["losses"]
        assert a["peak"] == b["peak"]


@pytest.mark.parametrize("mode", ["raise", "kill", "hang"])
def test_failing_rank_stops_the_others(mode):
    # grace: how long the launcher lets the other rank exit after the first one failed.
    # Rank 1 fails first when it raises or is killed: rank 0 must stop by itself within it.
    # A hung rank 1 never exits: rank 0 fails first (its p2p wait gives up after 6 s) and
    # rank 1 is killed after the grace, which then only adds to the run.
    outs = spawn(WORKER + ["--schedules", "v-zb", "--n", "4", "--fail", f"1:{mode}:3"], 2,
                 timeout=120, grace=1 if mode == "hang" else 10,
                 env={**ENV, "DS_AUTOPLAN_P2P_TIMEOUT": "6"})
    (rc0, out0), (rc1, _) = outs
    assert rc1 != 0
    assert rc0 not in (0, -9), out0[-3000:]          # rank 0 exits by itself with an error
    assert "PipelineRankError" in out0 and "pipeline rank 1" in out0, out0[-3000:]


@pytest.mark.timeout(360)
def test_context_parallel_ulysses_pp2_sp2(tmp_path):
    """DeepSpeed-Ulysses (DeepSpeed's DistributedAttention) for a plan with context
    parallelism 2 on a 2-stage pipeline (4 ranks), 1F1B and V-Half: every rank holds half of
    each sequence, and the gradients and loss equal the single-process model on whole
    sequences, as those of the same pipeline without sequence parallelism (dp 2) do."""
    import json
    from ds_autoplan.runtime.launch import per_rank_results
    cases = [{"pp": 2, "sp": 2, "n": 4, "schedule": "1f1b"},
             {"pp": 2, "sp": 2, "n": 4, "schedule": "v-half"},
             {"pp": 2, "sp": 1, "n": 4, "schedule": "1f1b"}]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    out = per_rank_results(["-m", "harness.ds_ulysses", str(path)], 4, timeout=320, env=ENV)
    for i, case in enumerate(cases):
        rows = [o[i] for o in out]
        assert sorted(r["stage"] for r in rows) == [0, 0, 1, 1]
        for r in rows:
            assert r["sp_group_size"] == case["sp"]
            assert r["tokens_per_rank"] == 2 * 8 // case["sp"]       # micro-batch 2 x seq 8
            # blocks on this rank: 4 blocks over 2 ranks, each attention core distributed
            assert r["distributed_attention"] == (2 if case["sp"] > 1 else 0)
            assert r["max_grad_err"] <= 1e-6 and r["max_grad"] > 1e-3, r
            assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-6)
            assert r["train_batch_size"] == 2 * 4 * 2     # the engine counts dp x sp data ranks


def test_context_parallel_ulysses_batch_size_counts_sequence_shards():
    """The pipeline engine counts dp x cp data-axis ranks (DeepSpeed's config reads the grid's
    data-parallel size): the config initialize runs has train_batch_size = global batch x cp,
    whether it comes from the plan or from the emitted ds_config.json given as the config."""
    from ds_autoplan.emit.deepspeed import ds_config
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.deepspeed.api import config_from_plan
    plan = Plan(pp=2, cp=2, dp=1, micro_batch_size=2, num_microbatches=4, precision="fp32",
                layers_per_stage=[2, 2], recompute_per_stage=[0.0, 0.0])
    for cfg in (config_from_plan(plan), config_from_plan(plan, ds_config(plan))):
        assert cfg["train_batch_size"] == 2 * 4 * 1 * 2
        assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"]
                                           * cfg["gradient_accumulation_steps"] * 2)
    assert config_from_plan(Plan(pp=2, dp=2, micro_batch_size=2, num_microbatches=4,
                                 layers_per_stage=[2, 2], recompute_per_stage=[0.0, 0.0])
                            )["train_batch_size"] == 16
