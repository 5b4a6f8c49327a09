"""Megatron-LM's real ``pretrain_gpt.py`` (../shared/clients, core_v0.16.1) with the shipped
patch, on 2 CPU ranks (gloo, pp = 2), started with the README's "Train with Megatron-LM"
command: the Megatron flags come verbatim from ``$(ds-autoplan plan ... --emit megatron-args)``.

Every ds_autoplan schedule trains 3 steps; 1F1B and ZB-H1 give Megatron's own 1F1B losses and
interleaved Megatron's own interleaved losses (1e-6); the V schedules give the losses of a
non-V run (Megatron's 1F1B) from the same initial weights (1e-5).  The CPU shim
(tests/megatron_lm_cpu.py) draws every parameter from its global name, so the placements
start from the same weights.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from harness import CLIENTS_SKIP, clients_dir
from harness.records import run_record

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "megatron_lm_cpu.py"
PATCH = ROOT / "patches" / "megatron-lm-pretrain_gpt.patch"
# flags a CPU run needs beyond the README's (no CUDA kernels, gloo, deterministic, no eval; the
# mock data needs no loader processes: Megatron's 2 per rank cost ~0.6 s a launch, measured)
CPU_FLAGS = ("--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
             "--use-cpu-initialization --no-masked-softmax-fusion --no-bias-gelu-fusion "
             "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm --clip-grad 0 --num-workers 0 "
             "--eval-iters 0 --eval-interval 1000 --log-interval 1 --hidden-dropout 0 "
             "--attention-dropout 0 --split 100,0,0 --no-create-attention-mask-in-dataloader")
SCHEDULES = ["1f1b", "interleaved", "zb-h1", "v-half", "v-min", "v-zb"]


def _client() -> pathlib.Path | None:
    c = clients_dir()
    return c / "megatron-lm-core_v0.16.1" if c and (c / "megatron-lm-core_v0.16.1" / "pretrain_gpt.py").is_file() \
        else None


def readme_commands() -> tuple[str, str]:
    """The patch and train commands of the README's "Train with Megatron-LM" section."""
    text = (ROOT / "README.md").read_text()
    sec = text.split("\n## Train with Megatron-LM\n", 1)[1].split("\n## ", 1)[0]
    cmds = re.findall(r"^    (\S.*)$", sec, flags=re.M)
    patch = next(c for c in cmds if "patch -p1" in c)
    train = next(c for c in cmds if "pretrain_gpt.py" in c and "ds-autoplan plan" in c)
    return patch, train


def _train_command(train: str, schedule: str, out: pathlib.Path, ours: bool) -> str:
    """The README's train command for ``schedule`` (ours) or, without ``DS_AUTOPLAN_PLAN``,
    Megatron's own schedule on the plan's argument file; the CPU shim goes before the script."""
    cmd = train.replace("--schedules v-half", f"--schedules {schedule}").replace("out/tiny", str(out))
    if not ours:
        cmd = re.sub(r"^DS_AUTOPLAN_PLAN=\S+ ", "", cmd)
        cmd = re.sub(r"\$\(ds-autoplan plan [^)]*\)", f"$(cat {out}/megatron_args.txt)", cmd)
    cmd = cmd.replace("torchrun --nproc_per_node 2 pretrain_gpt.py",
                      f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 "
                      f"{SHIM} pretrain_gpt.py")
    return f"{cmd} {CPU_FLAGS}"


def _outputs(tag: str, tmp: pathlib.Path) -> dict:
    """Where the shim writes a run's losses and report (MLM_CPU_LOSSES / MLM_CPU_REPORT)."""
    return {"MLM_CPU_LOSSES": str(tmp / f"{tag}.losses"), "MLM_CPU_REPORT": str(tmp / f"{tag}.report")}


def _launch(cmd: str, cwd: pathlib.Path, timeout: float = 420, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
             MLM_CPU_INIT_BY_NAME="1", **env)
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def _result(rc: int, out: str, cmd: str, tag: str, tmp: pathlib.Path) -> SimpleNamespace:
    read = (lambda p: [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else [])
    files = _outputs(tag, tmp)
    return SimpleNamespace(rc=rc, out=out, cmd=cmd,
                           losses=[x["lm loss"] for x in read(pathlib.Path(files["MLM_CPU_LOSSES"]))],
                           report=sorted(read(pathlib.Path(files["MLM_CPU_REPORT"])), key=lambda x: x["rank"]))


def _run(cmd: str, cwd: pathlib.Path, tag: str, tmp: pathlib.Path, **env) -> SimpleNamespace:
    r = _launch(cmd, cwd, **_outputs(tag, tmp), **env)
    return _result(r.returncode, r.stdout + r.stderr, cmd, tag, tmp)


def _forked_runs(cmds: dict, cwd: pathlib.Path, tmp: pathlib.Path, nproc: int, nodes: int = 1,
                 refusals: tuple = ()) -> dict:
    """``{tag: (cmd, env)}``, commands as :func:`_run` takes them (``VAR=x ... torchrun ...
    SHIM pretrain_gpt.py $(cat FILE) flags``), run in ONE launch of ``nproc`` ranks per node on
    ``nodes`` nodes (``nodes`` > 1: one ``torchrun --nnodes N --node_rank i`` per node, all on
    this machine): each command's script and flags (``$(cat FILE)`` expanded as the shell does)
    run in forked children of the ranks, with the command's variables and ``env`` (the shim's
    ``--runs``: the ranks' imports are paid once).  Per tag: what :func:`_run` returns, with
    that run's output and its worst exit status over the ranks.  ``refusals``: tags meant to end
    non-zero; they do not fail the ranks, so the launch itself must end 0 (asserted: a rank
    that failed otherwise, or died, is named by the launcher's summary in the message)."""
    job = tmp / f"runs-{'+'.join(cmds)}.json"
    todo = []
    for tag, (cmd, env) in cmds.items():
        assigned, rest = re.match(r"((?:\w+=\S+ )*)(.*)", cmd).groups()
        script_args = rest.split(f" {SHIM} ", 1)[1]
        script_args = re.sub(r"\$\(cat (\S+)\)", lambda m: pathlib.Path(m.group(1)).read_text().strip(),
                             script_args)
        todo.append({"tag": tag, "argv": shlex.split(script_args), "log": str(tmp / f"{tag}.log"),
                     "store": str(tmp / f"{tag}.store"), "refusal": tag in refusals,
                     "env": {**dict(a.split("=", 1) for a in assigned.split()), **env, **_outputs(tag, tmp)}})
    job.write_text(json.dumps(todo))
    run = f"{sys.executable} -m torch.distributed.run --nproc_per_node {nproc} {SHIM} --runs {job}"
    if nodes == 1:
        launch = run.replace(" --nproc_per_node", " --standalone --nproc_per_node")
    else:      # the node launchers side by side; the launch fails if one of them does
        from ds_autoplan.runtime.launch import free_port
        node = run.replace(" --nproc_per_node", f" --nnodes {nodes} --node_rank {{}} --master_addr 127.0.0.1 "
                                                 f"--master_port {free_port()} --nproc_per_node")
        launch = "".join(f"{node.format(i)} & p{i}=$!; " for i in range(nodes)) + \
            "; ".join(f"wait $p{i} || exit 1" for i in range(nodes))
    r = _launch(launch, cwd, timeout=420 * len(todo))     # as much as separate launches
    launch_out = r.stdout + r.stderr
    done = [json.loads(x) for x in re.findall(r"MLM_CPU_RUN (\{[^{}]*\})", launch_out)]
    res = {}
    for run in todo:
        codes = [d["exit"] for d in done if d["tag"] == run["tag"]]
        rc = max(codes, key=abs) if len(codes) == nproc * nodes else (r.returncode or -1)
        log = pathlib.Path(run["log"])
        out = log.read_text() if log.exists() else ""
        if len(codes) != nproc * nodes:     # the launch's status stands in: say whose is missing
            got = sorted(d["rank"] for d in done if d["tag"] == run["tag"])
            out += (f"\n--- only ranks {got} of {nproc * nodes} reported run {run['tag']} "
                    f"(the launch's exit status {r.returncode} stands in) ---\n")
        res[run["tag"]] = _result(rc, out if rc == 0 else out + "\n--- launch ---\n" + launch_out,
                                  cmds[run["tag"]][0], run["tag"], tmp)
    assert not refusals or r.returncode == 0, (f"the launch ended {r.returncode}:\n" + "\n".join(
        f"--- run {t} (exit {x.rc}) ---\n{x.out}" for t, x in res.items()))
    return res


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    src = _client()
    if src is None:
        pytest.skip(f"{CLIENTS_SKIP} (megatron-lm-core_v0.16.1/pretrain_gpt.py)")
    tmp = tmp_path_factory.mktemp("mlm")
    dst = tmp / "Megatron-LM"
    shutil.copytree(src, dst)
    patch_cmd, _ = readme_commands()
    patch_cmd = patch_cmd.replace("cd Megatron-LM && ", "").replace("/path/to/ds_autoplan", str(ROOT))
    r = subprocess.run(["bash", "-c", patch_cmd], cwd=dst, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return dst


@pytest.fixture(scope="module")
def runs(client):
    """Every schedule through the patch, and Megatron's own 1F1B / interleaved on the same
    argument files (one 2-rank launch each; the runs that are not the README command,
    Megatron's own and the recompute one, share one launch: forked runs)."""
    _, train = readme_commands()
    tmp = client.parent
    res = {}
    from ds_autoplan.plan import Plan
    from ds_autoplan.schedule import Kind
    for s in SCHEDULES:
        res[s] = _run(_train_command(train, s, tmp / s, ours=True), client, s, tmp)
        sched = Plan.load(tmp / s / "plan.json").build_schedule()
        res[s].has_w = any(a.kind == Kind.W for r in sched.ranks for a in r)
    # the commands that are not the README's share one launch (forked runs)
    res.update(_forked_runs({**{"megatron-" + s: (_train_command(train, s, tmp / s, ours=False),
                                                 {"MLM_CPU_SERIAL_P2P": "1"})
                                for s in ("1f1b", "interleaved")},
                             "1f1b-recompute": (_recompute_command(train, tmp), {})}, client, tmp, 2))
    print(json.dumps({"megatron_lm_losses": {k: r.losses for k, r in res.items()}}))   # pytest -s
    return res


def _recompute_command(train: str, tmp: pathlib.Path) -> str:
    """The 1F1B plan with recomputation on its first stage only (2 of 4 layers), run through
    its emitted argument file (--recompute-granularity full --recompute-num-layers 2, one
    number for every stage, for Megatron's own schedules): with the patch the plan's R
    actions recompute stage 0 only and Megatron's full recompute is off in every chunk."""
    from ds_autoplan.emit.megatron import megatron_args
    from ds_autoplan.plan import Plan
    out = tmp / "1f1b-recompute"
    out.mkdir()
    d = Plan.load(tmp / "1f1b" / "plan.json").to_dict()
    d["recompute_per_stage"] = [0.5, 0.0]
    plan = Plan.from_dict(d)
    plan.save(out / "plan.json")
    (out / "megatron_args.txt").write_text("\n".join(megatron_args(plan)) + "\n")
    return f"DS_AUTOPLAN_PLAN={out}/plan.json " + _train_command(train, "1f1b", out, ours=False)


def _ok(run):
    assert run.rc == 0, f"{run.cmd}\n{run.out}"
    assert len(run.losses) == 3, run.out


@pytest.mark.multiproc
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("schedule,ref,tol", [("1f1b", "megatron-1f1b", 1e-6),
                                              ("zb-h1", "megatron-1f1b", 1e-6),
                                              ("interleaved", "megatron-interleaved", 1e-6),
                                              ("v-half", "megatron-1f1b", 1e-5),
                                              ("v-min", "megatron-1f1b", 1e-5),
                                              ("v-zb", "megatron-1f1b", 1e-5)])
def test_pretrain_gpt_trains_every_schedule(client, runs, schedule, ref, tol):
    ours, theirs = runs[schedule], runs[ref]
    _ok(ours)
    _ok(theirs)
    # the run's record of itself beside its plan (issue 38): the 2 steps after the warm-up
    rec = run_record(client.parent / schedule, "megatron")
    plan = json.loads((client.parent / schedule / "plan.json").read_text())
    per_rank = plan["num_microbatches"] * rec["plan"]["num_stages"] // plan["pp"]   # an F per stage, mb
    assert rec["components"]["forward"]["count"] == [per_rank] * plan["pp"], rec["components"]["forward"]
    assert max(abs(a - b) for a, b in zip(ours.losses, theirs.losses)) <= tol, (ours.losses, theirs.losses)
    assert {r["forward_backward_func"] for r in ours.report} == {"_LossesToLastRank"}
    assert {r["forward_backward_func"] for r in theirs.report} == {"function"}
    # Megatron-LM's log says once (rank 0) which ds_autoplan schedule runs.  Searched, not
    # matched at a line start: rank 1 shares the pipe, and its block-buffered stdout can leave
    # a partial line just before rank 0's (one write, so never split inside it)
    said = re.findall(r"ds_autoplan: plan .*", ours.out)
    assert len(said) == 1 and f"; schedule {schedule}" in said[0] and "layers per chunk" in said[0], said
    assert not re.findall(r"ds_autoplan: plan ", theirs.out)
    # schedules with W get split-aware linear layers (qkv, proj, fc1, fc2 of 4 layers per rank)
    split = 16 if ours.has_w else 0
    assert [r["split_linears"] for r in ours.report] == [split, split]
    assert ours.has_w == (schedule != "1f1b" and schedule != "interleaved")
    if schedule.startswith("v-"):
        # V placement through get_model: rank 0 holds layers 1-2 (embedding) and 7-8 (loss)
        r0, r1 = ours.report
        assert [c["layers"] for c in r0["chunks"]] == [[1, 2], [7, 8]]
        assert [c["layers"] for c in r1["chunks"]] == [[3, 4], [5, 6]]
        assert [(c["pre_process"], c["post_process"]) for c in r0["chunks"]] == [(True, False), (False, True)]
        assert not any(c["pre_process"] or c["post_process"] for c in r1["chunks"])


@pytest.mark.multiproc
@pytest.mark.timeout(2400)
def test_pretrain_gpt_recomputes_per_stage(runs):
    run = runs["1f1b-recompute"]
    _ok(run)
    assert max(abs(a - b) for a, b in zip(run.losses, runs["megatron-1f1b"].losses)) <= 1e-6
    # the flags ask Megatron for full recompute of 2 layers on every stage; under the patch the
    # plan's R actions recompute stage 0 (every micro-batch) and Megatron's recompute is off
    out = pathlib.Path(re.search(r"\$\(cat (\S+)/megatron_args.txt\)", run.cmd).group(1))
    flags = (out / "megatron_args.txt").read_text()
    assert "--recompute-granularity full" in flags and "--recompute-num-layers 2" in flags
    n = json.loads((out / "plan.json").read_text())["num_microbatches"]
    assert [[c["recompute"] for c in r["chunks"]] for r in run.report] == [[[None, None]], [[None, None]]]
    assert [r["r_actions"] for r in run.report] == [[[0, m] for m in range(n)], []]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_v_plan_with_tied_embeddings_is_refused_at_start(client):
    """Without --untie-embeddings-and-output-weights a V plan stops before any process group
    exists, with one ds_autoplan message (printed by each rank), instead of hanging."""
    _, train = readme_commands()
    tmp = client.parent
    cmd = _train_command(train, "v-half", tmp / "tied", ours=True)
    cmd = cmd.replace(" --untie-embeddings-and-output-weights", "")        # the README's model flag
    cmd = cmd.replace("--emit megatron-args)",                                # and the plan's
                      "--emit megatron-args | sed s/--untie-embeddings-and-output-weights//)")
    run = _run(cmd, client, "tied", tmp)
    assert run.rc != 0
    lines = {x for x in run.out.splitlines() if x.startswith("ds_autoplan:")}   # same on each rank
    assert len(lines) == 1 and "--untie-embeddings-and-output-weights" in lines.pop(), run.out
    assert run.losses == [] and run.report == []


# -- expert parallelism (MoE) ----------------------------------------------------------------
MOE_MODEL = """name: moe-tiny
arch: gpt
num_layers: 8
hidden: 64
heads: 4
vocab: 512
seq_len: 64
num_experts: 4
moe_topk: 2
linear_bias: false
"""
# without the auxiliary loss a token's loss depends on its own (dropless) routing only, so the
# V placement and Megatron's 1F1B compute the same thing
MOE_RUN_FLAGS = "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0"


def _moe_plans(tmp: pathlib.Path, *schedules: str) -> list[pathlib.Path]:
    """``ds-autoplan plan --fix ep=2`` of the tiny MoE model on 4 CPU ranks (pp 2, dp 2 = ep 2),
    one per schedule (run side by side): each ``megatron_args.txt`` holds every MoE /
    expert-parallel flag."""
    (tmp / "moe-tiny.yaml").write_text(MOE_MODEL)
    outs = [tmp / f"moe-{s}" for s in schedules]
    procs = [subprocess.Popen([sys.executable, "-m", "ds_autoplan", "plan", "--model", str(tmp / "moe-tiny.yaml"),
                               "--cluster", "cpu-4", "--global-batch", "8", "--pp", "2", "--schedules", s,
                               "--precision", "fp32", "--fix", "ep=2", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for s, out in zip(schedules, outs)]
    for p in procs:
        text, _ = p.communicate(timeout=300)
        assert p.returncode == 0, text
    return outs


def _moe_command(out: pathlib.Path, ours: bool) -> str:
    plan = f"DS_AUTOPLAN_PLAN={out}/plan.json " if ours else ""
    return (f"{plan}{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 4 {SHIM} "
            f"pretrain_gpt.py $(cat {out}/megatron_args.txt) {MOE_RUN_FLAGS} --mock-data "
            f"--tokenizer-type NullTokenizer --vocab-size 512 --untie-embeddings-and-output-weights "
            f"--train-iters 3 --lr 1e-3 --min-lr 1e-3 --lr-decay-style constant {CPU_FLAGS}")


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
def test_pretrain_gpt_moe_expert_parallel_v_half(client):
    """A 4-expert top-2 MoE GPT with expert parallelism 2 on 4 CPU ranks (pp 2 x ep 2), every
    MoE / expert flag from ``ds-autoplan plan --fix ep=2``: V-Half through the patch (expert
    linear layers split for W) trains with the losses of Megatron's own 1F1B on the same
    flags."""
    tmp = client.parent
    ours_dir, theirs_dir = _moe_plans(tmp, "v-half", "1f1b")
    flags = (ours_dir / "megatron_args.txt").read_text()
    for f in ("--num-experts 4", "--moe-router-topk 2", "--disable-bias-linear",
              "--expert-model-parallel-size 2", "--moe-token-dispatcher-type alltoall"):
        assert f in flags, flags
    both = _forked_runs({"moe-v-half": (_moe_command(ours_dir, True), {}),
                         "moe-megatron-1f1b": (_moe_command(theirs_dir, False), {})}, client, tmp, 4)
    ours, theirs = both["moe-v-half"], both["moe-megatron-1f1b"]
    print(json.dumps({"moe_losses": {"v-half": ours.losses, "megatron-1f1b": theirs.losses}}))
    _ok(ours)
    _ok(theirs)
    assert max(abs(a - b) for a, b in zip(ours.losses, theirs.losses)) <= 1e-5, (ours.losses, theirs.losses)
    assert {r["forward_backward_func"] for r in ours.report} == {"_LossesToLastRank"}
    # per rank 4 layers: qkv, proj and fc1, fc2 of each of its 2 local experts
    assert [r["split_linears"] for r in ours.report] == [24] * 4, ours.report


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
def test_two_node_plans_train_as_on_one_node(client, capsys):
    """``ds-autoplan plan --cluster auto --nodes 2 --fix pp=2,tp=1,mbs=1,schedule=S`` (pp 2 x dp 2
    over 2 nodes of 2 CPU ranks) with S 1F1B and V-Half.  ``--fix``: the figures of a detected
    cluster are a measurement of this machine, so the planner's free choice moved with its load
    (one taken beside a running suite planned tp=2 dp=1, 1 of 4 runs; and V-Half lost to the
    1F1B baseline at micro-batch 2 x 2 for most figures, so the "V-Half" run trained 1F1B);
    fixed, every run trains both schedules and the figures move only the layer partition.
    ``pretrain_gpt.py`` under two ``torchrun --nnodes 2 --node_rank i`` (both plans in one
    launch: forked runs) trains with the losses of one ``torchrun`` of 4 ranks on one node
    running the same plans; a plan made for one node of 4 is refused on
    the two nodes before training."""
    from ds_autoplan.cli import main
    from ds_autoplan.plan import Plan
    _, train = readme_commands()
    tmp = client.parent
    cmds = {}
    for s in ("1f1b", "v-half"):
        out = tmp / f"nodes-{s}"
        assert main(["plan", "--model", "gpt-tiny", "--cluster", "auto", "--nodes", "2", "--gpus-per-node", "2",
                     "--global-batch", "8", "--fix", f"pp=2,tp=1,mbs=1,schedule={s}", "--precision", "fp32",
                     "--out", str(out), "--quiet", "--no-wide"]) == 0
        plan = Plan.load(out / "plan.json")
        assert (plan.pp, plan.dp, plan.gpus_per_node, plan.cluster, plan.schedule, plan.micro_batch_size) == \
            (2, 2, 2, "cpu-auto-2x2", s, 1), plan
        cmds[f"nodes-{s}"] = (f"DS_AUTOPLAN_PLAN={out}/plan.json " + _train_command(train, s, out, ours=False), {})
    one_node = Plan(**{**Plan.load(tmp / "nodes-1f1b" / "plan.json").to_dict(), "gpus_per_node": 4})
    one_node.save(tmp / "one-node-plan.json")
    capsys.readouterr()
    refusal = {"nodes-refused": (f"DS_AUTOPLAN_PLAN={tmp}/one-node-plan.json "
                           + _train_command(train, "1f1b", tmp / "nodes-1f1b", ours=False), {})}
    two = _forked_runs({**cmds, **refusal}, client, tmp, 2, nodes=2, refusals=("nodes-refused",))
    one = _forked_runs({f"one-{t}": c for t, c in cmds.items()}, client, tmp, 4)   # tags: own loss files
    print(json.dumps({"two_node_losses": {t: two[t].losses for t in cmds},
                      "one_node_losses": {t: one[f"one-{t}"].losses for t in cmds}}))
    for t in cmds:
        _ok(two[t])
        _ok(one[f"one-{t}"])
        assert max(abs(a - b) for a, b in zip(two[t].losses, one[f"one-{t}"].losses)) <= 1e-6
        assert {r["forward_backward_func"] for r in two[t].report} == {"_LossesToLastRank"}
    refused = two["nodes-refused"]
    assert refused.rc != 0 and not refused.losses
    assert "the launch's 2 nodes x 2 ranks: 1 of its 1 pipeline sends cross nodes" in refused.out, refused.out


# -- argument checks, in-process ---------------------------------------------------------
def _args(**kw):
    a = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, micro_batch_size=1,
             num_layers=8, virtual_pipeline_model_parallel_size=None, global_batch_size=8,
             data_parallel_size=1, rampup_batch_size=None, overlap_moe_expert_parallel_comm=False,
             untie_embeddings_and_output_weights=True, pipeline_model_parallel_layout=None,
             use_legacy_models=False, mtp_num_layers=None, decoder_first_pipeline_num_layers=None,
             decoder_last_pipeline_num_layers=None)
    a.update(kw)
    return SimpleNamespace(**a)


def _plan(schedule, layers, **kw):
    from ds_autoplan.plan import Plan
    opts = {"v": 2} if schedule == "interleaved" else {}
    return Plan(pp=2, micro_batch_size=1, num_microbatches=8, global_batch_size=8, precision="fp32",
                schedule=schedule, schedule_options=opts, layers_per_stage=layers,
                recompute_per_stage=[0.0] * len(layers), num_layers=sum(layers), **kw)


def test_context_parallel_plan_refused_without_gpu(capsys):
    """A plan with context parallelism stops the patched script at once, with one line, where
    there is no CUDA GPU / Transformer Engine (Megatron's CP attention is TE's)."""
    import torch
    from ds_autoplan.clients.megatron_lm import install_megatron_lm
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may run context parallelism")
    plan = _plan("1f1b", [4, 4], cp=2)
    with pytest.raises(SystemExit) as e:
        install_megatron_lm(plan)
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds_autoplan: context parallelism (cp=2)")
    assert "CUDA" in lines[0] and "docs/megatron.md" in lines[0]


def test_recompute_flags_must_be_the_plans():
    from ds_autoplan.clients.megatron_lm import check_args
    plan = _plan("1f1b", [4, 4])
    plan.recompute_per_stage = [0.5, 0.0]          # 2 layers of stage 0, none of stage 1
    flags = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    sched = plan.build_schedule()
    assert check_args(_args(**flags), plan, sched) == []
    for bad in (dict(flags, recompute_num_layers=4), dict(flags, recompute_method="uniform"),
                dict(recompute_granularity="selective")):
        problems = check_args(_args(**bad), plan, sched)
        assert len(problems) == 1 and "--recompute-num-layers 2" in problems[0], problems
    plain = _plan("1f1b", [4, 4])
    assert check_args(_args(), plain, sched) == []
    assert "no recompute flags" in check_args(_args(**flags), plain, plain.build_schedule())[0]


@pytest.mark.parametrize("schedule,layers,args,expect", [
    ("1f1b", [3, 5], dict(pipeline_model_parallel_layout="Ettt|tttttL"), None),
    ("1f1b", [3, 5], dict(), "Megatron builds [4, 4] layers per stage"),
    ("1f1b", [4, 4], dict(global_batch_size=16), "gives 16 micro-batches"),
    ("1f1b", [4, 4], dict(pipeline_model_parallel_size=4), "--pipeline-model-parallel-size is 4"),
    ("interleaved", [2, 2, 2, 2], dict(pipeline_model_parallel_layout="Ett|tt|tt|ttL",
                                       virtual_pipeline_model_parallel_size=2), None),
    ("interleaved", [2, 2, 2, 2], dict(), "virtual stages per pipeline rank is 1, the plan has 2"),
    ("v-half", [2, 2, 2, 2], dict(virtual_pipeline_model_parallel_size=2), None),
    ("v-half", [2, 2, 2, 2], dict(virtual_pipeline_model_parallel_size=2,
                                  untie_embeddings_and_output_weights=False), "cannot tie"),
    ("v-zb", [2, 2, 2, 2], dict(virtual_pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                data_parallel_size=1), "tensor parallelism"),
    ("v-min", [2, 2, 2, 2], dict(virtual_pipeline_model_parallel_size=2,
                                 pipeline_model_parallel_layout="Ett|tt|tt|ttL"), "drop --pipeline"),
    ("1f1b", [4, 4], dict(expert_model_parallel_size=2, data_parallel_size=2, global_batch_size=16),
     "--expert-model-parallel-size is 2, the plan has 1"),
    ("1f1b", [4, 4], dict(context_parallel_size=2), "--context-parallel-size is 2, the plan has 1"),
])
def test_check_args(schedule, layers, args, expect):
    from ds_autoplan.clients.megatron_lm import check_args
    plan = _plan(schedule, layers)
    problems = check_args(_args(**args), plan, plan.build_schedule())
    if expect is None:
        assert problems == []
    else:
        assert any(expect in p for p in problems), problems
