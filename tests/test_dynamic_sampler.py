"""Sampler / data-loader wrapper and background planning for DynaPipe."""
import json
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from ds_autoplan.dynamic.cost import CostModel
from ds_autoplan.dynamic.lengths import LengthSampler
from ds_autoplan.dynamic.planner import IterationPlanner, Prefetcher
from ds_autoplan.dynamic.sampler import DynamicBatchSampler, pad_collate

COST = CostModel.gpt(hidden=512, heads=8, layers=8, stages=2)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.arange(int(self.lengths[i])) + 1


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("method,opts", [("dynapipe", {}), ("packing", {"max_len": 256}),
                                         ("token", {"max_tokens": 512})])
def test_epoch_is_exact_across_replicas_and_steps(drop_last, method, opts):
    lengths = LengthSampler(max_len=256, seed=1)(53)
    gbs, R = 10, 2
    planner = IterationPlanner(COST, 2, method=method, split_opts=opts,
                               schedule="dynapipe" if method == "dynapipe" else "1f1b")
    per_step: dict[int, list] = {}
    for rank in range(R):
        s = DynamicBatchSampler(lengths, gbs, planner, seed=4, drop_last=drop_last,
                                num_replicas=R, rank=rank)
        s.set_epoch(2)
        for plan in s.iter_plans():
            got = [i for mb in plan.microbatches for i in mb]
            assert len(got) == len(set(got))
            assert plan.shapes == [mb.shape for mb in plan.split.microbatches]
            per_step.setdefault(plan.step, []).extend(got)
        assert len(s) == sum(1 for _ in s)
    want = 50 if drop_last else 53
    flat = [i for st in per_step.values() for i in st]
    assert sorted(flat) == sorted(set(flat)) and len(flat) == want
    assert [len(per_step[k]) for k in sorted(per_step)] == [10] * 5 + ([] if drop_last else [3])
    if drop_last:
        assert set(flat) <= set(range(53))
    else:
        assert sorted(flat) == list(range(53))


def test_tail_smaller_than_the_replicas_joins_the_previous_step():
    lengths = LengthSampler(max_len=64, seed=1)(21)
    p = IterationPlanner(COST, 2)
    got = []
    for rank in range(2):
        s = DynamicBatchSampler(lengths, 10, p, num_replicas=2, rank=rank)
        assert [len(x) for x in s.step_indices()] == [10, 11]
        got += [i for plan in s.iter_plans() for mb in plan.microbatches for i in mb]
    assert sorted(got) == list(range(21))


def test_epochs_reshuffle_and_are_reproducible():
    lengths = LengthSampler(max_len=128, seed=2)(40)
    p = IterationPlanner(COST, 2)
    a = DynamicBatchSampler(lengths, 8, p, seed=0)
    e0 = [list(x) for x in a.step_indices()]
    a.set_epoch(1)
    assert [list(x) for x in a.step_indices()] != e0
    a.set_epoch(0)
    assert [list(x) for x in a.step_indices()] == e0


def test_dataloader_batches_have_the_planned_shapes():
    lengths = LengthSampler(max_len=200, seed=3)(24)
    ds = TokenDataset(lengths)
    s = DynamicBatchSampler(lengths, 12, IterationPlanner(COST, 2), seed=1)
    loader = DataLoader(ds, batch_sampler=s, collate_fn=pad_collate(pad_to=COST.pad_to))
    shapes = []
    for ids, labels in loader:
        plan = s.current_plan
        shapes.append(tuple(ids.shape))
        assert labels.shape == ids.shape and (labels[:, -1] == -100).all()
    planned = [sh for plan in s.iter_plans() for sh in plan.shapes]
    assert shapes == planned
    assert sum(shapes[i][0] for i in range(len(shapes))) == 24
    json.dumps(plan.to_dict())  # the plan ships to runtime ranks as JSON


def test_deepspeed_repeating_loader_gets_one_plan_per_step():
    from deepspeed.utils import RepeatingLoader
    lengths = LengthSampler(max_len=300, seed=4)(30)
    ds = TokenDataset(lengths)
    s = DynamicBatchSampler(lengths, 8, IterationPlanner(COST, 2), seed=2)
    it = RepeatingLoader(DataLoader(ds, batch_sampler=s, collate_fn=pad_collate()))
    seen = []
    for _ in range(2 * s.steps_per_epoch):  # two epochs through the repeating loader
        batches = [next(it)]
        plan = s.pop_plan()
        batches += [next(it) for _ in range(plan.num_microbatches - 1)]
        assert [tuple(b[0].shape) for b in batches] == plan.shapes
        seen += [i for mb in plan.microbatches for i in mb]
    assert sorted(seen) == sorted(list(range(30)) * 2)


def test_background_planner_overlaps_the_next_iteration():
    log, lock = [], threading.Lock()

    def plan(i):
        with lock:
            log.append(("plan_start", i, time.perf_counter()))
        time.sleep(0.05)
        with lock:
            log.append(("plan_end", i, time.perf_counter()))
        return i

    pf = Prefetcher(plan, range(4), depth=1, kind="thread")
    for i in pf:
        with lock:
            log.append(("train_start", i, time.perf_counter()))
        time.sleep(0.08)  # "training" on plan i
        with lock:
            log.append(("train_end", i, time.perf_counter()))
    t = {(k, i): v for k, i, v in log}
    for i in range(3):  # plan i+1 started before training on i finished
        assert t[("plan_start", i + 1)] < t[("train_end", i)]
    first = t[("plan_end", 0)] - t[("plan_start", 0)]
    assert pf.waited < first + 0.06  # only the first plan is exposed (~0.05 s)
    inline = Prefetcher(plan, range(2), kind="none")
    assert list(inline) == [0, 1] and inline.waited >= 0.1
    assert list(Prefetcher(abs, [-3, -1, -2], depth=2, kind="process")) == [3, 1, 2]


def test_planner_picks_a_feasible_schedule_under_device_memory():
    lengths = LengthSampler(max_len=1024, seed=9)(64)
    free = IterationPlanner(COST, 2)(lengths)
    cap = 0.6 * max(free.info["peak_memory"])
    limited = IterationPlanner(COST, 2, device_mem=cap)(lengths)
    assert max(limited.info["peak_memory"]) <= cap
    assert limited.lowered.has_comm() and limited.num_microbatches == free.num_microbatches


def test_bad_sampler_arguments():
    p = IterationPlanner(COST, 2)
    with pytest.raises(ValueError):
        DynamicBatchSampler([1, 2, 3], 0, p)
    with pytest.raises(ValueError):
        DynamicBatchSampler([1, 2, 3], 2, p, num_replicas=2, rank=2)
