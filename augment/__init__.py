"""Data augmentation and input pipeline of the paper (section 4.1).

* :class:`RunningMixup` — eqs. (9)-(10), one instance per data stream.
* :class:`RandomErasing` — random erasing with zeros, vectorised per batch.
* :class:`ImageTransform` — random / centre crop, flip, ``(x − mean) / 255``.
* :class:`ImageListDataset`, :func:`imagenet_dataset` — ImageNet list format.
* :func:`compute_mean`, :func:`save_mean`, :func:`load_mean` — mean image.
"""
from augment.erasing import RandomErasing  # NOQA
from augment.image_list import ImageListDataset  # NOQA
from augment.image_list import imagenet_dataset  # NOQA
from augment.image_list import load_image  # NOQA
from augment.image_list import read_image_list  # NOQA
from augment.mean_image import compute_mean  # NOQA
from augment.mean_image import load_mean  # NOQA
from augment.mean_image import save_mean  # NOQA
from augment.mixup import RunningMixup  # NOQA
from augment.mixup import running_mixup_streams  # NOQA
from augment.random_state import ProcessLocalRNG  # NOQA
from augment.transforms import ImageTransform  # NOQA
