"""Test harness: cases and checks that run on several gloo ranks.

Import it as ``harness`` (pytest puts ``tests/`` on ``sys.path``); :data:`ENV` gives spawned
ranks the same (``spawn(["-m", "harness.ds_pipeline", ...], world, env=ENV)``).
"""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)}

# Registered builders the runtime tests do not run, each with the reason.  Every other
# registered builder runs there, so a new builder is covered and a renamed one fails here
# (an exclusion naming no registered builder is an error) instead of silently dropping out.
RUNTIME_EXCLUDED: dict[str, str] = {}


def registered(exclude=()) -> list[str]:
    """The registered schedule builders a runtime test runs: all but :data:`RUNTIME_EXCLUDED`
    and ``exclude`` (names the calling test covers otherwise)."""
    from ds_autoplan.schedule import names
    unknown = (set(RUNTIME_EXCLUDED) | set(exclude)) - set(names())
    assert not unknown, f"excluded schedule builders that are not registered: {sorted(unknown)}"
    return [n for n in names() if n not in RUNTIME_EXCLUDED and n not in exclude]


def option_groups(argv) -> list[list[str]]:
    """A worker's command line split at each ``--then`` (``A --then B``: option groups A and
    B, run one after the other in the same process group)."""
    groups = [[]]
    for a in argv:
        groups.append([]) if a == "--then" else groups[-1].append(a)
    return groups


def joined_groups(groups) -> list[str]:
    """The command line of several option groups (:func:`option_groups` splits it back)."""
    return [a for i, g in enumerate(groups) for a in (["--then"] if i else []) + list(g)]


def group_fixture(fixture: str, i: int):
    """A module fixture: option group ``i`` of module fixture ``fixture``'s results."""
    import pytest

    @pytest.fixture(scope="module")
    def group(request):
        return request.getfixturevalue(fixture)[i]
    return group


def clients_dir():
    """The real client code the client tests copy and run (never edit it): ``$DS_AUTOPLAN_CLIENTS``
    when set, else ``shared/clients`` beside the repository (``<repo>/../shared/clients``, as CI
    lays a clean clone out beside a copy of ``shared/``), else in a folder above it (a worktree
    one level deeper).  ``None`` when there is none (the client tests skip, saying so)."""
    from pathlib import Path
    env = os.environ.get("DS_AUTOPLAN_CLIENTS")
    root = Path(TESTS).parent
    for c in [Path(env)] if env else [p / "shared" / "clients" for p in root.parents]:
        if c.is_dir():
            return c
    return None


CLIENTS_SKIP = ("no client code: ../shared/clients (beside the repository) is missing; set "
                "DS_AUTOPLAN_CLIENTS to its folder")


def leftovers(mark: str, wait: float = 0.0) -> list[str]:
    """This user's live processes whose environment holds ``DS_AUTOPLAN_TEST_MARK=mark`` (a
    launch's every process inherits it), as "pid command" lines; waits up to ``wait`` seconds
    for them to end first."""
    import time
    needle = f"DS_AUTOPLAN_TEST_MARK={mark}".encode()
    deadline = time.time() + wait
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":     # ended, not yet reaped
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid} {cmd[:200]}")
            except OSError:          # gone meanwhile, or another user's
                pass
        if not found or time.time() >= deadline:
            return found
        time.sleep(0.2)
