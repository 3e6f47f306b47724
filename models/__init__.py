"""Models: ResNet-50 (the paper's 107 K-FAC layers), ResNet-50-D, small
CIFAR-style ResNets, and a classifier accepting soft labels.

All models map ``x`` of shape ``(N, 3, H, W)`` to logits ``(N, n_class)``.
"""
from models.classifier import SoftLabelClassifier  # NOQA
from models.classifier import soft_label_accuracy  # NOQA
from models.classifier import soft_label_cross_entropy  # NOQA
from models.resnet50 import ResNet50  # NOQA
from models.resnet50d import ResNet50D  # NOQA
from models.small_resnet import SmallResNet  # NOQA
