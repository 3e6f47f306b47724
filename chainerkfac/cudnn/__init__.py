"""cuDNN 9 for Chainer 7.8.1 on CuPy >= 14.

CuPy 14 dropped cuDNN (``cupy.cudnn`` and ``cupy.cuda.cudnn``), so Chainer
runs every convolution as im2col + GEMM and batch normalization and
pooling as generic kernels. This package gives Chainer those two modules
back, in pure Python over ctypes, bound to cuDNN 9's legacy API (still
exported, deprecated, by ``libcudnn.so.9``), with CuPy 13's semantics for
the calls Chainer makes for ResNet-type models: convolutions (algorithms
chosen once per shape, by heuristics or timed under
``chainer.config.autotune``; workspace from CuPy's pool within Chainer's
maximum), batch normalization, pooling, softmax, activations and dropout,
on the current CuPy stream, NCHW.

Importing this package (``import chainerkfac`` does, before
``import chainer``) installs the backend unless ``CHAINERKFAC_CUDNN=0`` is
in the environment, where the other conditions of
:mod:`~chainerkfac.cudnn.installer` hold;
:func:`describe` says which cuDNN is in use, or why none is. Float32
convolutions may use TF32 tensor cores as PyTorch's do by default;
``chainer.config.use_cudnn_tensor_core = 'never'`` makes them exact
(:mod:`~chainerkfac.cudnn.convolution`). What is not served and what
happens then: :mod:`~chainerkfac.cudnn.not_served`.
"""
from chainerkfac.cudnn.installer import ENV_VAR, describe, install  # NOQA
from chainerkfac.cudnn.not_served import NotServedError  # NOQA

install()
