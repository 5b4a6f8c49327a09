"""``AlexNet`` from the client folder's alexnet.py (the script's directory is on sys.path)."""
from alexnet import AlexNet  # noqa: F401


def vgg19(*a, **k):
    raise NotImplementedError("the torchvision stand-in has no VGG")
