"""The command line as a newcomer meets it (issue 33): help, refusals in the user's words,
pipes, the files a command says it wrote, plots that read right.  In-process calls of
``ds_autoplan.cli.main`` unless a real process is the point."""
import itertools
import json
import os
import re
import subprocess
import sys

import pytest

from ds_autoplan.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_GQA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
             "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 32,
             "vocab_size": 32000, "max_position_embeddings": 4096}


def _config(folder, cfg=LLAMA_GQA):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder / "config.json")


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# -- help ------------------------------------------------------------------------------------

def test_launch_help_shows_ours_then_deepspeeds(capsys):
    rc, out, err = _run(capsys, ["launch", "--help"])
    assert rc == 0 and "error:" not in out + err, err
    ours = [out.index(o) for o in ("--model", "--cluster", "--global-batch", "--pp", "--schedules",
                                   "--out")]
    theirs = [out.index(o) for o in ("--num_gpus", "--hostfile", "--master_port")]
    assert max(ours) < min(theirs)
    assert out.startswith("usage: ds-autoplan launch [ds-autoplan options] [deepspeed launcher options]")
    # -h before the script is help too
    rc, out2, _ = _run(capsys, ["launch", "-h", "--num_gpus", "2", "train.py"])
    assert rc == 0 and out2 == out


def test_top_level_help_speaks_to_users_and_lists_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "sub-command" not in out and "module" not in out
    assert "Plan large-model training for DeepSpeed and Megatron-core" in out
    assert "gpt3-13b" in out and "cpu-N" in out and "ds-autoplan presets" in out


def test_launch_planning_failure_names_the_detected_cluster(capsys, monkeypatch, tmp_path):
    """A plan made before launch on the detected cluster that cannot be made: one line naming
    the cluster by its name (not the spec's repr) and why."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv("DS_AUTOPLAN_CLUSTER", raising=False)
    before = dict(os.environ)
    rc, out, err = _run(capsys, ["launch", "--model", "gpt-tiny", "--offload", "nvme:opt",
                                 "--out", str(tmp_path / "o"), "--num_gpus", "2",
                                 os.path.join(ROOT, "examples", "train_deepspeed.py")])
    # an in-process launch leaves the caller's environment as it was (it once set
    # DS_AUTOPLAN_OUT there, and every later launch of the process wrote its plan into tmp_path)
    assert dict(os.environ) == before
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "ClusterSpec" not in err, err
    assert re.match(r"ds-autoplan launch: error: planning gpt-tiny on cpu-auto-1x2 failed: "
                    r"offload=nvme:opt: ", line), line


@pytest.mark.parametrize("cmd, starts", [
    ("patch", "Add --autoplan to the installed DeepSpeed launcher (deepspeed/launcher/runner.py), "
              "or take it out again."),
    ("cost", "What does my configuration cost? Costs your configuration"),
])
def test_descriptions_are_whole_sentences(capsys, cmd, starts):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert starts in out


def test_every_option_has_help():
    import argparse

    from ds_autoplan.cli import build_parser

    def walk(p, name):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for n, sp in a.choices.items():
                    yield from walk(sp, f"{name} {n}")
            elif not a.help and name != "ds-autoplan launch":   # launch: its own parser, above
                yield name, a.option_strings or a.dest
    assert list(walk(build_parser(), "ds-autoplan")) == []


def test_presets_lists_models_clusters_and_hf_configs(capsys):
    rc, out, _ = _run(capsys, ["presets"])
    assert rc == 0
    lines = out.splitlines()
    assert any(line.split()[:1] == ["gpt3-13b"] and "40 layers" in line for line in lines)
    assert any(line.split()[:1] == ["8xa100-80gb"] and "1 x 8 a100-sxm-80gb, 80 GB each" in line
               for line in lines)
    assert any(line.split()[:1] == ["cpu-N"] and "any N" in out for line in lines)
    assert "configs/hf/Qwen3-8B/config.json" in out
    rc, out, _ = _run(capsys, ["presets", "--json"])
    lists = json.loads(out)
    assert "gpt-tiny" in lists["models"] and "cpu-N" in lists["clusters"]


def test_any_cpu_count_is_a_cluster(capsys):
    rc, out, _ = _run(capsys, ["plan", "--model", "gpt-tiny", "--cluster", "cpu-3", "--global-batch",
                               "6", "--json", "--quiet"])
    assert rc == 0 and json.loads(out)["dp"] * json.loads(out)["pp"] == 3
    rc, _, err = _run(capsys, ["plan", "--model", "gpt-tiny", "--cluster", "cpu-N", "--global-batch", "6"])
    assert rc == 2 and "cpu-N: N is the number of devices, e.g. cpu-2" in err


# -- refusals in the user's words --------------------------------------------------------------

def test_tp_refusal_names_the_real_limit(capsys, tmp_path):
    """8 divides the 32 attention heads; the 4 key/value heads are the limit."""
    rc, out, _ = _run(capsys, ["cost", "--model", _config(tmp_path / "m"), "--cluster", "8xa100-80gb",
                               "--global-batch", "64", "--config", "tp=8"])
    assert rc == 2          # the configuration cannot run (tests/test_bad_inputs.py)
    assert ("tp=8 is not possible here: it does not divide the 4 key/value heads "
            "(num_key_value_heads=4); choose from [1, 2, 4]") in out
    assert "attention heads" not in out


@pytest.mark.parametrize("config, says", [
    ("zero=3,offlaod=cpu", "error: --config: expected key=value with key in"),
    ("zero=3,offload=cpu", "error: --config: offload: unknown part 'cpu'"),
    ("zero=3,offload=opt", "cannot run: offload=opt: cluster '64xa100-40gb' has no host figures"),
])
def test_cost_names_config_not_fix(capsys, config, says):
    rc, out, err = _run(capsys, ["cost", "--model", "gpt3-1.3b", "--cluster", "64xa100-40gb",
                                 "--global-batch", "64", "--config", config])
    assert says in out + err and "--fix" not in out + err, out + err


def test_hf_config_errors_name_its_own_fields(capsys, tmp_path):
    cfg = {k: v for k, v in LLAMA_GQA.items() if k != "vocab_size"}
    rc, _, err = _run(capsys, ["plan", "--model", _config(tmp_path / "m", cfg), "--cluster", "8xa100-80gb",
                               "--global-batch", "64"])
    assert rc == 2 and "missing required field 'vocab_size'" in err, err


def test_a_model_is_named_in_errors_with_its_file(capsys, tmp_path):
    path = _config(tmp_path / "in")
    rc, _, err = _run(capsys, ["plan", "--model", path, "--cluster", "cpu-2", "--global-batch", "8"])
    assert rc == 2 and f"model 'in' ({path}) cannot fit on cpu-2" in err, err


def test_a_plan_from_an_hf_config_is_named_by_the_model(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _config(tmp_path)                     # ./config.json: the folder names it, not model_type
    small = ["--cluster", "8xa100-80gb", "--global-batch", "64", "--quiet", "--no-wide"]
    rc, out, _ = _run(capsys, ["plan", "--model", "config.json", *small])
    assert rc == 0 and out.startswith(f"{tmp_path.name} on 8xa100-80gb: "), out
    hub = _config(tmp_path / "x", {**LLAMA_GQA, "_name_or_path": "meta-llama/Llama-2-7b-hf"})
    rc, out, _ = _run(capsys, ["plan", "--model", hub, *small])
    assert rc == 0 and out.startswith("Llama-2-7b-hf on 8xa100-80gb: "), out


def test_small_models_show_their_parameters(capsys):
    rc, out, _ = _run(capsys, ["plan", "--model", "gpt-tiny", "--cluster", "cpu-2", "--global-batch",
                               "8", "--quiet"])
    assert rc == 0 and "parameters 432.3 K\n" in out and "0.000 B" not in out


# -- the plan as printed and reported ---------------------------------------------------------

V_HALF = ["--model", "gpt3-13b", "--cluster", "2x8xa100-ib200", "--global-batch", "256", "--quiet",
          "--no-wide", "--fix", "pp=2,tp=1,mbs=1,schedule=v-half"]


def test_plan_output_explains_the_batch_and_the_stages_of_each_rank(capsys):
    rc, out, _ = _run(capsys, ["plan", *V_HALF])
    assert rc == 0
    assert "schedule=v-half\nglobal batch 256 = micro-batch 1 x 32 micro-batches per iteration " \
           "(pipelined) x dp 8\n" in out, out
    assert "(4 stages, 2 per pipeline rank: rank 0 runs stages 0, 3; rank 1 runs stages 1, 2)\n" in out
    rc, out, _ = _run(capsys, ["plan", "--model", "gpt-tiny", "--cluster", "cpu-2", "--global-batch",
                               "8", "--quiet"])
    assert "schedule=none (no pipeline, pp=1)\n" in out and "stages," not in out


def _table(md: str, heading: str) -> list[dict]:
    """The rows of the first table under ``## heading`` as {column: cell}."""
    part = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    first = next(i for i, line in enumerate(part) if line.startswith("|"))
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), part[first:]))
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(cols, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_report_alternatives_say_why_each_lost(capsys, tmp_path):
    """The chosen plan is not among its alternatives; each row has its micro-batch size and
    says by how much it does not fit, or that it is slower."""
    rc, _, _ = _run(capsys, ["plan", "--model", "llama2-70b", "--cluster", "8xa100-80gb",
                             "--global-batch", "64", "--quiet", "--no-wide", "--out", str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "report.md").read_text()
    chosen, = _table(md, "Chosen plan")
    rows = _table(md, "Alternatives costed")
    assert rows and all(r["micro-batch"].isdigit() for r in rows)
    key = ("pp", "tp", "dp", "micro-batch", "micro-batches")
    assert not [r for r in rows if all(r[k] == chosen[k] for k in key)
                and r["best schedule"] == chosen["schedule"].split()[0]]
    short = [r["why it lost"] for r in rows if r["why it lost"].startswith("does not fit")]
    assert short and all(re.fullmatch(r"does not fit: needs [0-9.]+ GB per device, budget 72.0 GB "
                                      r"\(short by [0-9.]+ GB\)", s) for s in short), short
    assert all(re.fullmatch(r"[0-9.]+x slower|does not fit: .*|slower: even its least possible "
                            r"time exceeds the best plan's \(not costed further\)", r["why it lost"])
               for r in rows)


def test_report_names_the_rank_of_each_stage(capsys, tmp_path):
    rc, _, _ = _run(capsys, ["plan", *V_HALF, "--out", str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "report.md").read_text()
    stages = _table(md, "Layers, recompute and memory per stage")
    assert [(r["stage"], r["pipeline rank"]) for r in stages] == [("0", "0"), ("1", "1"), ("2", "1"),
                                                                  ("3", "0")]
    assert "as micro-batches of 1: 32 per data-parallel rank (pipelined), on 8 data-parallel ranks" in md


# -- pipes and files ---------------------------------------------------------------------------

def test_a_closed_pipe_is_a_quiet_end():
    """``ds-autoplan ... --json | head -c 600``: the reader is gone before we write."""
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "ds_autoplan", "simulate", "--json"], stdout=w,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert p.stderr == "" and p.returncode == 141, p.stderr


def test_simulate_says_what_it_wrote(capsys, tmp_path):
    g, m, t, s = (str(tmp_path / n) for n in ("g.png", "m.png", "t.json", "s.json"))
    rc, out, _ = _run(capsys, ["simulate", "--compare", "1f1b,v-half", "--plot", g, "--memory-plot", m,
                               "--trace", t, "--save", s])
    assert rc == 0
    wrote = [line for line in out.splitlines() if line.startswith("wrote ")]
    assert wrote == [f"wrote the 1f1b schedule (lowered) to {s}",
                     f"wrote the trace (open it in https://ui.perfetto.dev) to {t}",
                     f"wrote the 1f1b Gantt chart to {tmp_path / 'g-1f1b.png'}",
                     f"wrote the 1f1b activation-memory plot to {tmp_path / 'm-1f1b.png'}",
                     f"wrote the v-half Gantt chart to {tmp_path / 'g-v-half.png'}",
                     f"wrote the v-half activation-memory plot to {tmp_path / 'm-v-half.png'}"]
    assert all(os.path.exists(line.rsplit(" to ", 1)[1]) for line in wrote)
    rc, out, err = _run(capsys, ["simulate", "--plot", g, "--json"])     # stdout stays JSON
    assert rc == 0 and json.loads(out) and err.strip() == f"wrote the 1f1b Gantt chart to {g}"


def test_launch_output_folder_is_ignored_by_git():
    p = subprocess.run(["git", "check-ignore", "-q", "ds_autoplan_out/plan.json"], cwd=ROOT)
    if p.returncode == 128:
        pytest.skip("not a git checkout")
    assert p.returncode == 0


# -- plots ---------------------------------------------------------------------------------------

@pytest.fixture
def figures(monkeypatch):
    """(figure, its renderer) of every matplotlib figure saved during the test, to read its
    axes and legend where they were drawn."""
    from matplotlib.figure import Figure
    saved, real = [], Figure.savefig

    def savefig(self, *a, **k):
        out = real(self, *a, **k)
        saved.append((self, self.canvas.get_renderer()))
        return out
    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_gantt_legend_covers_no_bar_and_names_the_chunk_shades(figures, tmp_path):
    from ds_autoplan.schedule import build
    from ds_autoplan.schedule.plots import plot_gantt
    from ds_autoplan.cli.simulate_cmd import simulate_one
    sched = build("interleaved", 2, 4, v=2)
    res, _ = simulate_one(sched, 1, 1, 1)
    plot_gantt(sched, res, str(tmp_path / "g.png"))
    fig, r = figures[-1]
    ax, = fig.axes
    legend = (fig.legends or [ax.get_legend()])[0]
    assert not _overlap(legend.get_window_extent(r), ax.get_window_extent(r))
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["F: forward", "BW: backward", "first chunk", "later chunks (lighter)"]


def test_stage_memory_ticks_are_the_pipeline_ranks(figures, tmp_path):
    from ds_autoplan.report.writer import plot_stage_memory
    plot_stage_memory([10.0, 12.0], 72.0, str(tmp_path / "m.png"), "t")
    ax, = figures[-1][0].axes
    assert list(ax.get_xticks()) == [0, 1]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]
