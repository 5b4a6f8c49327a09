"""Small collectives over the default process group that carry text, never pickles: every
rank's string (:func:`gather_text`) or one rank's (:func:`broadcast_text`), as UTF-8 bytes in
uint8 tensors.  ``torch.distributed``'s ``*_object`` collectives unpickle what they receive;
these cannot run code.  Without an initialised group they act on this process alone."""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    """Processes in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def device() -> torch.device:
    """Where the default group's collectives take tensors: the current GPU for a NCCL-only
    group, else the CPU (gloo, or a group with a CPU backend beside NCCL)."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_text(text: str, group=None) -> list[str]:
    """Every rank's ``text``, in rank order of ``group`` (default: the default group), by a
    padded uint8 all-gather."""
    size = world() if group is None else group.size()
    if size == 1:
        return [text]
    dev = device()
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=dev)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    width = max(int(s) for s in sizes) or 1
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    buf[:data.numel()] = data
    bufs = [torch.zeros_like(buf) for _ in range(size)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[:int(s)].cpu().tolist()).decode() for b, s in zip(bufs, sizes)]


def broadcast_text(text: str, src: int = 0, group=None) -> str:
    """The ``text`` of rank ``src`` (its rank within ``group``) on every rank of the group;
    the others' arguments are ignored."""
    me = rank() if group is None else group.rank()
    return gather_text(text if me == src else "", group)[src]
