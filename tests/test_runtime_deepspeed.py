"""The DeepSpeed adapter on real CPU ranks (gloo): every schedule trains exactly like the
non-pipelined model, measured activation memory matches the simulator, failures surface."""

import pytest

pytest.importorskip("deepspeed")

from harness import forked, group_fixture, joined_groups, registered  # noqa: E402

SCHEDULES = registered()        # every registered builder but the listed exclusions
TOL = 1e-5
FAIL_MODES = ["raise", "kill", "hang"]


def by_group(rows, groups: int):
    """harness.ds_pipeline's rows, ``{(schedule, rank): row}`` per option group."""
    res = [{} for _ in range(groups)]
    for d in rows:
        res[d.get("group", 0)][(d["schedule"], d.get("rank"))] = d
    return res


def pipeline_case(*groups) -> dict:
    """A launcher case running harness.ds_pipeline's option groups in one process group."""
    return {"fn": "harness.ds_pipeline:groups_case", "argv": joined_groups(groups)}


def failing_case(mode) -> dict:
    """harness.forked's case on 2 ranks: rank 1 fails (``mode``) in its third layer forward;
    rank 0's p2p waits give up after 6 s.  ``grace``: how long the other rank may take to end by
    itself after the first one failed.  Rank 1 fails first when it raises or is killed: rank 0
    must stop by itself within it.  A hung rank 1 never ends: rank 0 fails first, and rank 1 is
    killed after the grace, which then only adds to the run."""
    return dict(pipeline_case(["--schedules", "v-zb", "--n", "4", "--fail", f"1:{mode}:3"]), name=mode,
                world=2, env={"DS_AUTOPLAN_P2P_TIMEOUT": "6"}, grace=1 if mode == "hang" else 10)


@pytest.fixture(scope="module")
def launch_rows(tmp_path_factory):
    """One 4-rank launch (harness.forked).  Ranks 0 and 1, in forked children with a 2-rank
    process group of their own: each failing mode's run, then plain, ZeRO-1 with stage-aware
    recompute and DeepSpeed's uniform checkpointing ("two ranks").  Then the four ranks:
    identical blocks (uniform stages, so the paper's memory ratios apply; n = 16) for every
    schedule and TrainSchedule, then pp 2 x dp 2 with ZeRO-1 over the data-parallel replicas
    ("four ranks"), and DeepSpeed-Ulysses (:data:`ULYSSES`).  Every result row."""
    two = [failing_case(m) for m in FAIL_MODES] + [dict(pipeline_case(
        ["--schedules", ",".join(SCHEDULES), "--n", "4"],
        ["--schedules", ",".join(SCHEDULES), "--n", "4", "--zero", "1", "--recompute", "1.0"],
        ["--ds-ckpt", "1", "--n", "4", "--schedules", "ds-train,1f1b,v-zb"]), name="two ranks", world=2)]
    four = [dict(pipeline_case(["--model", "blocks", "--blocks", "8", "--n", "16", "--schedules",
                                "ds-train," + ",".join(SCHEDULES)],
                               ["--dp", "2", "--zero", "1", "--n", "4", "--schedules", "v-zb,interleaved"]),
                 name="four ranks"),
            {"name": "ulysses", "fn": "harness.ds_ulysses:cases_case", "cases": ULYSSES}]
    outs = forked.run(tmp_path_factory.mktemp("ranks"), two, four, forked.DEEPSPEED, world=4,
                      timeout=900, grace=5)
    assert all(rc == 0 for rc, _ in outs), "\n".join(out for _, out in outs)
    rows = forked.rows(outs)
    bad = [r for r in rows if r.get("forked") == "two ranks" and r.get("exit", 0) != 0]
    assert not bad, "\n".join(open(r["out"]).read() for r in bad)
    return rows


def results_of(rows, name) -> list:
    """The result rows of launcher case ``name`` (all ranks)."""
    return [d for row in rows if name in (row.get("forked"), row.get("then")) for d in row.get("rows", [])]


@pytest.fixture(scope="module")
def two_rank_groups(launch_rows):
    return by_group(results_of(launch_rows, "two ranks"), 3)


two_ranks = group_fixture("two_rank_groups", 0)
two_ranks_zero1_recompute = group_fixture("two_rank_groups", 1)
deepspeed_uniform_checkpointing = group_fixture("two_rank_groups", 2)


@pytest.fixture(scope="module")
def four_rank_groups(launch_rows):
    return by_group(results_of(launch_rows, "four ranks"), 2)


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


@pytest.mark.timeout(900)      # the first test pays for its fixture's launch
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


@pytest.mark.timeout(900)      # the first test pays for its fixture's launch
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


@pytest.mark.parametrize("mode", FAIL_MODES)
def test_failing_rank_stops_the_others(launch_rows, mode):
    (rc0, out0), (rc1, _) = [(d["exit"], open(d["out"]).read()) for r in range(2)
                             for d in launch_rows if d.get("forked") == mode and d["rank"] == r and "exit" in d]
    assert rc1 != 0
    assert rc0 not in (0, -9), out0          # rank 0 exits by itself with an error
    assert "PipelineRankError" in out0 and "pipeline rank 1" in out0, out0


# DeepSpeed-Ulysses cases (harness/ds_ulysses.py) of the 4-rank launch
ULYSSES = [{"pp": 2, "sp": 2, "n": 4, "schedule": "1f1b"},
           {"pp": 2, "sp": 2, "n": 4, "schedule": "v-half"},
           {"pp": 2, "sp": 1, "n": 4, "schedule": "1f1b"}]


def test_context_parallel_ulysses_pp2_sp2(launch_rows):
    """DeepSpeed-Ulysses (DeepSpeed's DistributedAttention) for a plan with context
    parallelism 2 on a 2-stage pipeline (4 ranks), 1F1B and V-Half: every rank holds half of
    each sequence, and the gradients and loss equal the single-process model on whole
    sequences, as those of the same pipeline without sequence parallelism (dp 2) do."""
    for case in ULYSSES:
        rows = [r for r in results_of(launch_rows, "ulysses")
                if (r["schedule"], r["sp"]) == (case["schedule"], case["sp"])]
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
