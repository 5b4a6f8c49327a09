"""The benchmarks' calibrated sleep layer (ds_autoplan.models.sleep): exact
gradients, fused or split into B and W, and the activation-memory model it stands for."""
import pytest
import torch

from ds_autoplan.models.sleep import SleepLayer
from ds_autoplan.runtime.memtrack import MemTracker
from ds_autoplan.runtime.splitgrad import WeightGradStore


def _grads(layer, x, split: bool, tracker=None):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    store = WeightGradStore()
    with store.deferring(tracker) if split else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t):
        y.backward(torch.full_like(y, 2.0))
    held = len(store)
    store.run_all()
    return x.grad, layer.p.grad, held


@pytest.mark.parametrize("w_keeps", ["all", "grad"])
def test_split_and_fused_gradients_are_exact(w_keeps):
    x = torch.randn(2, 3, 4)
    fused = SleepLayer(0.0, 0.0, 0.0, inner=2, w_keeps=w_keeps)
    split = SleepLayer(0.0, 0.0, 0.0, inner=2, w_keeps=w_keeps)
    gx, gp, held = _grads(fused, x, split=False)
    gx2, gp2, held2 = _grads(split, x, split=True)
    assert held == 0 and held2 == 1              # only the split backward defers W
    assert torch.equal(gx, gx2) and torch.equal(gx, torch.full_like(x, 2.0))  # dy/dx = p = 1
    assert torch.allclose(gp, gp2) and torch.allclose(gp, (2.0 * x).sum().reshape(1))


@pytest.mark.parametrize("w_keeps", ["all", "grad"])
def test_memory_model(w_keeps):
    # forward saves the input and `inner` copies; B keeps everything ('all': a_B = 0, plus
    # B's one-element weight-gradient sum) or the input and the output gradient ('grad')
    x = torch.randn(1, 4, 8, requires_grad=True)
    unit = x.numel() * 4
    layer = SleepLayer(0.0, 0.0, 0.0, inner=2, w_keeps=w_keeps)
    tr = MemTracker(exclude=[x])
    with tr.track():
        y = layer(x * 1.0)
    assert tr.current == 3 * unit
    store = WeightGradStore()
    with store.deferring(tr):
        y.backward(torch.ones_like(y))
    assert tr.current == (3 * unit + 4 if w_keeps == "all" else 2 * unit)
    store.run_all()
    assert tr.current == 0


def test_shape_dependent_times_are_called_with_the_input_shape():
    seen = []
    layer = SleepLayer(lambda sh: seen.append(("f", sh)) or 0.0,
                       lambda sh: seen.append(("b", sh)) or 0.0)
    layer(torch.ones(2, 5, 1, requires_grad=True)).sum().backward()
    assert seen == [("f", (2, 5, 1)), ("b", (2, 5, 1))]
    with pytest.raises(ValueError):
        SleepLayer(0.0, 0.0, w_keeps="some")


def test_graph_split_sleeps_b_and_w_in_torch_pipelinings_passes():
    """``split='graph'``: under torch.distributed.pipelining's backward split (input gradients,
    then weight gradients from the autograd graph) B sleeps only in the first pass and W only
    in the second; gradients and saved bytes (everything kept until W) equal the default
    layer's."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    calls = []

    def layers(split):
        return [SleepLayer(*(lambda sh, k=k: calls.append(k) or 0.0 for k in "fbw"), inner=2,
                           split=split) for _ in range(2)]
    x0 = torch.randn(2, 3, 4)
    out = {}
    for split in ("defer", "graph"):
        ls = layers(split)
        x = x0.clone().requires_grad_(True)
        tr = MemTracker(exclude=[p for layer in ls for p in layer.parameters()])
        with tr.track():
            y = ls[1](ls[0](x))
        held_f = tr.current
        loss = (y * torch.arange(y.numel()).view_as(y)).sum()
        calls.clear()
        if split == "graph":
            _, groups = stage_backward_input([loss], None, [x], [layer.p for layer in ls])
            assert calls == ["b", "b"] and tr.current == held_f
            calls.clear()
            stage_backward_weight([layer.p for layer in ls], groups)
            assert calls == ["w", "w"]
        else:
            loss.backward()
        assert tr.current == 0
        out[split] = (held_f, x.grad, [layer.p.grad for layer in ls])
    assert out["graph"][0] == out["defer"][0] == 2 * 3 * x0.numel() * 4   # input + 2 copies, 2 layers
    assert torch.equal(out["graph"][1], out["defer"][1])
    assert all(torch.allclose(a, b) for a, b in zip(out["graph"][2], out["defer"][2]))
    with pytest.raises(ValueError):
        SleepLayer(0.0, 0.0, split="graph", w_keeps="grad")


@pytest.mark.parametrize("split", ["defer", "graph"])
def test_no_input_gradient_no_b(split):
    """B is the input gradient: the first layer of a stage whose input needs none (the first
    stage) skips B's sleep in both splits, as autograd skips the work; W still runs."""
    calls = []
    ls = [SleepLayer(*(lambda sh, k=k, i=i: calls.append(k + str(i)) or 0.0 for k in "fbw"),
                     split=split) for i in range(2)]
    y = ls[1](ls[0](torch.randn(2, 3, 4)))
    calls.clear()
    y.sum().backward()
    assert sorted(calls) == ["b1", "w0", "w1"]
    assert all(layer.p.grad is not None for layer in ls)
