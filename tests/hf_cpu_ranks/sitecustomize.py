"""Test-side, for the runs by hand of tests/test_hf_clients.py (plain ``deepspeed``, no
``--autoplan``): Accelerate counts a CPU rank's world as 1 (docs/huggingface.md, "Several CPU
ranks"); this gives those runs the same backend fix the --autoplan hook installs, and nothing
else, so they run on 2 CPU ranks like the planned ones."""
try:          # tests/ranksite's sitecustomize, which this one shadows: py-cpuinfo asked once
    import cached_cpuinfo  # noqa: F401
except ImportError:
    pass

from ds_autoplan.clients.hf import install_cpu_ranks  # noqa: E402

install_cpu_ranks()
