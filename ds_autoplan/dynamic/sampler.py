"""Batch sampler that yields DynaPipe micro-batches, plus a padding collate function.

:class:`DynamicBatchSampler` is a ``torch.utils.data.Sampler`` of index lists (one list per
micro-batch), i.e. a ``batch_sampler`` for ``torch.utils.data.DataLoader`` -- the same
interface as Megatron's pretraining batch samplers; for DeepSpeed build the loader
yourself (``DataLoader(ds, batch_sampler=s, collate_fn=pad_collate())``, optionally wrapped
in ``deepspeed.utils.RepeatingLoader``) and pass its iterator to ``engine.train_batch``.

Exactness: an epoch is one permutation of the dataset cut into optimizer steps of exactly
``global_batch_size`` samples (the last step is shorter unless ``drop_last``; a tail of fewer
samples than replicas joins the step before it); the step's
samples are dealt to data-parallel replicas (sorted by length, round-robin, so replicas get
similar lengths) and each replica splits its share into micro-batches.  No sample is lost
or repeated within an epoch.

Per step the runtime needs the :class:`~ds_autoplan.dynamic.planner.IterationPlan`
(number of micro-batches, shape plan, per-rank action and send/recv lists):
:meth:`DynamicBatchSampler.iter_plans` yields them (planned ahead in a background worker).
When iterating through a ``DataLoader``, ``__iter__`` queues each plan as it starts issuing
its micro-batches and :meth:`DynamicBatchSampler.pop_plan` hands them out in order: after
pulling the first batch of a step, ``pop_plan()`` is that step's plan (also with loader
workers prefetching ahead).  ``current_plan`` is the plan ``__iter__`` is issuing now.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from .planner import IterationPlan, IterationPlanner, Prefetcher


class DynamicBatchSampler(Sampler[list[int]]):
    def __init__(self, lengths, global_batch_size: int, planner: IterationPlanner, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_replicas: int = 1, rank: int = 0, prefetch: int = 1,
                 background: str = "thread"):
        self.lengths = np.asarray(lengths)
        if global_batch_size < 1:
            raise ValueError("global_batch_size must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        if global_batch_size < num_replicas:
            raise ValueError("global_batch_size must be at least the number of replicas")
        self.gbs, self.planner = int(global_batch_size), planner
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.prefetch, self.background = prefetch, background
        self.epoch = 0
        self.current_plan: IterationPlan | None = None
        self._issued: deque = deque()
        self._count: dict[int, int] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def step_indices(self) -> list[np.ndarray]:
        """The dataset indices of every optimizer step of this epoch (all replicas)."""
        N = len(self.lengths)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(N, generator=g).numpy()
        else:
            perm = np.arange(N)
        stop = N - N % self.gbs if self.drop_last else N
        steps = [perm[i:min(i + self.gbs, stop)] for i in range(0, stop, self.gbs)]
        if len(steps) > 1 and len(steps[-1]) < self.num_replicas:
            # a tail too small to give every replica a sample joins the step before it
            steps[-2:] = [np.concatenate(steps[-2:])]
        return steps

    def replica_share(self, idx: np.ndarray) -> np.ndarray:
        """This replica's samples of one step: sort by (total) length, deal round-robin."""
        key = self.lengths[idx] if self.lengths.ndim == 1 else self.lengths[idx].sum(axis=1)
        srt = idx[np.argsort(-key, kind="stable")]
        return srt[self.rank::self.num_replicas]

    def _job(self, item):
        step, idx = item
        return self.planner(self.lengths[idx], ids=idx, step=step)

    def iter_plans(self) -> Iterator[IterationPlan]:
        jobs = [(s, self.replica_share(idx)) for s, idx in enumerate(self.step_indices())]
        yield from Prefetcher(self._job, jobs, depth=self.prefetch, kind=self.background)

    def __iter__(self) -> Iterator[list[int]]:
        n = 0
        for plan in self.iter_plans():
            self.current_plan = plan
            self._issued.append(plan)
            for mb in plan.microbatches:
                n += 1
                yield list(mb)
        self._count[self.epoch] = n

    def pop_plan(self) -> IterationPlan:
        """The oldest plan whose micro-batches have been issued and not yet claimed."""
        if not self._issued:
            raise RuntimeError("no plan issued yet: pull the step's first batch first")
        return self._issued.popleft()

    def __len__(self) -> int:
        """Micro-batches this replica yields in the current epoch (plans it if needed)."""
        if self.epoch not in self._count:
            self._count[self.epoch] = sum(len(self._job((s, self.replica_share(i))).microbatches)
                                          for s, i in enumerate(self.step_indices()))
        return self._count[self.epoch]

    @property
    def steps_per_epoch(self) -> int:
        return len(self.step_indices())


def pad_collate(pad_to: int = 8, pad_id: int = 0, ignore_index: int = -100):
    """Collate 1-D token tensors (or lists) into ``(input_ids, labels)`` of shape
    ``[mbs, roundup(max len, pad_to)]`` -- the shape the plan promised for the micro-batch.
    Labels are the inputs shifted left, ``ignore_index`` on padding."""
    def collate(samples):
        seqs = [torch.as_tensor(s, dtype=torch.long) for s in samples]
        L = max(len(s) for s in seqs)
        L = (L + pad_to - 1) // pad_to * pad_to
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), L), ignore_index, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
            labels[i, :len(s) - 1] = s[1:]
        return ids, labels
    return collate


class VarLenTokens(torch.utils.data.Dataset):
    """Synthetic variable-length data: sample ``i`` is ``lengths[i]`` random token ids in
    ``[1, vocab)`` (seeded by ``i``); with :class:`DynamicBatchSampler` and
    :func:`pad_collate`, e.g. over lengths from :class:`ds_autoplan.dynamic.LengthSampler`."""

    def __init__(self, lengths, vocab: int, seed: int = 0):
        self.lengths, self.vocab, self.seed = [int(x) for x in lengths], vocab, seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        return torch.randint(1, self.vocab, (self.lengths[i],), generator=g)
