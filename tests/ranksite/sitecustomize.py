"""On the PYTHONPATH of every process a test starts (tests/conftest.py puts it there)."""
import cached_cpuinfo  # noqa: F401
