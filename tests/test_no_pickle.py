"""Nothing ds_autoplan reads can run code: every ``torch.load`` in the package passes
``weights_only=True``, no module unpickles (``pickle.load(s)``, ``torch.distributed``'s
``*_object*`` collectives, which unpickle what other ranks send), except the allow-listed
metadata unpickler of runtime/checkpoint_files.py (docs/reliability.md); and the text
collectives that replace the object ones carry exact values."""
from __future__ import annotations

import ast
import json
import pathlib

import pytest
import torch

import ds_autoplan

ROOT = pathlib.Path(ds_autoplan.__file__).resolve().parent
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list"}


def _calls():
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
                yield path.relative_to(ROOT), node, name, owner


def test_every_torch_load_is_weights_only():
    loads = [(p, n) for p, n, name, owner in _calls() if name == "load" and owner == "torch"]
    assert loads, "the scan found no torch.load at all: it is broken"
    for p, n in loads:
        kw = {k.arg: k.value for k in n.keywords}
        assert "weights_only" in kw and getattr(kw["weights_only"], "value", None) is True, \
            f"{p}:{n.lineno}: torch.load without weights_only=True"


def test_no_unpickling_outside_the_allow_listed_metadata_reader():
    bad = [f"{p}:{n.lineno} {owner}.{name}" for p, n, name, owner in _calls()
           if name in OBJECT_COLLECTIVES or (owner == "pickle" and name in ("load", "loads"))]
    assert bad == [], bad
    # the one pickle reader is a restricted Unpickler subclass (find_class allow-list)
    src = (ROOT / "runtime" / "checkpoint_files.py").read_text()
    assert "class _MetadataUnpickler(pickle.Unpickler)" in src and "def find_class" in src


def test_text_collectives_carry_exact_values_in_one_process():
    from ds_autoplan.runtime.common.collectives import broadcast_text, gather_text
    assert gather_text("plan") == ["plan"] and broadcast_text("x") == "x"
    # the Megatron-LM hook's JSON form of loss dicts is exact for every dtype it carries
    for dt in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        v = (torch.randn(3) * 1e3).to(dt)
        rows = json.loads(json.dumps([str(v.dtype).removeprefix("torch."), list(v.shape),
                                      v.reshape(-1).tolist()]))
        back = torch.tensor(rows[2], dtype=getattr(torch, rows[0])).reshape(rows[1])
        assert back.dtype == v.dtype and torch.equal(back, v)


@pytest.mark.parametrize("text", ["", "é ü ∑ plan {\"a\": 1}"])
def test_broadcast_text_between_two_gloo_ranks(text):
    from ds_autoplan.runtime.launch import launch
    out = launch(2, [dict(fn=f"{__file__}:_broadcast_case", text=text)], timeout=60)
    assert [rows[0] for rows in out] == [{"got": text, "all": [text, "rank 1"]}] * 2


def _broadcast_case(case):
    import torch.distributed as dist
    from ds_autoplan.runtime.common.collectives import broadcast_text, gather_text
    me = dist.get_rank()
    got = broadcast_text(case["text"] if me == 0 else "ignored", src=0)
    return {"got": got, "all": gather_text(case["text"] if me == 0 else "rank 1")}
