"""CIFAR10 stand-in: fixed random images (SHIM_IMAGE pixels square, default 64: AlexNet's
smallest input is 63) and labels, the same on every rank and run."""
import os

import torch
from torch.utils.data import Dataset


class CIFAR10(Dataset):
    def __init__(self, root=None, train=True, download=False, transform=None, n=512):
        s = int(os.environ.get("SHIM_IMAGE", "64"))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, s, s, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])
