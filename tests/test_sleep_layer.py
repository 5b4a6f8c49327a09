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
