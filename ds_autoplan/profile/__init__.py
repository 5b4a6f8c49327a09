"""Profiling real models: torch.fx tracing with leaf proxy modules (Merak), per-unit costs
measured on the device, hardware micro-benchmarks.  The decisions made from a profile
(DawnPiper's partition and keep/recompute/swap policy) are search: ``ds_autoplan.search.memopt``
and ``ds_autoplan.search.dawnpiper``.

    prof = profile_model(models.resolve_model("gpt-tiny"), batch_size=2, out="profile.json")
    spec = to_model_spec(prof)                      # the planner's ModelSpec
    prof = load_profile("profile.json", "gpt-tiny")  # refused with the reason on mismatch
    pols = search.memopt.memory_policy(prof, [(0, 5), (5, 10)], cap_bytes, inflight_copies(schedule),
                         per_tensor=True)               # keep / recompute / swap per tensor
    opts = search.memopt.stage_memory_options(pols)   # recompute_per_stage, swap (runtime.swap.SwapPolicy)
    rep = search.dawnpiper.partition_report(prof, 4, cap_bytes, per_tensor=True)   # DawnPiper cuts + policies
"""
from .profile import (ModelEntry, Profile, ProfileMismatch, Unit, device_info, is_profile, load_profile,
                      model_fingerprint, profile_model)
from .hardware import collective_bandwidth, hardware_cluster_spec, host_link_GBps, matmul_flops
from .spec import to_model_spec
from .trace import TraceFailure, auto_leaf_classes, build_chain, trace

__all__ = ["ModelEntry", "Profile", "ProfileMismatch", "TraceFailure", "Unit", "auto_leaf_classes",
           "build_chain", "collective_bandwidth", "device_info", "hardware_cluster_spec",
           "host_link_GBps", "is_profile", "load_profile", "matmul_flops", "model_fingerprint",
           "profile_model", "to_model_spec", "trace"]
