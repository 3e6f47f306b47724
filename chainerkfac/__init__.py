"""chainerkfac: distributed K-FAC for Chainer (Osawa et al., CVPR 2019)."""
from chainerkfac import _compat  # NOQA  (must run before chainer is imported)
from chainerkfac import schedules  # NOQA
from chainerkfac import optimizers  # NOQA
from chainerkfac.communicators import create_communicator  # NOQA
from chainerkfac.multi_node_optimizer import create_multi_node_optimizer  # NOQA
