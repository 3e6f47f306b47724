"""cuDNN 9's enumeration values that Chainer 7.8.1 and this backend use.

Values as in cuDNN 9's headers (``cudnn_graph.h``, ``cudnn_ops.h``,
``cudnn_cnn.h``, ``cudnn_adv.h``); ``tests/chainerkfac/test_cudnn_library.py``
compares every name here with the headers of an installed cuDNN wheel.

Chainer reads some of them at import time (``cuda.cuda.cudnn.CUDNN_...`` in
class bodies), so every constant Chainer names is here, including those of
the functions this backend does not serve (RNN, spatial transformer).
cuDNN 9 renumbered its status codes (``CUDNN_STATUS_BAD_PARAM`` is 2000, not
3 as in cuDNN 8): only ``CUDNN_STATUS_SUCCESS`` is compared by value.
"""

CUDNN_STATUS_SUCCESS = 0

# cudnnDataType_t
CUDNN_DATA_FLOAT = 0
CUDNN_DATA_DOUBLE = 1
CUDNN_DATA_HALF = 2

# cudnnTensorFormat_t
CUDNN_TENSOR_NCHW = 0
CUDNN_TENSOR_NHWC = 1

# cudnnNanPropagation_t
CUDNN_NOT_PROPAGATE_NAN = 0
CUDNN_PROPAGATE_NAN = 1

# cudnnMathType_t
CUDNN_DEFAULT_MATH = 0
CUDNN_TENSOR_OP_MATH = 1
CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION = 2
CUDNN_FMA_MATH = 3

# cudnnDeterminism_t
CUDNN_NON_DETERMINISTIC = 0
CUDNN_DETERMINISTIC = 1

# cudnnConvolutionMode_t
CUDNN_CONVOLUTION = 0
CUDNN_CROSS_CORRELATION = 1

# cudnnActivationMode_t
CUDNN_ACTIVATION_SIGMOID = 0
CUDNN_ACTIVATION_RELU = 1
CUDNN_ACTIVATION_TANH = 2
CUDNN_ACTIVATION_CLIPPED_RELU = 3

# cudnnPoolingMode_t
CUDNN_POOLING_MAX = 0
CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING = 1
CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING = 2
CUDNN_POOLING_MAX_DETERMINISTIC = 3

# cudnnSoftmaxAlgorithm_t, cudnnSoftmaxMode_t
CUDNN_SOFTMAX_FAST = 0
CUDNN_SOFTMAX_ACCURATE = 1
CUDNN_SOFTMAX_LOG = 2
CUDNN_SOFTMAX_MODE_INSTANCE = 0
CUDNN_SOFTMAX_MODE_CHANNEL = 1

# cudnnBatchNormMode_t, cudnnBatchNormOps_t
CUDNN_BATCHNORM_PER_ACTIVATION = 0
CUDNN_BATCHNORM_SPATIAL = 1
CUDNN_BATCHNORM_SPATIAL_PERSISTENT = 2
CUDNN_BATCHNORM_OPS_BN = 0
#: ``#define CUDNN_BN_MIN_EPSILON 0.0`` (Chainer refuses a smaller eps).
CUDNN_BN_MIN_EPSILON = 0.0

# cudnnErrQueryMode_t
CUDNN_ERRQUERY_BLOCKING = 2

# Named by Chainer's cuDNN RNN and spatial transformer, which this backend
# does not serve; Chainer reads them when its modules are imported.
CUDNN_RNN_RELU = 0
CUDNN_RNN_TANH = 1
CUDNN_LSTM = 2
CUDNN_GRU = 3
CUDNN_UNIDIRECTIONAL = 0
CUDNN_BIDIRECTIONAL = 1
CUDNN_LINEAR_INPUT = 0
CUDNN_SAMPLER_BILINEAR = 0
