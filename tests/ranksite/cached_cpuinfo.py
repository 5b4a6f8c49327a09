"""Test processes only: py-cpuinfo's answer, asked once per session.

DeepSpeed's op loader asks ``cpuinfo.get_cpu_info()`` twice per op it loads (``-march`` and the
SIMD width of the build flags), and each call starts a fresh Python that times the clock:
seconds per op, in every rank of every launch.  tests/conftest.py asks once at session start
and saves the answer in ``$DS_AUTOPLAN_TEST_CPUINFO``; importing this module (every test
process does, through ``sitecustomize``) answers from that file.  Same machine, same answer,
so the build flags -- and the ops built -- are the same."""
import os


def install() -> None:
    path = os.environ.get("DS_AUTOPLAN_TEST_CPUINFO")
    if not path or not os.path.isfile(path):
        return
    try:
        from cpuinfo import cpuinfo       # the module get_cpu_info lives in
    except ImportError:
        return
    with open(path) as f:
        text = f.read()
    cpuinfo.get_cpu_info_json = lambda: text


install()
