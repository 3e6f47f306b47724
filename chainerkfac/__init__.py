"""chainerkfac: distributed K-FAC for Chainer (Osawa et al., CVPR 2019)."""
from chainerkfac import _compat  # NOQA  (must run before chainer is imported)
from chainerkfac import schedules  # NOQA
from chainerkfac import optimizers  # NOQA
