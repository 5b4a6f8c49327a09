"""A plan without pipeline parallelism in DeepSpeed's plain engine (``DeepSpeedEngine``): what
ZeRO-2 and ZeRO-3 need, since ``PipelineEngine`` asserts ZeRO < 2 (docs/runtimes.md §1.3).

The plan's one stage (every layer of the script's ``PipelineModule``, cut and recomputed as the
pipeline path does: :func:`api.build_module`) becomes one ``nn.Module`` (:class:`StageModule`)
whose forward runs the layers and whose ``loss_fn`` is the module's; :class:`DataParallelEngine`
adds ``PipelineEngine``'s ``train_batch`` / ``eval_batch`` on top of DeepSpeed's forward,
backward and step, so a pipeline script trains unchanged."""
from __future__ import annotations

import contextlib

import torch
from deepspeed import comm as dist
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.engine import DeepSpeedEngine


class StageModule(torch.nn.Module):
    """The layers of a one-stage :class:`AutoplanPipelineModule` as a plain module: forward
    runs them, the first ``recompute`` of them under activation checkpointing (the plan's R:
    their activations are recomputed in backward, as the pipeline runtime's R does), the others'
    saved tensors in host memory where the plan offloads activations (``offload_activations``:
    ``runtime.swap.Swapper`` over every layer, as the pipeline engine does)."""

    def __init__(self, stages, offload_activations: bool = False):
        super().__init__()
        if len(stages.local_stages) != 1:
            raise ValueError(f"a plain DeepSpeed engine runs one stage; the module holds "
                             f"{len(stages.local_stages)}")
        self.stages = stages
        self.loss_fn = stages.loss_fn
        self.recompute = int(stages.recompute_layers.get(stages.local_stages[0], 0))
        self.swapper = None
        if offload_activations:
            from ..swap import SwapPolicy, Swapper
            self.swapper = Swapper(SwapPolicy.every_layer(stages), stages)

    def _run(self, lo, hi, x):
        with self.stages.activated(self.stages.local_stages[0], lo, hi):
            return self.stages(x)

    def forward(self, x):
        sw = self.swapper if torch.is_grad_enabled() else None
        with sw.forward() if sw is not None else contextlib.nullcontext():
            k = self.recompute
            if k:
                x = torch.utils.checkpoint.checkpoint(self._run, 0, k, x, use_reentrant=False)
            return self._run(k, None, x)


def _to(x, device):
    if torch.is_tensor(x):
        return x.to(device)
    return type(x)(_to(t, device) for t in x) if isinstance(x, (tuple, list)) else x


class DataParallelEngine(DeepSpeedEngine):
    """``DeepSpeedEngine`` with ``PipelineEngine``'s batch interface: :meth:`train_batch` pulls
    ``gradient_accumulation_steps()`` (inputs, labels) micro-batches, runs forward, the
    module's ``loss_fn``, backward and step on each, and returns the mean loss over the
    micro-batches and the data-parallel ranks (what ``PipelineEngine.train_batch`` returns)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, StageModule):
            raise TypeError("DataParallelEngine needs a StageModule (use ds_autoplan.initialize)")
        self.data_iterator = None
        if self.training_data is not None:
            self._build_data_iter(self.training_data)

    def _build_data_iter(self, dataset):
        """``training_data`` fed as ``PipelineEngine._build_data_iter`` feeds it (0.19.8): each
        data-parallel rank its share in the dataset's order (DistributedSampler, shuffle=False),
        repeated; not the shuffled loader ``deepspeed_io`` builds by default, so a plan without a
        pipeline trains a PipelineModule script on the batches DeepSpeed's own launch of it uses."""
        sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=self.dp_world_size, rank=dist.get_rank(group=self.data_parallel_group),
            shuffle=False)
        self.data_iterator = RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler))

    @property
    def grid(self):
        """``PipelineEngine.grid``: the pipeline grid of the script's module (one stage, every
        rank a data-parallel rank; a script reads e.g. ``engine.grid.data_parallel_id``)."""
        return self.module.stages._grid

    def set_dataiterator(self, iterator):
        """Store an iterator of (inputs, labels) micro-batches (``PipelineEngine``'s)."""
        self.data_iterator = iterator

    def _batch_losses(self, data_iter, train: bool):
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None:
            raise ValueError("no training data: pass data_iter= or training_data= to initialize")
        if self.module.loss_fn is None:
            raise ValueError("the PipelineModule has no loss_fn to compute the loss with")
        total = None
        for _ in range(self.gradient_accumulation_steps()):
            inputs, labels = next(self.data_iterator)
            loss = self.module.loss_fn(self(_to(inputs, self.device)), _to(labels, self.device))
            if train:
                self.backward(loss)
                self.step()
            total = loss.detach().clone() if total is None else total + loss.detach()
        total = total / self.gradient_accumulation_steps()
        if self.dp_world_size > 1:
            dist.all_reduce(total, group=self.data_parallel_group)
            total /= self.dp_world_size
        return total

    def train_batch(self, data_iter=None):
        """Train one batch (``train_batch_size()`` samples over all ranks); the mean loss."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self.module.train()
        self.agg_train_loss = self._batch_losses(data_iter, True)
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """The mean loss of one batch from ``data_iter`` without training (``PipelineEngine``'s
        signature; logits are not returned)."""
        if return_logits or not compute_loss:
            raise ValueError("eval_batch without pipeline parallelism returns the mean loss only")
        self.module.eval()
        with torch.no_grad():
            return self._batch_losses(data_iter, False)

    def is_first_stage(self):
        return True

    def is_last_stage(self):
        return True
