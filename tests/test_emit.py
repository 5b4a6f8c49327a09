"""Emitters and the `plan` command: configs validated by DeepSpeed's and Megatron-core's own
classes; one-message errors with no partial output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ds_autoplan.cli import main
from ds_autoplan.emit.deepspeed import ds_config, validate
from ds_autoplan.emit.megatron import layers_per_rank, megatron_args, megatron_config
from ds_autoplan.plan import Plan
from ds_autoplan.search import plan_model

KEYS = {"throughput_tokens_per_s", "iteration_time_s", "pp", "tp", "dp", "zero_stage", "schedule",
        "micro_batch_size", "peak_memory_gb_per_stage", "search_time_s"}


def _plan(**kw):
    base = dict(pp=4, tp=2, dp=2, zero_stage=1, micro_batch_size=2, num_microbatches=8,
                precision="bf16", schedule="1f1b",      # global batch 2 x 8 x dp
                layers_per_stage=[5, 6, 7, 6], recompute_per_stage=[0.6, 0.5, 0.0, 0.0],
                model="gpt3-1.3b", cluster="2x8xa100-ib200", world_size=16)
    base.update(kw)
    return Plan(**base)


@pytest.mark.parametrize("plan", [
    _plan(),
    _plan(pp=1, tp=1, dp=16, zero_stage=3, micro_batch_size=1, num_microbatches=2,
          layers_per_stage=[24], recompute_per_stage=[1.0], precision="fp16"),
    _plan(schedule="interleaved", schedule_options={"v": 2}, layers_per_stage=[3] * 8,
          recompute_per_stage=[0.0] * 8),
])
def test_ds_config_validates_with_deepspeed(plan):
    cfg = ds_config(plan)
    parsed = validate(cfg, plan)
    assert parsed.train_batch_size == plan.global_batch_size
    assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch_size
    assert parsed.gradient_accumulation_steps == plan.num_microbatches
    assert parsed.zero_optimization_stage == plan.zero_stage
    # per-stage recompute is the runtime's: DeepSpeed's global switch stays off
    assert parsed.pipeline["activation_checkpoint_interval"] == 0
    assert Plan.from_dict(parsed.pipeline["autoplan"]) == plan     # the plan, once
    assert "autoplan" not in cfg


def test_ds_config_rejects_what_deepspeed_rejects():
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        ds_config(_plan(zero_stage=3))
    plan = _plan()
    cfg = ds_config(plan)
    cfg["train_batch_size"] = 33                       # inconsistent triple
    with pytest.raises(Exception):
        validate(cfg, plan)


def test_megatron_layout_accepted_by_transformer_config():
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    for plan in (_plan(), _plan(schedule="interleaved", schedule_options={"v": 2},
                                layers_per_stage=[2, 3, 3, 3, 3, 3, 3, 4],
                                recompute_per_stage=[0.5] + [0.0] * 7)):
        c = megatron_config(plan)
        tc = TransformerConfig(
            num_layers=c["num_layers"], hidden_size=c["hidden_size"],
            num_attention_heads=c["num_attention_heads"],
            tensor_model_parallel_size=c["tensor_model_parallel_size"],
            pipeline_model_parallel_size=c["pipeline_model_parallel_size"],
            pipeline_dtype=torch.bfloat16, bf16=True,
            pipeline_model_parallel_layout=c["pipeline_model_parallel_layout"],
            recompute_granularity=c["recompute_granularity"], recompute_method=c["recompute_method"],
            recompute_num_layers=c["recompute_num_layers"])
        lay = tc.pipeline_model_parallel_layout
        vpp = len(plan.layers_per_stage) // plan.pp
        assert lay.virtual_pipeline_model_parallel_size == vpp
        for r in range(plan.pp):
            for v in range(vpp):
                n = sum(1 for x in lay.layout[r][v] if x.name == "decoder")
                assert n == plan.layers_per_stage[v * plan.pp + r]
        args = megatron_args(plan)
        assert f"--pipeline-model-parallel-size {plan.pp}" in args
        assert "--use-distributed-optimizer" in args


def test_megatron_v_shape_keeps_layout_for_runtime():
    plan = _plan(schedule="v-half", layers_per_stage=[3] * 8, recompute_per_stage=[0.0] * 8)
    c = megatron_config(plan)
    assert "pipeline_model_parallel_layout" not in c and "note" in c["autoplan"]
    assert layers_per_rank(plan) == [[3, 3]] * 4


def test_plan_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan"
    rc = main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-4", "--global-batch", "16",
               "--out", str(out), "--json", "--quiet"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(summary)
    for f in ("ds_config.json", "megatron.json", "megatron_args.txt", "plan.json", "report.md",
              "memory_per_stage.png"):
        assert (out / f).exists(), f
    plan = Plan.load(out / "plan.json")
    assert plan.pp == summary["pp"] and plan.model == "gpt-tiny"
    validate(json.loads((out / "ds_config.json").read_text()), plan)
    report = (out / "report.md").read_text()
    assert "Baselines" in report and "pure DP" in report
    # plan_model (launchers) gives the same decision
    p2 = plan_model("gpt-tiny", "cpu-4", 16)
    assert (p2.pp, p2.tp, p2.dp, p2.schedule) == (plan.pp, plan.tp, plan.dp, plan.schedule)


def test_pipeline_plan_writes_plots(tmp_path, capsys):
    out = tmp_path / "p"
    rc = main(["plan", "--model", "bert-huge", "--cluster", "8xtitan-24gb", "--global-batch", "64",
               "--memory-budget-gb", "8", "--precision", "fp16", "--out", str(out), "--quiet",
               "--no-wide"])
    assert rc == 0
    plan = Plan.load(out / "plan.json")
    assert plan.pp > 1 and (out / "gantt.png").exists()
    assert len(plan.build_schedule().placement) == len(plan.layers_per_stage)


@pytest.mark.parametrize("argv,msg", [
    (["--model", "nope", "--cluster", "cpu-4", "--global-batch", "8"], "unknown model preset"),
    (["--model", "gpt-tiny", "--cluster", "nope", "--global-batch", "8"], "unknown cluster preset"),
    (["--model", "llama2-70b", "--cluster", "cpu-4", "--global-batch", "8"], "short by"),
    (["--model", "gpt-tiny", "--cluster", "cpu-4", "--global-batch", "8", "--world-size", "8"],
     "world size 8 does not match"),
    (["--model", "gpt-tiny", "--cluster", "cpu-4", "--global-batch", "0"], "must be positive"),
    (["--model", "BAD", "--cluster", "cpu-4", "--global-batch", "8"], "malformed YAML"),
])
def test_bad_input_one_message_no_output(tmp_path, capsys, argv, msg):
    if "BAD" in argv:
        bad = tmp_path / "m.yaml"
        bad.write_text("arch: gpt\nnum_layers: [4\n")
        argv = [str(bad) if a == "BAD" else a for a in argv]
    out = tmp_path / "out"
    rc = main(["plan", *argv, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ds-autoplan-")]


def test_console_entry_json():
    r = subprocess.run([sys.executable, "-m", "ds_autoplan", "plan", "--model", "gpt-tiny",
                        "--cluster", "cpu-2", "--global-batch", "8", "--json", "--no-wide"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert KEYS <= set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_plan_emit_megatron_args_is_one_line_of_flags(capsys):
    from ds_autoplan.cli import main
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-4", "--global-batch", "16",
                 "--pp", "2", "--schedules", "1f1b", "--emit", "megatron-args", "--quiet"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    line = out[0]
    assert "--pipeline-model-parallel-size 2" in line
    # unquoted: `$(...)` output is only split at spaces, a quote would reach Megatron literally
    assert "--pipeline-model-parallel-layout Etttt|ttttL" in line and "'" not in line


@pytest.mark.parametrize("schedule,flags,absent", [
    ("1f1b", ["--pipeline-model-parallel-layout Etttt|ttttL"], ["--num-virtual-stages-per-pipeline-rank"]),
    # every chunk count is costed: 4 chunks of one layer per rank win for gpt-tiny here
    ("interleaved", ["--pipeline-model-parallel-layout Et|t|t|t|t|t|t|tL"], ["--num-virtual-stages-per-pipeline-rank"]),
    ("v-half", ["--num-virtual-stages-per-pipeline-rank 2", "--untie-embeddings-and-output-weights"],
     ["--pipeline-model-parallel-layout"]),
])
def test_megatron_args_file_and_shell_expansion(tmp_path, schedule, flags, absent):
    """megatron_args.txt is complete for the schedule, and `$(cat megatron_args.txt)` gives a
    shell exactly the emitted tokens (no quote characters, no pipe)."""
    out = tmp_path / "p"
    cmd = (f"{sys.executable} -m ds_autoplan plan --model gpt-tiny --cluster cpu-2 --global-batch 8 "
           f"--pp 2 --schedules {schedule} --precision fp32 --no-wide --quiet --out {out} "
           f"--emit megatron-args")
    r = subprocess.run(["bash", "-c", f'printf "%s\\n" $({cmd}); echo ==; printf "%s\\n" $(cat {out}/megatron_args.txt)'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    emitted, from_file = r.stdout.split("==\n")
    lines = (out / "megatron_args.txt").read_text().splitlines()
    assert emitted.split() == from_file.split() == " ".join(lines).split()
    for f in flags:
        assert f in lines
    assert not any(line.startswith(a) for line in lines for a in absent)
    assert not any(c in emitted for c in "'\"")


# -- sequence parallelism ----------------------------------------------------------------
@pytest.mark.parametrize("tp,sp", [(2, True), (2, False), (1, True), (1, False)])
def test_megatron_sequence_parallel_flag(tp, sp):
    """--sequence-parallel exactly when tp > 1 and the plan says so; the config, Megatron's
    TransformerConfig (which rejects SP with tp = 1) and the runtime overrides agree."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    from ds_autoplan.runtime.megatron import plan_overrides
    plan = _plan(tp=tp, dp=4 // tp, sequence_parallel=sp)
    on = sp and tp > 1
    c = json.loads(json.dumps(megatron_config(plan)))          # megatron.json round trip
    assert c["sequence_parallel"] is on
    assert ("--sequence-parallel" in megatron_args(plan)) is on
    assert Plan.from_json(plan.to_json()) == plan
    over, _, _ = plan_overrides(plan)
    assert over["sequence_parallel"] is on
    tc = TransformerConfig(hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
                           pipeline_dtype=torch.bfloat16, bf16=True, **over)
    assert tc.sequence_parallel is on
    assert ds_config(plan)["pipeline"]["autoplan"]["sequence_parallel"] is sp


def test_old_plan_json_without_sequence_parallel_loads(tmp_path):
    d = _plan().to_dict()
    del d["sequence_parallel"]
    (tmp_path / "plan.json").write_text(json.dumps(d))
    p = Plan.load(tmp_path / "plan.json")
    assert p.sequence_parallel is False and p.tp == 2
    assert "--sequence-parallel" not in megatron_args(p)


def test_plan_command_sequence_parallel(tmp_path, capsys):
    out = tmp_path / "sp"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-4", "--global-batch", "16",
                 "--sequence-parallel", "on", "--no-wide", "--out", str(out), "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sequence_parallel"] is True and summary["tp"] > 1
    assert json.loads((out / "megatron.json").read_text())["sequence_parallel"] is True
    assert "--sequence-parallel" in (out / "megatron_args.txt").read_text().split()
    assert Plan.load(out / "plan.json").sequence_parallel is True
    assert "| sequence parallel |" in (out / "report.md").read_text()
    rc = main(["plan", "--model", "gpt-tiny", "--cluster", "cpu-4", "--global-batch", "16",
               "--tp", "1", "--sequence-parallel", "on", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs tensor parallelism" in err and "Traceback" not in err
