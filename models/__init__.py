"""Models: ResNet-50 (the paper's 107 K-FAC layers), ResNet-50-D, small
CIFAR-style ResNets, a classifier accepting soft labels, and the factory
that builds them by name (:func:`build_model`).

All models map ``x`` of shape ``(N, 3, H, W)`` to logits ``(N, n_class)``.
"""
from models.classifier import SoftLabelClassifier  # NOQA
from models.classifier import soft_label_accuracy  # NOQA
from models.classifier import soft_label_cross_entropy  # NOQA
from models.factory import ARCHS  # NOQA
from models.factory import DEFAULT_N_CLASS  # NOQA
from models.factory import build_model  # NOQA
from models.resnet50 import ResNet50  # NOQA
from models.resnet50d import ResNet50D  # NOQA
from models.small_resnet import SmallResNet  # NOQA
