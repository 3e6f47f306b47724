"""What Chainer 7.8.1 imports as ``cupy.cudnn`` (CuPy 13's ``cupyx.cudnn``
API), for the calls it makes for ResNet-type models.

Installed by :func:`chainerkfac.cudnn.install`; the calls run on the
runtime it activated (:mod:`chainerkfac.cudnn.runtime`). Every other public
name raises :class:`~chainerkfac.cudnn.not_served.NotServedError` (an
``AttributeError`` too) naming ``chainer.config.use_cudnn = 'never'``.
"""
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.activation import (  # NOQA
    activation_backward, activation_forward, softmax_backward,
    softmax_forward)
from chainerkfac.cudnn.convolution import (  # NOQA
    convolution_backward_data, convolution_backward_filter,
    convolution_forward, is_tensor_core_available)
from chainerkfac.cudnn.descriptors import data_type as get_data_type  # NOQA
from chainerkfac.cudnn.dropout import DropoutStates  # NOQA
from chainerkfac.cudnn.normalization import (  # NOQA
    batch_normalization_backward, batch_normalization_forward_inference,
    batch_normalization_forward_training,
    batch_normalization_forward_training_ex)
from chainerkfac.cudnn.pooling import pooling_backward, pooling_forward  # NOQA


def get_handle() -> int:
    """The current device's cuDNN handle (on the current stream)."""
    return runtime.current().handle()


def get_max_workspace_size() -> int:
    """Bytes of workspace a convolution may use (CuPy 13's default: 8 MiB;
    the paper's ImageNet script set 512 MiB through
    ``chainer.backends.cuda.set_max_workspace_size``)."""
    return runtime.current().max_workspace_size


def set_max_workspace_size(size: int) -> None:
    runtime.current().max_workspace_size = int(size)


__getattr__ = not_served.module_getattr('cupy.cudnn')
