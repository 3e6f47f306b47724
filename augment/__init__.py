"""Data augmentation and input pipeline of the paper (section 4.1).

* :class:`RunningMixup` — eqs. (9)-(10), one instance per data stream.
* :class:`RandomErasing` — random erasing with zeros, vectorised per batch.
* :func:`crop_flip`, :func:`normalize`, :class:`ImageTransform` — random /
  centre crop and flip (uint8, where images are decoded), ``(x − mean) /
  255`` (where they are trained on), or both on the host.
* :func:`read_image_list`, :class:`ImageList`, :class:`ImageListDataset`,
  :func:`imagenet_dataset` — ImageNet list format, labels checked.
* :class:`TrainStream`, :class:`GlobalBatchIterator` — the global sample
  stream, the same on any number of processes (:mod:`augment.stream`).
* :func:`scan_images` — one decoding pass: mean-image sums and bad files.
* :func:`compute_mean`, :func:`save_mean`, :func:`load_mean` — mean image.
"""
from augment.erasing import RandomErasing  # NOQA
from augment.image_list import ImageList  # NOQA
from augment.image_list import ImageListDataset  # NOQA
from augment.image_list import imagenet_dataset  # NOQA
from augment.image_list import load_image  # NOQA
from augment.image_list import read_image_list  # NOQA
from augment.mean_image import check_writable  # NOQA
from augment.mean_image import compute_mean  # NOQA
from augment.mean_image import load_mean  # NOQA
from augment.mean_image import save_mean  # NOQA
from augment.mixup import RunningMixup  # NOQA
from augment.mixup import running_mixup_streams  # NOQA
from augment.random_state import ProcessLocalRNG  # NOQA
from augment.scan import scan_images  # NOQA
from augment.scan import share  # NOQA
from augment.stream import EvalView  # NOQA
from augment.stream import GlobalBatchIterator  # NOQA
from augment.stream import TrainStream  # NOQA
from augment.stream import end_chunk  # NOQA
from augment.stream import epochs_at  # NOQA
from augment.stream import stream_rng  # NOQA
from augment.transforms import ImageTransform  # NOQA
from augment.transforms import crop_flip  # NOQA
from augment.transforms import normalize  # NOQA
