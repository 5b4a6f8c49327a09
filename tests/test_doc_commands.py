"""Every command README.md and docs/*.md show runs as written (issue 27).

A command is a line of a page's code block that starts with a program (``ds-autoplan``,
``deepspeed``, ``torchrun``, ``python``, ...; the README's ``$`` prompt dropped, a trailing
``# comment`` too), split at ``&&``.  Each part meets the first rule of ``RULES`` it matches:
``RUN`` parts run here, page by page in the page's order, in a scratch folder holding the
repository's ``configs/`` and ``examples/`` (and, where a page reads a file it has you make on a
GPU machine, a recorded one: ``FIXTURES``); every other rule names the test that runs the
command or says why it cannot run on this CPU machine.  A command no rule matches fails
``test_every_command_has_a_rule``: a new command in a doc needs its rule here.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAM = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+ +)*(ds-autoplan|deepspeed|torchrun|python3?|cd|nvidia-smi|"
                     r"patch|pip)( |$)")
RUN = "run here"
SETUP = ("sets up a virtual environment from the package registries: .ci/run runs the README's test "
         "command on a clean clone, the lead both README commands on a fresh one; "
         "tests/test_readme.py checks them")
MULTI_GPU = "needs {what}: no GPU here; "

# (pattern on one command part, RUN or why it does not run here / which test runs it)
RULES = [
    (r"^python3 -m venv \.venv$|^\. \.venv/bin/activate$|^pip install ", SETUP),
    (r"^python -m pytest", "the whole suite: .ci/run, on a clean clone"),
    (r"^nvidia-smi ", "needs an NVIDIA GPU and its driver; tests/test_nodes.py parses recorded outputs of "
                      "both (tests/harness/recorded_smi.py), which stand in for them where the page runs"),
    (r"^torchrun --nnodes 2 .* -m ds_autoplan cluster", MULTI_GPU.format(what="2 nodes of 8 GPUs") +
     "tests/test_nodes.py runs `python -m ds_autoplan cluster` in one launch of 2 nodes x 2 CPU ranks"),
    (r"^ds-autoplan (presets|plan|cost|simulate|profile|cluster|calibrate)( |$)", RUN),
    (r"^ds-autoplan patch deepspeed( --revert)?$",
     "edits the installed DeepSpeed: tests/test_runtime_deepspeed_launch.py patches, launches and reverts "
     "in one test"),
    (r"(^|DS_AUTOPLAN_\S+ )deepspeed --autoplan --num_gpus 2 train\.py |^ds-autoplan launch .*--num_gpus 2 train\.py ",
     "DeepSpeedExamples' pipeline_parallelism script (../shared/clients): tests/test_clients_deepspeed.py runs "
     "these lines as written, with a free --master_port"),
    (r"^deepspeed --autoplan --num_gpus 8 train\.py .*\.\.\.$",
     MULTI_GPU.format(what="8 GPUs and your script") + "its CPU form is in the next block"),
    (r"^DS_ACCELERATOR=cpu ds-autoplan launch --num_gpus 2 examples/hf_(trainer|accelerate)\.py",
     "tests/test_hf_clients.py runs both examples so (test_hf_script_trains_planned_with_the_losses_of_a_run_by_hand)"),
    (r"^DS_ACCELERATOR=cpu ds-autoplan launch --tp 2 --num_gpus 2 examples/hf_trainer\.py$",
     "tests/test_hf_clients.py runs it so (test_autotp_trainer_trains_planned_as_by_hand_and_as_one_replica)"),
    (r"^cd Megatron-LM$|^patch -p1 < /path/to/ds_autoplan/patches/megatron-lm-pretrain_gpt\.patch$",
     "Megatron-LM's own checkout (../shared/clients): tests/test_megatron_lm_client.py applies the patch to a copy"),
    (r"^DS_AUTOPLAN_PLAN=out/tiny/plan\.json torchrun --nproc_per_node 2 pretrain_gpt\.py ",
     "tests/test_megatron_lm_client.py runs the README's line for every schedule on 2 CPU ranks (CUDA-only "
     "kernels shimmed, tests/megatron_lm_cpu.py)"),
    (r"^DS_AUTOPLAN_PLAN=out/plan/plan\.json torchrun --nproc_per_node 8 \.\.\. ",
     MULTI_GPU.format(what="8 GPUs, your data and model flags (`...`)") + "its CPU form is the README's, run "
     "by tests/test_megatron_lm_client.py"),
    (r"^deepspeed --num_gpus 2 examples/train_deepspeed\.py |"
     r"^ds-autoplan launch --model gpt-tiny --num_gpus 2 examples/train_deepspeed\.py$|"
     r"^ds-autoplan launch --model gpt-tiny --cluster cluster\.yaml --out run1 --num_gpus 2 "
     r"examples/train_deepspeed\.py --steps 5$", RUN),
    (r"^ds-autoplan launch --calibrate 3 --model gpt-tiny --cluster cluster\.yaml --out run --num_gpus 2 "
     r"examples/train_deepspeed\.py --steps 100$",
     "100 steps and a restart: tests/test_replan.py runs this loop on the example for 10 steps on a cluster "
     "file of fixed figures (test_the_example_switches_and_trains_as_the_resumed_run)"),
    (r"^ds-autoplan launch --calibrate 3 --model gpt-tiny --cluster cluster\.yaml --out run -- torchrun "
     r"--nproc_per_node 2 pretrain_gpt\.py ",
     "Megatron-LM's patched checkout (../shared/clients) and a restart: tests/test_megatron_replan.py runs this "
     "loop with the CPU shim before the script, 10 steps, on cluster files of fixed figures"),
    (r"^torchrun --nproc_per_node 2 examples/train_megatron\.py ", "tests/test_runtime_megatron.py runs the example"),
    (r"^(DS_ACCELERATOR=cpu )?deepspeed --num_gpus 2 examples/train_dynamic\.py ",
     "tests/test_runtime_dynamic.py runs the example"),
    (r"^torchrun --nproc_per_node 2 examples/train_megatron_dynamic\.py ",
     "tests/test_runtime_megatron_dynamic.py runs the example"),
    (r"^python bench/\S+\.py --quick$",
     "a benchmark: timed multi-rank runs for a quiet machine, run by hand (DEVELOPERS.md: never timed "
     "in the suite); docs/benchmarks.md records what each measured"),
]

# files a page has you make elsewhere, recorded ones in their place
def _fixtures(page: str) -> dict:
    if page == "cluster.md":
        from harness.recorded_smi import TOPO_H200
        return {"smi.csv": "name, memory.total [MiB]\n" + "NVIDIA H200, 143771 MiB\n" * 8,    # 8 x H200 HGX
                "topo.txt": TOPO_H200}
    if page == "huggingface.md":      # "your" config.json
        return {"config.json": (ROOT / "configs" / "hf" / "Meta-Llama-3-8B" / "config.json").read_text()}
    return {}


def _code_lines(text: str):
    """(line number, text) of the lines of indented and fenced (not python) code blocks."""
    lines, fence, inblock, prev_blank = text.split("\n"), None, False, True
    for i, ln in enumerate(lines, 1):
        if fence is not None:
            if ln.strip().startswith("```"):
                fence = None
            elif fence in ("", "bash", "sh", "shell", "console"):
                yield i, ln
            continue
        if ln.strip().startswith("```"):
            fence = ln.strip()[3:].strip()
        elif ln.startswith("    ") and (prev_blank or inblock):
            inblock = True
            yield i, ln[4:]
        else:
            inblock = inblock and not ln.strip()
        prev_blank = not ln.strip()


def commands(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line, command part) of ``page``, in order."""
    out = []
    for i, ln in _code_lines(page.read_text()):
        ln = re.sub(r"^\$ ", "", ln.strip())
        if PROGRAM.match(ln):
            ln = re.sub(r"\s{2,}#\s.*$|\s+#\s[^'\"]*$", "", ln)
            out += [(i, part.strip()) for part in ln.split(" && ")]
    return out


def rule_of(cmd: str):
    return next(((p, why) for p, why in RULES if re.search(p, cmd)), None)


def test_every_command_has_a_rule():
    missing, used = [], set()
    for page in PAGES:
        for line, cmd in commands(page):
            r = rule_of(cmd)
            if r is None:
                missing.append(f"{page.relative_to(ROOT)}:{line}: {cmd}")
            else:
                used.add(r[0])
    assert not missing, "commands with no rule in tests/test_doc_commands.py RULES:\n" + "\n".join(missing)
    assert used == {p for p, _ in RULES}, f"rules no page uses any more: {set(p for p, _ in RULES) - used}"
    for _, why in RULES:               # a test named is one that exists
        for name in re.findall(r"tests/\w+\.py", why):
            assert (ROOT / name).is_file(), name


def _runnable():
    return [p for p in PAGES if any(rule_of(c)[1] == RUN for _, c in commands(p) if rule_of(c))]


@pytest.mark.multiproc
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", _runnable(), ids=lambda p: p.name)
def test_the_commands_of_a_page_run(page, tmp_path):
    """The page's runnable commands, in order, each exiting 0 without a traceback; a launch gets
    a free --master_port (other launches share this machine)."""
    from ds_autoplan.runtime.launch import free_port
    for d in ("configs", "examples"):
        (tmp_path / d).symlink_to(ROOT / d)
    for name, text in _fixtures(page.name).items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    for line, cmd in commands(page):
        if rule_of(cmd)[1] != RUN:
            continue
        if cmd.startswith(("deepspeed ", "ds-autoplan launch ")):
            cmd = cmd.replace(" --num_gpus 2 ", f" --num_gpus 2 --master_port {free_port()} ", 1)
        r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=900)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "Traceback" not in out, f"{page.name}:{line}: {cmd}\n{out}"
