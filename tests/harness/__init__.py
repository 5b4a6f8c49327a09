"""Test harness: cases and checks that run on several gloo ranks.

Import it as ``harness`` (pytest puts ``tests/`` on ``sys.path``); :data:`ENV` gives spawned
ranks the same (``spawn(["-m", "harness.ds_pipeline", ...], world, env=ENV)``).
"""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)}
