"""RngState: a recomputation replays its forward's dropout and leaves the generators as
they were (CPU generator and Megatron-core's RNG tracker)."""
import torch

from ds_autoplan.runtime.rng import RngState


def test_replay_draws_the_same_and_restores():
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    torch.manual_seed(0)
    st = RngState()
    first = drop(x)
    after = torch.rand(4)                       # what the next forward draws without R
    torch.manual_seed(0)
    drop(x)
    with st.replay():
        again = drop(x)
    assert torch.equal(first, again)
    assert torch.equal(torch.rand(4), after)    # the replay consumed nothing


def test_megatron_tracker_states_are_replayed():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    tr = get_cuda_rng_tracker()
    saved = dict(tr.get_states())
    try:
        tr.set_states({"test-rng": torch.manual_seed(7).get_state()})
        st = RngState()
        tr.set_states({"test-rng": torch.manual_seed(8).get_state()})
        moved = tr.get_states()["test-rng"].clone()
        with st.replay():
            assert torch.equal(tr.get_states()["test-rng"], torch.manual_seed(7).get_state())
        assert torch.equal(tr.get_states()["test-rng"], moved)
    finally:
        tr.set_states(saved)


def test_a_process_without_megatron_does_not_import_it(monkeypatch):
    """The tracker is read only where the process imported Megatron-core's random module
    (nothing else can hold a state in it): a DeepSpeed rank's first checkpoint or recompute
    does not pay seconds to import megatron-core for an empty tracker."""
    import sys
    monkeypatch.delitem(sys.modules, "megatron.core.tensor_parallel.random", raising=False)
    st = RngState()
    assert st.tracker is None
    assert "megatron.core.tensor_parallel.random" not in sys.modules
    st.restore()
