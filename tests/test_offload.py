"""Offloading (issue 26): the host side of the cluster, the Offload spec, the engines' memory and
time with offload, the search dimension and the emitted configs (docs/offload.md)."""
import pytest

from ds_autoplan.spec import SpecError
from ds_autoplan.spec.cluster import load_cluster
from ds_autoplan.spec.parallel import NO_OFFLOAD, Offload, Parallel


def test_host_fields_load_check_and_share_links():
    c = load_cluster("8xa100-80gb")
    assert c.offload_missing() == [] and c.offload_missing(nvme=True) == []
    assert (c.host_memory_gb, c.cpu_cores, c.host_link_shared_by) == (2048, 128, 2)
    # two GPUs behind one PCIe switch uplink: each gets half while both copy
    assert c.host_link_each_GBps() == pytest.approx(c.host_link_GBps / 2)
    assert c.host_link_each_GBps(active=1) == pytest.approx(c.host_link_GBps)
    bare = load_cluster("64xa100-40gb")          # no host figures: cannot offload, and says what lacks
    assert bare.offload_missing() == ["host_memory_gb", "cpu_cores", "cpu_adam_rate_per_core", "host_link_GBps"]
    d = {**c.__dict__, "cpu_cores": 0}
    with pytest.raises(SpecError, match="cpu_cores must be a positive integer"):
        load_cluster(d)
    with pytest.raises(SpecError, match="host_link_GBps must be a number"):
        load_cluster({**c.__dict__, "host_link_GBps": "fast"})


@pytest.mark.parametrize("text", ["none", "opt", "opt:0.5", "opt+param", "param", "nvme:opt", "nvme:opt+param"])
def test_offload_text_round_trips(text):
    o = Offload.parse(text)
    assert o.text() == text and Offload.parse(o.text()) == o


def test_offload_refusals():
    for bad, msg in (("opt:1.5", r"\[0, 1\]"), ("gpu:opt", "unknown part"), ("nvme:none", "unknown part"),
                     ("opt:x", "must be a number")):
        with pytest.raises(SpecError, match=msg):
            Offload.parse(bad)
    with pytest.raises(SpecError, match="needs ZeRO"):
        Parallel(zero=0, offload="opt")
    with pytest.raises(SpecError, match="needs ZeRO-3"):
        Parallel(zero=2, offload="opt+param")
    assert Parallel(zero=3, offload="opt:0.25").offload == Offload(0.25)
    assert Parallel().offload is NO_OFFLOAD and Parallel(zero=1, offload="opt").as_dict()["offload"] == "opt"
