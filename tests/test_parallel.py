"""The one parallel configuration (ds_autoplan.spec.parallel.Parallel): keywords only, derived
sizes, validation, the Plan built from it and read back, old plan files, and the schedule's
placement asked by property rather than by name."""
from __future__ import annotations

import json

import pytest

from ds_autoplan.errors import PlanError
from ds_autoplan.plan import Plan
from ds_autoplan.spec import SpecError
from ds_autoplan.spec.parallel import Parallel


def test_keywords_only_and_derived_sizes():
    with pytest.raises(TypeError):
        Parallel(2, 4)                      # noqa -- positional degrees are refused
    p = Parallel(tp=2, pp=4, dp=8, cp=2, ep=8, micro_batch=2, num_microbatches=16)
    assert p.etp == 2                       # Megatron's default: expert TP = TP
    assert p.world_size == 2 * 4 * 8 * 2 == 128 and p.stage_ranks == 32
    assert p.expert_dp == 32 // (8 * 2) == 2
    assert p.global_batch == 2 * 16 * 8 and p.batch_per_microbatch == 16
    assert Parallel(tp=1, sp=True).sequence_parallel is False
    assert p.with_(etp=1).expert_dp == 4


@pytest.mark.parametrize("kw,msg", [
    (dict(tp=0), "tp must be a positive integer"),
    (dict(zero=4), "zero must be 0, 1, 2 or 3"),
    (dict(dp=2, ep=4), "ep x etp = 4 x 1 must divide"),
    (dict(tp=2, dp=2, ep=4), "ep x etp = 4 x 2 must divide"),
    (dict(chunks=True), "chunks must be a positive integer"),
])
def test_validation(kw, msg):
    with pytest.raises(SpecError, match=msg):
        Parallel(**kw)


def _plan(**over):
    par = Parallel(tp=2, pp=2, dp=2, zero=1, sp=True, micro_batch=2, num_microbatches=4, **over)
    return par, Plan(**Plan.parallel_fields(par), schedule="1f1b", layers_per_stage=[2, 2],
                     recompute_per_stage=[0.0, 0.0], model="gpt-tiny")


def test_plan_built_from_and_read_as_parallel():
    par, plan = _plan()
    assert plan.parallel == par and plan.world == par.world_size == 8
    assert (plan.zero_stage, plan.sequence_parallel, plan.global_batch_size) == (1, True, 16)
    par2, plan2 = _plan(ep=2, cp=2)
    assert (plan2.ep, plan2.etp, plan2.cp, plan2.world) == (2, 2, 2, 16)
    assert Plan.from_json(plan2.to_json()) == plan2


def test_old_plan_json_without_expert_or_context_degrees_loads(tmp_path):
    _, plan = _plan()
    d = plan.to_dict()
    for k in ("ep", "etp", "cp"):
        del d[k]
    (tmp_path / "plan.json").write_text(json.dumps(d))
    old = Plan.load(tmp_path / "plan.json")
    assert (old.ep, old.etp, old.cp) == (1, old.tp, 1) and old == plan


def test_plan_refuses_expert_degrees_that_do_not_divide_the_stage():
    _, plan = _plan()
    d = plan.to_dict()
    d["ep"] = 8
    with pytest.raises(PlanError, match="plan: ep x etp = 8 x 2 must divide"):
        Plan.from_dict(d)


def test_placement_properties_agree_with_the_placements():
    """Every registered builder: round_robin exactly for stage s on rank s mod d (Megatron's
    own order), chunks_per_rank = stages / ranks; the V-shapes are not round robin."""
    from ds_autoplan.schedule import build, names
    from ds_autoplan.schedule.builders import REGISTRY
    seen_v = 0
    for name in names():
        info = REGISTRY[name]
        s = build(name, 4, 8, **({info.chunks_option: 2} if info.chunks_option else {}))
        d, S = s.num_ranks, s.num_stages
        assert s.chunks_per_rank * d == S
        assert s.round_robin == (s.placement == tuple(i % d for i in range(S)))
        if S == 2 * d and s.placement[-1] == 0:          # a V: the return leg comes back to rank 0
            seen_v += 1
            assert not s.round_robin
    assert seen_v >= 3
