"""Stand-in for torchvision (its registry wheel does not load against the local CPU torch, see
../shared/clients/README.md): random CIFAR-like tensors, no-op transforms, the client folder's
own AlexNet (the same network as torchvision's)."""
from . import datasets, models, transforms  # noqa: F401
