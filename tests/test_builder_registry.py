"""The builder registry describes every builder: its placement, stages per rank,
options and fewest ranks / micro-batches agree with the schedules it builds, and callers
(search, dynamic planner) ask it instead of switching on names."""
import pytest

from ds_autoplan.schedule import ScheduleError, build, names
from ds_autoplan.schedule.builders import builder_info
from ds_autoplan.schedule.builders.dynapipe import dynapipe
from ds_autoplan.schedule.ir import interleaved_placement, sequential_placement, v_placement

PLACEMENTS = {"sequential": lambda d, o: sequential_placement(d), "v": lambda d, o: v_placement(d),
              "interleaved": lambda d, o: interleaved_placement(d, o.get("v", 2))}


def _option_sets(info, d):
    if info.chunks_option:
        return [{}, {info.chunks_option: 3}]
    if info.placement == "option":       # DynaPipe: sequential, V or any stage -> rank list
        return [{}, {"placement": "v"}, {"placement": [*range(d), *range(d)]}]
    return [{}]


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("d", [2, 3, 4])
def test_description_matches_what_the_builder_builds(name, d):
    info = builder_info(name)
    for opts in _option_sets(info, d):
        n = max(info.min_n(d), 2 * d)
        s = build(name, d, n, **opts)
        assert s.num_stages == info.num_stages(d, **opts), (name, opts)
        assert s.num_stages == d * (s.num_stages // d)
        if info.placement in PLACEMENTS:
            assert tuple(s.placement) == tuple(PLACEMENTS[info.placement](d, opts)), (name, opts)
        assert set(opts) <= set(info.options)


@pytest.mark.parametrize("name", names())
def test_fewest_ranks_and_microbatches_are_enforced(name):
    info = builder_info(name)
    d = max(info.min_d, 2)
    build(name, d, info.min_n(d))                       # the fewest micro-batches work
    if info.min_n(d) > 1:
        with pytest.raises(ScheduleError, match="micro-batches"):
            build(name, d, info.min_n(d) - 1)
    with pytest.raises(ScheduleError, match="pipeline stages/devices"):
        build(name, info.min_d - 1, 4)


def test_build_and_the_builder_agree_on_one_rank():
    # the registry's minimum d (1 for DynaPipe) is what build() checks
    assert build("dynapipe", 1, 3).ranks == dynapipe(1, 3).ranks
    assert builder_info("dynapipe").num_stages(3, placement="v") == 6
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'"):
        builder_info("nope")


def test_search_and_dynamic_planner_ask_the_registry():
    from ds_autoplan.search.pipeline import num_stages, schedule_options
    for name in names():
        info = builder_info(name)
        assert num_stages(name, 4) == info.num_stages(4, **schedule_options(name))
        assert bool(schedule_options(name)) == (info.chunks_option is not None)
    assert num_stages("interleaved", 4, v=3) == 12
    from ds_autoplan.dynamic import CostModel, IterationPlanner
    cost = CostModel.gpt(hidden=256, heads=4, layers=4, stages=2)
    for sched in ("dynapipe", "1f1b"):     # a cost-aware builder gets the split's costs
        plan = IterationPlanner(cost, 2, schedule=sched)([64, 128, 96, 32, 256, 64])
        assert plan.schedule.num_stages == 2


def test_a_new_builder_names_its_schedule_once():
    """The package docstring's worked example: the name is written in ``register`` only; the
    registered function checks d / n, names the drafted schedule and prefixes refusals."""
    from ds_autoplan.schedule.builders import registry
    from ds_autoplan.schedule.ir import Kind
    from ds_autoplan.schedule import simulate, Costs

    @registry.register("example-f-then-bw", min_n=lambda d: 2)
    def example(d, n, bad=False):
        if bad:
            raise ScheduleError("asked to fail")
        lists = [[(Kind.F, r, m) for m in range(n)] + [(Kind.BW, r, m) for m in range(n)]
                 for r in range(d)]
        return registry.draft(n, sequential_placement(d), lists)
    try:
        assert "example-f-then-bw" in names()
        s = build("example-f-then-bw", 3, 4)
        assert s.name == example(3, 4).name == "example-f-then-bw"
        assert simulate(s, Costs.uniform(s)).makespan > 0
        assert builder_info("example-f-then-bw").options == {"bad": False}
        with pytest.raises(ScheduleError, match="^example-f-then-bw: needs at least 2 micro"):
            example(3, 1)
        with pytest.raises(ScheduleError, match="^example-f-then-bw: asked to fail$"):
            build("example-f-then-bw", 2, 2, bad=True)
    finally:
        registry.REGISTRY.pop("example-f-then-bw", None)
        registry.BUILDERS.pop("example-f-then-bw", None)
