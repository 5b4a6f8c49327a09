"""The detected cluster is kept (profile/persisted.py, issue 39): ``--cluster auto`` writes the
figures it measured into the run's folder and the next launch from it on the same machine
reuses them, so the same job gets the same plan; another machine, a file that is not ours or
``--remeasure`` measure again.  Detection is replaced by a counter here: which launches
measure is what is checked, not the figures."""
from __future__ import annotations

import yaml

from ds_autoplan.cli.cluster_cmd import resolve
from ds_autoplan.profile import detect, persisted
from ds_autoplan.spec.cluster import load_cluster


def _fake_detection(monkeypatch):
    calls = []

    def detect_here(per, n, measure=False):
        calls.append((per, n))
        lat = 300.0 + 1000.0 * len(calls)        # every measurement different, as a noisy one is
        fields = {"name": f"cpu-auto-{n}x{per}", "num_nodes": n, "gpus_per_node": per, "memory_gb": 4.0,
                  "peak_tflops": 0.05, "intra_node_GBps": 2.0, "inter_node_GBps": 2.0,
                  "intra_latency_us": lat, "inter_latency_us": lat}
        return fields, {}, ["CPU: measured"], []
    monkeypatch.setattr(detect, "detect_here", detect_here)
    return calls


def test_figures_are_measured_once_per_machine_and_folder(monkeypatch, tmp_path, capsys):
    calls = _fake_detection(monkeypatch)
    out = str(tmp_path / "run")
    first = resolve("auto", 1, 2, folder=out)
    again = resolve("auto", 1, 2, folder=out)
    assert len(calls) == 1 and again == first, (calls, first, again)
    err = capsys.readouterr().err
    assert err.count("ds-autoplan: cluster auto: CPU: measured") == 2
    assert "the figures measured before on this machine, from " in err and "(--remeasure" in err
    # the kept file is a cluster file
    assert load_cluster(str(tmp_path / "run" / persisted.FILE)) == first
    # asked to, or from another folder: measured again (and kept there)
    assert resolve("auto", 1, 2, folder=out, remeasure=True).intra_latency_us != first.intra_latency_us
    assert len(calls) == 2
    monkeypatch.setenv(persisted.REMEASURE_ENV, "1")
    resolve("auto", 1, 2, folder=out)
    assert len(calls) == 3
    monkeypatch.delenv(persisted.REMEASURE_ENV)
    resolve("auto", 1, 2, folder=out)
    assert len(calls) == 3
    resolve("auto", 1, 2, folder=str(tmp_path / "other"))
    assert len(calls) == 4
    # no folder (plan/cost --cluster auto): measured every time, nothing written
    resolve("auto", 1, 2)
    assert len(calls) == 5


def test_another_machine_or_a_foreign_file_is_measured_again(monkeypatch, tmp_path):
    calls = _fake_detection(monkeypatch)
    out = tmp_path / "run"
    resolve("auto", 1, 2, folder=str(out))
    path = out / persisted.FILE
    d = yaml.safe_load(path.read_text())
    assert d["machine"]["ranks_per_node"] == 2 and d["machine"]["nodes"] == 1
    # another layout of ranks on the same host is another machine
    resolve("auto", 1, 4, folder=str(out))
    assert len(calls) == 2
    # the file's machine changed by hand: another machine, measured again, and the file not
    # replaced (it is not ours any more: the folder's manifest)
    d["machine"]["hosts"] = ["elsewhere"]
    path.write_text(yaml.safe_dump(d))
    assert persisted.load(str(out), persisted.machine(detect.facts_here(2, 1))) is None
    resolve("auto", 1, 2, folder=str(out))
    assert len(calls) == 3
    assert yaml.safe_load(path.read_text())["machine"]["hosts"] == ["elsewhere"]
    for junk in ("{not: [yaml", "- a list", ""):
        path.write_text(junk)
        assert persisted.load(str(out), persisted.machine(detect.facts_here(2, 1))) is None


def test_a_kept_file_whose_figures_make_no_cluster_is_measured_again(monkeypatch, tmp_path):
    """Same machine, but a figure a cluster cannot hold (an older format, an edit): the launch
    measures again instead of stopping on the file."""
    calls = _fake_detection(monkeypatch)
    out = tmp_path / "run"
    resolve("auto", 1, 2, folder=str(out))
    path = out / persisted.FILE
    d = yaml.safe_load(path.read_text())
    mach = d["machine"]
    d["cluster"]["peak_tflops"] = "fast"
    path.write_text(yaml.safe_dump(d))
    assert persisted.load(str(out), mach) is None
    assert resolve("auto", 1, 2, folder=str(out)).peak_tflops == 0.05
    assert len(calls) == 2
