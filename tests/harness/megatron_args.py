"""Megatron-LM's own argument parser on emitted flag lists (tests/megatron_argcheck.py run on
a copy of ../shared/clients/megatron-lm-core_v0.16.1)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from . import TESTS, clients_dir


def _client() -> str:
    """megatron-lm-core_v0.16.1 in the client folder (:func:`harness.clients_dir`); '' if absent."""
    c = clients_dir()
    return str(c / "megatron-lm-core_v0.16.1") if c and (c / "megatron-lm-core_v0.16.1").is_dir() else ""


CLIENT = _client()


def argcheck(tmp_path, flag_lists: list, world: int, config: bool = False) -> list[dict]:
    """One result per flag list: Megatron's derived sizes (and ``model`` values) or its error;
    ``config``: also build megatron-core's TransformerConfig from the arguments."""
    client = tmp_path / "megatron-lm"
    shutil.copytree(CLIENT, client)
    env = dict(os.environ, WORLD_SIZE=str(world), **({"ARGCHECK_CONFIG": "1"} if config else {}))
    r = subprocess.run([sys.executable, os.path.join(TESTS, "megatron_argcheck.py"), str(client)],
                       input=json.dumps(flag_lists), capture_output=True, text=True, env=env,
                       timeout=600)
    out = [json.loads(x.split(" ", 1)[1]) for x in r.stdout.splitlines() if x.startswith("ARGCHECK ")]
    assert len(out) == len(flag_lists), r.stderr
    return out
