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


# ---- memory and time per engine (cost/offload.py) ----
from ds_autoplan.cost import offload as ofl                      # noqa: E402
from ds_autoplan.cost.iteration import Config, config_cost       # noqa: E402
from ds_autoplan.cost.model import CostModel                     # noqa: E402
from ds_autoplan.spec.cluster import GB                          # noqa: E402
from ds_autoplan.spec.model import load_model                    # noqa: E402


def test_engine_bytes_per_parameter():
    """Device and host bytes as DeepSpeed 0.19.8 and Megatron-core 0.16.1 hold them (bf16, d = 4)."""
    d, full = 4, Offload(1.0)
    z1 = ofl.terms("deepspeed", "bf16", 1, d, full)
    assert z1.device == (2.0, 2.0, 0.0) and z1.host == pytest.approx(20 / d) and z1.cpu == 1 / d
    z2 = ofl.terms("deepspeed", "bf16", 2, d, full)
    assert z2.device == (2.0, 0.0, 0.0) and z2.accum == pytest.approx(4 / d)
    half = ofl.terms("deepspeed", "bf16", 3, d, Offload(0.5))          # Twin-Flow ratio 0.5
    assert half.device == (2 / d, 2 / d, 8 / d) and half.host == pytest.approx(8 / d) and half.concurrent
    inf = ofl.terms("deepspeed", "bf16", 3, d, Offload(1.0, True))     # ZeRO-Infinity on the host
    assert inf.device == (0.0, 2 / d, 0.0) and inf.fetch == 2 / d and inf.h2d == 0.0
    mg = ofl.terms("megatron", "bf16", 1, d, Offload(0.25))            # HybridDeviceOptimizer
    assert mg.device == (2.0, 4.0, 0.75 * 12 / d) and mg.host == pytest.approx(4 / d) and mg.torch_cpu
    for eng, z, off, word in (("deepspeed", 2, Offload(0.5), "ZeRO-3's"), ("megatron", 3, full, "ZeRO-1"),
                              ("megatron", 1, Offload(1.0, device="nvme"), "no NVMe")):
        with pytest.raises(SpecError, match=word):
            ofl.terms(eng, "bf16", z, d, off)


def test_config_cost_offload_fits_on_device_and_host_and_refuses_by_name():
    m, c = load_model("llama2-7b"), load_cluster("1xa100-80gb")
    cm = CostModel(m, c, "bf16", "deepspeed", execution="deepspeed")
    cfg = dict(micro_batch=1, num_microbatches=8, recompute="full")
    none = config_cost(cm, Config(zero=1, **cfg))
    opt = config_cost(cm, Config(zero=1, offload="opt", **cfg))
    assert not none.fits and opt.fits and opt.peak[0] < none.peak[0] - 70 * GB
    # the host holds 16 + 2 cb bytes per parameter (fp32 master, gradient, moments, 16-bit copies)
    assert opt.host == pytest.approx(20 * m.total_params, rel=0.02)
    assert opt.time > none.time and opt.tail > none.tail            # host step and copies
    small = CostModel(m, load_cluster({**c.__dict__, "host_memory_gb": 64}), "bf16", "deepspeed",
                      execution="deepspeed")
    assert not config_cost(small, Config(zero=1, offload="opt", **cfg)).fits      # host budget
    with pytest.raises(SpecError, match="ratio, NVMe and parameter offload are ZeRO-3's"):
        config_cost(cm, Config(zero=2, offload="opt:0.5", **cfg))
    bare = CostModel(m, load_cluster("64xa100-40gb"), "bf16", "deepspeed")
    with pytest.raises(SpecError, match="no host figures.*profile --hardware"):
        config_cost(bare, Config(zero=3, dp=64, offload="opt", micro_batch=1, num_microbatches=1))


def test_partial_offload_sits_between_none_and_full():
    """ZeRO-3 with Twin-Flow's ratio: device bytes fall and host step time rises with the ratio."""
    m, c = load_model("llama2-13b"), load_cluster("8xa100-80gb")
    cm = CostModel(m, c, "bf16", "deepspeed", execution="deepspeed")
    runs = [config_cost(cm, Config(zero=3, dp=8, offload=o, micro_batch=1, num_microbatches=4))
            for o in ("none", "opt:0.25", "opt:0.5", "opt")]
    peaks, tails = [r.peak[0] for r in runs], [r.tail for r in runs]
    assert peaks == sorted(peaks, reverse=True) and tails == sorted(tails)
