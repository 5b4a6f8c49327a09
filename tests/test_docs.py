"""The docs say what the code does: the layer table is test_layers' order, every cited section of
docs/*.md exists, every seed the code cites is named, the tour's builders are the registry's,
and a new field of Parallel reaches plan.json and the summaries without an edit to what only
passes it along (docs/architecture.md "How to add a parallel degree")."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ARCH = (DOCS / "architecture.md").read_text()
# "docs/schedules.md §8", "planner.md §3-4", "merak.md §4.4-4.5", "dawnpiper.md [decision] §7"
CITE = re.compile(r"([a-z_]+)\.md(?: \[[^\]]*\])? ?§ ?(\d+(?:\.\d+)*)(?:\s*[-–]\s*(\d+(?:\.\d+)*))?")
SEED = re.compile(r"\bseed (\d{3})\b")


def _sources():
    for d in ("ds_autoplan", "bench", "tests", "docs", "examples", "patches"):
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".md", ".patch", ".yaml"):
                yield p
    yield ROOT / "README.md"


def _sections(doc: pathlib.Path) -> set[str]:
    """The numbers of a doc's headings ("## 2. Cost model" -> "2", "### 2.1 Inputs" -> "2.1")."""
    return {m.group(1) for m in re.finditer(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", doc.read_text(), re.M)}


def test_every_cited_section_of_the_docs_exists():
    missing = []
    for p in _sources():
        text = p.read_text(errors="ignore")
        for m in CITE.finditer(text):
            doc = DOCS / f"{m.group(1)}.md"
            if not doc.exists():
                continue            # a design note outside the repository (../shared/design)
            for sec in filter(None, m.group(2, 3)):
                if sec not in _sections(doc):
                    line = text[:m.start()].count("\n") + 1
                    missing.append(f"{p.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not missing, "cited sections that do not exist:\n" + "\n".join(missing)


def test_every_cited_seed_is_named_in_the_seed_table():
    table = set(re.findall(r"^\| (\d{3}) \| ", ARCH, re.M))
    assert table == {"000", "001", "002", "003", "004"}
    cited = {m.group(1) for p in _sources() for m in SEED.finditer(p.read_text(errors="ignore"))}
    assert cited and cited <= table, cited - table
    seeds = ROOT.parent / "shared" / "seeds"
    if seeds.is_dir():                 # the numbers are the files' in ../shared/seeds
        assert {p.name[:3] for p in seeds.glob("[0-9][0-9][0-9]_*")} == table


def test_the_layer_table_is_test_layers_order():
    spec = importlib.util.spec_from_file_location("_layers", ROOT / "tests" / "test_layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    section = ARCH[ARCH.index("## Layers"):ARCH.index("## The data path")]
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", section, re.M)
    assert [int(n) for n, _ in rows] == list(range(len(layers.LAYERS)))
    for (n, cell), layer in zip(rows, layers.LAYERS):
        named = set(re.findall(r"`([a-z_.]+)`", cell.split("(")[0]))
        assert named == layer, (n, named, layer)


def test_the_docs_name_the_registered_builders():
    from ds_autoplan.schedule import names
    from ds_autoplan.schedule.builders import searched_by_default
    row = next(ln for ln in ARCH.splitlines() if ln.startswith("| builders |"))
    listed, _, default = row.split("|")[3].partition(";")
    assert [x.split("(")[0].strip() for x in listed.split(",")] == names()
    assert ", ".join(searched_by_default()) in default
    assert f"today {', '.join(searched_by_default())}" in " ".join(ARCH.split())


def test_a_new_parallel_field_needs_no_pass_along_edit():
    """A field added to Parallel (here in a subprocess, before the package reads it) is in
    plan.json, read back (an older file without it takes its default), an attribute of the
    plan and of a candidate, in a candidate's row and in ``plan --json``: plan.py,
    search/evaluate.py and cli/plan_cmd.py need no edit."""
    script = textwrap.dedent("""
        import dataclasses, json
        from ds_autoplan.spec import parallel as sp

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Parallel(sp.Parallel):
            xp: int = 1                        # a new degree, off by default

        sp.Parallel = Parallel
        from ds_autoplan.cli.plan_cmd import summary
        from ds_autoplan.plan import Plan, Prediction
        from ds_autoplan.search.evaluate import Candidate

        par = Parallel(pp=2, dp=2, xp=3, micro_batch=1, num_microbatches=4)
        plan = Plan(parallel=par, schedule="1f1b", layers_per_stage=[2, 2],
                    recompute_per_stage=[0.0, 0.0], predicted=Prediction(iteration_time_s=1.0))
        d = json.loads(plan.to_json())
        assert d["xp"] == 3 and plan.xp == 3
        assert Plan.from_dict(d) == plan and Plan(xp=3, pp=2, dp=2, num_microbatches=4).xp == 3
        del d["xp"]
        assert Plan.from_dict(d).xp == 1       # an older plan.json
        c = Candidate("x", par=par, time=1.0, parts=(2, 2))
        assert c.xp == 3 and c.summary(8, 16)["xp"] == 3
        assert summary(plan)["xp"] == 3
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
