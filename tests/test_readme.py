"""README keeps the two commands, .ci/run runs the README's test command, and the README stays a
landing page a newcomer reads in five minutes (issue 27): the reference lives in docs/."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_has_two_commands_and_ci_runs_the_test_one():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "README.md grew past 150 lines: put reference into docs/"
    cmds = re.findall(r"^    \$ (.+)$", text, flags=re.M)
    assert len(cmds) == 2
    main_job, tests = cmds
    assert "pip install" in main_job and "ds-autoplan plan" in main_job
    assert "pip install" in tests and "python -m pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r"TEST_CMD=\$\((.+)\)$", ci, flags=re.M).group(1)
    out = subprocess.run(extract, shell=True, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert out == tests
