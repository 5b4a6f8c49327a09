"""One Plan -> engine-config path: a Plan validates itself (constructed or read
from JSON); the emitted ds_config.json is exactly the config DeepSpeed's engine runs; the
emitted Megatron config and the Megatron runtime's overrides agree."""
import json

import pytest

from ds_autoplan.emit.deepspeed import ds_config
from ds_autoplan.errors import PlanError, UserError
from ds_autoplan.plan import Plan


def _plan(**kw):
    base = dict(pp=2, micro_batch_size=2, num_microbatches=4, precision="fp32", schedule="v-half",
                layers_per_stage=[1, 2, 2, 1], recompute_per_stage=[0.0, 0.5, 0.0, 0.0])
    return Plan(**{**base, **kw})


@pytest.mark.parametrize("kw,msg", [
    (dict(pp=0), "pp must be a positive integer"),
    (dict(micro_batch_size=2.5), "micro_batch_size must be a positive integer"),
    (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(global_batch_size=9), "global_batch_size 9 != micro_batch_size 2 x num_microbatches 4"),
    (dict(layers_per_stage=[1, 2, 3], recompute_per_stage=[0.0] * 3), "has 4 stages"),
    (dict(recompute_per_stage=[0.0, 1.5, 0.0, 0.0]), "fractions in"),
    (dict(recompute_per_stage=[0.0, 0.5]), "recompute_per_stage has 2 entries"),
    (dict(layers_per_stage=[1, -2, 2, 1]), "non-negative integers"),
    (dict(schedule_options={"nope": 1}), "do not fit"),
])
def test_plan_refuses_what_no_runtime_can_run(kw, msg):
    with pytest.raises(PlanError, match=msg):
        _plan(**kw)
    good = _plan().to_dict()
    with pytest.raises(PlanError, match=msg):        # the same check when read from JSON
        Plan.from_json(json.dumps({**good, **kw}))


def test_plan_json_round_trip_and_errors():
    p = _plan()
    assert Plan.from_json(p.to_json()) == p
    assert p.global_batch_size == 8                   # derived: micro-batch x count x dp
    assert issubclass(PlanError, UserError) and issubclass(PlanError, ValueError)
    with pytest.raises(PlanError, match="not JSON"):
        Plan.from_json("{pp: 2")
    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_json("[1, 2]")
    with pytest.raises(PlanError, match="list of numbers"):
        Plan.from_json(json.dumps({**p.to_dict(), "layers_per_stage": ["a"]}))
    Plan(pp=3, schedule="hand-made", layers_per_stage=[1] * 5, recompute_per_stage=[0.0] * 5)


@pytest.mark.timeout(300)
def test_deepspeed_engine_runs_exactly_the_emitted_config(tmp_path):
    """The emitted ds_config.json (recompute on: the emitter used to write a checkpoint
    interval of 1 that the runtime then forced to 0) is what the engine was given."""
    pytest.importorskip("deepspeed")
    from harness import ENV

    from ds_autoplan.runtime.launch import results
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    emitted = json.loads(json.dumps(ds_config(plan)))      # as ds-autoplan plan writes it
    rows = results(["-m", "harness.ds_engine_config", str(path)], 2, timeout=240, env=ENV)
    assert len(rows) == 2
    for r in rows:
        assert json.loads(json.dumps(r["config"])) == emitted, r["rank"]
        assert r["ds_interval"] == 0                       # DeepSpeed's global switch is off
    # ... and the runtime recomputes the plan's stage: 0.5 x 2 layers of stage 1 (rank 1)
    assert sorted(v for r in rows for v in r["recomputed_layers"].values()) == [0, 0, 0, 1]
    assert Plan.from_dict(emitted["pipeline"]["autoplan"]) == plan


@pytest.mark.parametrize("kw", [
    dict(schedule="1f1b", layers_per_stage=[3, 5], recompute_per_stage=[0.5, 0.0]),
    dict(schedule="interleaved", schedule_options={"v": 2}, layers_per_stage=[1, 2, 2, 3],
         recompute_per_stage=[0.0, 1.0, 0.5, 0.0]),
    dict(schedule="v-half"),
    dict(schedule="1f1b", tp=2, sequence_parallel=True, layers_per_stage=[2, 2],
         recompute_per_stage=[0.0, 0.0]),
])
def test_megatron_runtime_runs_the_emitted_megatron_config(kw):
    """What ``ds_autoplan.runtime.megatron.initialize`` sets up (parallel sizes, layer layout,
    per-stage recompute) is what megatron.json / megatron_args.txt say."""
    pytest.importorskip("megatron.core")
    from ds_autoplan.emit.megatron import megatron_args, megatron_config
    from ds_autoplan.runtime.megatron import plan_overrides
    plan = _plan(**kw)
    emitted = json.loads(json.dumps(megatron_config(plan)))
    over, rec_layers, layout = plan_overrides(plan)
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
              "virtual_pipeline_model_parallel_size", "sequence_parallel"):
        assert over[k] == emitted[k], k
    assert over.get("microbatch_group_size_per_vp_stage") == \
        emitted.get("microbatch_group_size_per_vp_stage", over.get("microbatch_group_size_per_vp_stage"))
    assert rec_layers == emitted["autoplan"]["recompute_layers_per_stage"]
    if isinstance(layout, str):          # Megatron's own layout: the same string as the flag
        assert layout == emitted["pipeline_model_parallel_layout"]
        assert f"--pipeline-model-parallel-layout {layout}" in megatron_args(plan) or \
            f"--pipeline-model-parallel-layout '{layout}'" in megatron_args(plan)
    else:                                # V placement: not expressible as flags; same layers per rank
        per_rank = [[sum(t.name == "decoder" for t in layout.layout[r][c])
                     for c in range(len(layout.layout[r]))] for r in range(plan.pp)]
        assert sorted(map(sorted, per_rank)) == sorted(map(sorted, emitted["autoplan"]["layers_per_rank"]))
