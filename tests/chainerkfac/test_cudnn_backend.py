"""chainerkfac.cudnn's Python on a CPU, against a recording fake cuDNN and
NumPy arrays (tests/chainerkfac/cudnn_fake.py): the calls each function
makes and their parameters, algorithm choice and cache, workspace, streams,
errors, and what is not served. The same calls against a real GPU:
tests/gpu/test_cudnn_gpu.py."""
import warnings

import numpy
import pytest

from chainerkfac.cudnn import algorithms
from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import highlevel
from chainerkfac.cudnn import library
from chainerkfac.cudnn import lowlevel
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import runtime
from tests.chainerkfac.cudnn_fake import FakeCudnn, NumpyArrays, perf
from tests.chainerkfac import cudnn_fake

FWD_V7 = 'cudnnGetConvolutionForwardAlgorithm_v7'
FWD_FIND = 'cudnnFindConvolutionForwardAlgorithmEx'
BWD_FILTER_V7 = 'cudnnGetConvolutionBackwardFilterAlgorithm_v7'
BWD_DATA_V7 = 'cudnnGetConvolutionBackwardDataAlgorithm_v7'
#: Calls that launch work on the handle's stream.
LAUNCHES = ('cudnnConvolutionForward', 'cudnnConvolutionBackwardFilter',
            'cudnnConvolutionBackwardData', 'cudnnAddTensor',
            'cudnnBatchNormalizationForwardTrainingEx',
            'cudnnBatchNormalizationBackwardEx',
            'cudnnBatchNormalizationForwardInference', 'cudnnPoolingForward',
            'cudnnPoolingBackward', 'cudnnSoftmaxForward',
            'cudnnSoftmaxBackward', 'cudnnActivationForward',
            'cudnnActivationBackward', 'cudnnDropoutForward',
            'cudnnDropoutBackward', FWD_FIND)


class Backend:
    def __init__(self):
        self.fake = FakeCudnn()
        self.arrays = NumpyArrays()
        self.runtime = runtime.Runtime(self.fake.library(), self.arrays)


@pytest.fixture
def backend():
    b = Backend()
    previous = runtime.activate(b.runtime)
    yield b
    runtime.activate(previous)
    # what the plans hold lives until the runtime closes (at exit)
    b.runtime.close()
    assert not b.fake.live, 'descriptors or handles left undestroyed'


def _conv(backend, x_shape, w_shape, y_shape, pad=(0, 0), stride=(1, 1),
          dilation=(1, 1), groups=1, bias=False, dtype=numpy.float32,
          auto_tune=False, tensor_core='auto'):
    x = numpy.zeros(x_shape, dtype)
    W = numpy.zeros(w_shape, dtype)
    b = numpy.zeros(w_shape[0], dtype) if bias else None
    y = numpy.empty(y_shape, dtype)
    highlevel.convolution_forward(
        x, W, b, y, pad, stride, dilation, groups, auto_tune=auto_tune,
        tensor_core=tensor_core)
    return x, W, y


# ResNet-50's convolutions (batch 2): stem 7x7/2, 1x1, 3x3, 1x1/2.
RESNET_CONVS = {
    '7x7/2': ((2, 3, 224, 224), (64, 3, 7, 7), (2, 64, 112, 112), (3, 3),
              (2, 2)),
    '1x1': ((2, 256, 56, 56), (64, 256, 1, 1), (2, 64, 56, 56), (0, 0),
            (1, 1)),
    '3x3': ((2, 64, 56, 56), (64, 64, 3, 3), (2, 64, 56, 56), (1, 1),
            (1, 1)),
    '1x1/2': ((2, 256, 56, 56), (512, 256, 1, 1), (2, 512, 28, 28), (0, 0),
              (2, 2)),
}


@pytest.mark.parametrize('name', sorted(RESNET_CONVS))
@pytest.mark.parametrize('bias', [False, True])
def test_convolution_forward_descriptors(backend, name, bias):
    x_shape, w_shape, y_shape, pad, stride = RESNET_CONVS[name]
    x, W, y = _conv(backend, x_shape, w_shape, y_shape, pad, stride,
                    bias=bias)
    fake = backend.fake
    tensors = [c.args[1:] for c in fake.named('cudnnSetTensor4dDescriptor')]
    assert tensors[:2] == [(C.CUDNN_TENSOR_NCHW, C.CUDNN_DATA_FLOAT) + x_shape,
                           (C.CUDNN_TENSOR_NCHW, C.CUDNN_DATA_FLOAT) + y_shape]
    filt, = fake.named('cudnnSetFilter4dDescriptor')
    assert filt.args[1:] == (C.CUDNN_DATA_FLOAT, C.CUDNN_TENSOR_NCHW) + w_shape
    conv, = fake.named('cudnnSetConvolution2dDescriptor')
    assert conv.args[1:] == (pad + stride + (1, 1) +
                             (C.CUDNN_CROSS_CORRELATION, C.CUDNN_DATA_FLOAT))
    assert not fake.named('cudnnSetConvolutionGroupCount')
    forward, = fake.named('cudnnConvolutionForward')
    assert forward.args[1] == 1.0 and forward.args[10] == 0.0   # alpha, beta
    assert forward.args[3] == x.ctypes.data
    assert forward.args[12] == y.ctypes.data
    adds = fake.named('cudnnAddTensor')
    if bias:
        assert tensors[2] == (C.CUDNN_TENSOR_NCHW, C.CUDNN_DATA_FLOAT, 1,
                              w_shape[0], 1, 1)
        assert len(adds) == 1 and adds[0].args[1] == adds[0].args[4] == 1.0
        assert fake.names().index('cudnnAddTensor') > \
            fake.names().index('cudnnConvolutionForward')
    else:
        assert not adds


def test_grouped_dilated_convolution(backend):
    _conv(backend, (2, 32, 14, 14), (64, 8, 3, 3), (2, 64, 12, 12),
          pad=(1, 1), dilation=(2, 2), groups=4)
    conv, = backend.fake.named('cudnnSetConvolution2dDescriptor')
    assert conv.args[1:7] == (1, 1, 1, 1, 2, 2)
    groups, = backend.fake.named('cudnnSetConvolutionGroupCount')
    assert groups.args[1] == 4


def test_convolution_nd_descriptors(backend):
    x = numpy.zeros((2, 4, 5, 6, 7), numpy.float64)
    W = numpy.zeros((3, 4, 2, 2, 2), numpy.float64)
    y = numpy.empty((2, 3, 3, 4, 5), numpy.float64)
    highlevel.convolution_forward(x, W, None, y, (0, 1, 1), (2, 1, 1),
                                  (1, 1, 2), 1, auto_tune=False,
                                  tensor_core='auto')
    fake = backend.fake
    nd = fake.named('cudnnSetTensorNdDescriptor')
    assert nd[0].args[1:] == (C.CUDNN_DATA_DOUBLE, 5, (2, 4, 5, 6, 7),
                              (840, 210, 42, 7, 1))
    filt, = fake.named('cudnnSetFilterNdDescriptor')
    assert filt.args[1:] == (C.CUDNN_DATA_DOUBLE, C.CUDNN_TENSOR_NCHW, 5,
                             (3, 4, 2, 2, 2))
    conv, = fake.named('cudnnSetConvolutionNdDescriptor')
    assert conv.args[1:] == (3, (0, 1, 1), (2, 1, 1), (1, 1, 2),
                             C.CUDNN_CROSS_CORRELATION, C.CUDNN_DATA_DOUBLE)


@pytest.mark.parametrize('dtype, mode, capability, expected', [
    (numpy.float32, 'auto', 90, C.CUDNN_DEFAULT_MATH),     # TF32 allowed
    (numpy.float32, 'always', 90, C.CUDNN_DEFAULT_MATH),
    (numpy.float32, 'never', 90, C.CUDNN_FMA_MATH),        # exact float32
    (numpy.float64, 'never', 90, C.CUDNN_DEFAULT_MATH),
    (numpy.float16, 'auto', 70, C.CUDNN_TENSOR_OP_MATH),
    (numpy.float16, 'auto', 61, C.CUDNN_DEFAULT_MATH),
    (numpy.float16, 'never', 90, C.CUDNN_DEFAULT_MATH),
])
def test_math_type(backend, dtype, mode, capability, expected):
    backend.arrays.capability = capability
    x_shape, w_shape, y_shape, pad, stride = RESNET_CONVS['3x3']
    backend.fake.answers[FWD_V7] = [perf(1, math_type=expected)]
    _conv(backend, x_shape, w_shape, y_shape, pad, stride, dtype=dtype,
          tensor_core=mode)
    conv, = backend.fake.named('cudnnSetConvolution2dDescriptor')
    compute = C.CUDNN_DATA_DOUBLE if dtype == numpy.float64 else \
        C.CUDNN_DATA_FLOAT
    assert conv.args[-1] == compute
    # the requested math, then the chosen algorithm's
    assert [c.args[1] for c in backend.fake.named(
        'cudnnSetConvolutionMathType')] == [expected, expected]


def test_math_type_rejects_unknown_mode(backend):
    with pytest.raises(ValueError, match='tensor_core'):
        _conv(backend, *RESNET_CONVS['1x1'][:3], tensor_core='sometimes')


def test_exact_float32_takes_only_fma_algorithms(backend):
    backend.fake.answers[FWD_V7] = [
        perf(1, math_type=C.CUDNN_TENSOR_OP_MATH),
        perf(2, math_type=C.CUDNN_DEFAULT_MATH),
        perf(6, math_type=C.CUDNN_FMA_MATH)]
    _conv(backend, *RESNET_CONVS['1x1'], tensor_core='never')
    forward, = backend.fake.named('cudnnConvolutionForward')
    assert forward.args[7] == 6


def test_algorithm_cached_per_shape(backend):
    fake = backend.fake
    x_shape, w_shape, y_shape, pad, stride = RESNET_CONVS['3x3']
    for _ in range(3):
        _conv(backend, x_shape, w_shape, y_shape, pad, stride)
    assert len(fake.named(FWD_V7)) == 1
    assert len(fake.named('cudnnConvolutionForward')) == 3
    # another padding, dtype, math or workspace limit is another choice
    _conv(backend, x_shape, w_shape, (2, 64, 54, 54), (0, 0), stride)
    _conv(backend, x_shape, w_shape, y_shape, pad, stride,
          dtype=numpy.float64)
    _conv(backend, x_shape, w_shape, y_shape, pad, stride,
          tensor_core='never')
    highlevel.set_max_workspace_size(1 << 20)
    _conv(backend, x_shape, w_shape, y_shape, pad, stride)
    assert len(fake.named(FWD_V7)) == 5
    keys = list(backend.runtime.algorithms)
    assert len(set(keys)) == 5
    assert {k.direction for k in keys} == {'forward'}
    assert keys[0].pad == (1, 1) and keys[0].math_type == C.CUDNN_DEFAULT_MATH
    assert keys[-1].max_workspace_size == 1 << 20


def test_algorithm_cache_keys_by_device(backend):
    _conv(backend, *RESNET_CONVS['1x1'])
    backend.arrays.device = 1
    _conv(backend, *RESNET_CONVS['1x1'])
    assert len(backend.fake.named(FWD_V7)) == 2
    assert len(backend.fake.named('cudnnCreate')) == 2   # a handle each


def test_heuristics_skip_unsupported_and_too_large(backend):
    limit = highlevel.get_max_workspace_size()
    assert limit == 8 * 1024 * 1024      # CuPy 13's default
    backend.fake.answers[FWD_V7] = [
        perf(7, status=cudnn_fake.NOT_SUPPORTED),
        perf(5, memory=limit + 1),
        perf(1, memory=4096)]
    with pytest.warns(algorithms.PerformanceWarning,
                      match='set_max_workspace_size'):
        _conv(backend, *RESNET_CONVS['3x3'])
    forward, = backend.fake.named('cudnnConvolutionForward')
    assert forward.args[7] == 1                     # algo
    assert forward.args[9] == 4096                  # workspace bytes
    assert backend.arrays.allocations == [4096]     # from the pool


def test_no_algorithm_within_the_limit(backend):
    backend.fake.answers[FWD_V7] = [
        perf(1, memory=highlevel.get_max_workspace_size() + 1),
        perf(2, status=cudnn_fake.NOT_SUPPORTED)]
    with pytest.raises(RuntimeError, match='no convolution forward '
                       'algorithm within a workspace of 8388608 bytes'):
        _conv(backend, *RESNET_CONVS['1x1'])
    assert not backend.fake.named('cudnnConvolutionForward')


def test_no_warning_when_the_best_fits(backend):
    backend.fake.answers[FWD_V7] = [perf(3, memory=100), perf(4, memory=0)]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _conv(backend, *RESNET_CONVS['1x1'])
    assert backend.fake.named('cudnnConvolutionForward')[0].args[7] == 3


def test_autotune_times_with_the_maximum_workspace(backend):
    fake = backend.fake
    highlevel.set_max_workspace_size(512 << 20)   # the paper's script
    fake.answers[FWD_FIND] = [perf(0, status=cudnn_fake.NOT_SUPPORTED),
                              perf(2, memory=1000)]
    for _ in range(2):
        _conv(backend, *RESNET_CONVS['7x7/2'], auto_tune=True)
    find, = fake.named(FWD_FIND)
    assert find.args[-1] == 512 << 20 and find.args[8] == \
        algorithms.REQUESTED
    assert not fake.named(FWD_V7)
    # the timing's workspace, then the stream's buffer, kept for the next
    assert backend.arrays.allocations == [512 << 20, 1000]
    assert [c.args[7] for c in fake.named('cudnnConvolutionForward')] == [2, 2]
    # heuristics and timing are cached apart
    _conv(backend, *RESNET_CONVS['7x7/2'])
    assert len(fake.named(FWD_V7)) == 1


def _backward_filter(backend, deterministic=False, auto_tune=False):
    x_shape, w_shape, y_shape, pad, stride = RESNET_CONVS['3x3']
    x, gy = numpy.zeros(x_shape, 'f'), numpy.zeros(y_shape, 'f')
    gW = numpy.empty(w_shape, 'f')
    highlevel.convolution_backward_filter(
        x, gy, gW, pad, stride, (1, 1), 1, deterministic=deterministic,
        auto_tune=auto_tune, tensor_core='auto')
    return x, gy, gW


def test_backward_filter(backend):
    fake = backend.fake
    fake.answers[BWD_FILTER_V7] = [
        perf(3, determinism=C.CUDNN_NON_DETERMINISTIC), perf(1, memory=64)]
    x, gy, gW = _backward_filter(backend)
    call, = fake.named('cudnnConvolutionBackwardFilter')
    assert call.args[3] == x.ctypes.data and call.args[5] == gy.ctypes.data
    assert call.args[7] == 3 and call.args[12] == gW.ctypes.data
    # deterministic: only deterministic algorithms, from the heuristics
    _backward_filter(backend, deterministic=True, auto_tune=True)
    assert [c.args[7] for c in fake.named(
        'cudnnConvolutionBackwardFilter')] == [3, 1]
    assert not fake.named('cudnnFindConvolutionBackwardFilterAlgorithmEx')
    _backward_filter(backend, auto_tune=True)
    assert len(fake.named(
        'cudnnFindConvolutionBackwardFilterAlgorithmEx')) == 1


def test_backward_data_with_bias(backend):
    fake = backend.fake
    fake.answers[BWD_DATA_V7] = [perf(4, memory=10)]
    W = numpy.zeros((64, 8, 3, 3), 'f')
    x = numpy.zeros((2, 64, 28, 28), 'f')      # the convolution's output
    b = numpy.zeros(32, 'f')
    y = numpy.empty((2, 32, 56, 56), 'f')      # its input
    highlevel.convolution_backward_data(
        W, x, b, y, (1, 1), (2, 2), (1, 1), 4, deterministic=False,
        auto_tune=False, tensor_core='auto')
    call, = fake.named('cudnnConvolutionBackwardData')
    assert call.args[3] == W.ctypes.data and call.args[5] == x.ctypes.data
    assert call.args[7] == 4 and call.args[9] == 10
    assert call.args[12] == y.ctypes.data
    assert fake.named('cudnnSetConvolutionGroupCount')[0].args[1] == 4
    add, = fake.named('cudnnAddTensor')
    assert add.args[6] == y.ctypes.data


def test_stream_set_when_it_changes(backend):
    fake, arrays = backend.fake, backend.arrays
    _conv(backend, *RESNET_CONVS['1x1'], bias=True)
    arrays.current_stream = 0x6000
    x = numpy.zeros((2, 8, 6, 6), 'f')
    y = numpy.empty((2, 8, 3, 3), 'f')
    highlevel.pooling_forward(x, y, (2, 2), (2, 2), (0, 0),
                              C.CUDNN_POOLING_MAX)
    highlevel.softmax_forward(numpy.zeros((4, 10), 'f'), 1,
                              C.CUDNN_SOFTMAX_LOG)
    stream = None
    for call in fake.calls:
        if call.name == 'cudnnSetStream':
            stream = call.args[1]
        elif call.name in LAUNCHES:
            assert stream is not None, call.name
    sets = fake.named('cudnnSetStream')
    assert [c.args[1] for c in sets] == [0x5000, 0x6000]   # not again
    assert len(fake.named('cudnnCreate')) == 1    # one handle per device
    assert {c.args[0] for c in sets} == set(backend.runtime.handles())


def test_error_translation_and_cleanup(backend):
    fake = backend.fake
    fake.failures['cudnnConvolutionForward'] = 2000
    fake.last_error = 'CUDNN_BACKEND_API_FAILED: bad stride'
    with pytest.raises(library.CuDNNError) as info:
        _conv(backend, *RESNET_CONVS['1x1/2'])
    error = info.value
    assert error.status == 2000
    text = str(error)
    assert text.startswith('cuDNN Error: CUDNN_STATUS_BAD_PARAM in '
                           'cudnnConvolutionForward: CUDNN_BACKEND_API_FAILED'
                           ': bad stride')
    assert 'x=shape (2, 256, 56, 56) float32' in text
    assert 'stride=(2, 2)' in text
    assert isinstance(error, RuntimeError)
    assert lowlevel.CuDNNError is library.CuDNNError
    # the fixture checks that the descriptors were destroyed all the same


def test_library_names_missing_functions():
    fake = FakeCudnn()
    functions = {n: fake._function(n) for n in library.PROTOTYPES
                 if n != 'cudnnConvolutionForward'}
    with pytest.raises(OSError, match='does not export '
                       'cudnnConvolutionForward'):
        library.Library(functions, 'old libcudnn')


def _bn_training(backend, x, **kwargs):
    channels = x.shape[1]
    gamma = numpy.ones(channels, 'f')
    beta = numpy.zeros(channels, 'f')
    mean = numpy.zeros(channels, 'f')
    var = numpy.ones(channels, 'f')
    options = dict(eps=2e-5, decay=0.9, is_for_conv2d=x.ndim == 4,
                   cudnn_mode=C.CUDNN_BATCHNORM_SPATIAL, debug=False)
    options.update(kwargs)
    out = highlevel.batch_normalization_forward_training_ex(
        x, gamma, beta, mean, var, None, None, **options)
    return out, gamma, mean, var


def test_batch_normalization_training_and_backward(backend):
    fake = backend.fake
    fake.sizes['cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize'] = 0
    fake.sizes['cudnnGetBatchNormalizationTrainingExReserveSpaceSize'] = 256
    fake.sizes['cudnnGetBatchNormalizationBackwardExWorkspaceSize'] = 128
    x = numpy.zeros((4, 8, 5, 5), 'f')
    (reserve, y, save_mean, save_inv_std), gamma, mean, var = _bn_training(
        backend, x)
    assert y.shape == x.shape and save_mean.shape == (8,)
    assert reserve.nbytes == 256
    call, = fake.named('cudnnBatchNormalizationForwardTrainingEx')
    args = call.args
    assert args[1:5] == (C.CUDNN_BATCHNORM_SPATIAL, C.CUDNN_BATCHNORM_OPS_BN,
                         1.0, 0.0)
    assert args[14] == pytest.approx(0.1)          # 1 - decay
    assert args[15] == mean.ctypes.data and args[16] == var.ctypes.data
    assert args[17] == 2e-5
    assert args[18] == save_mean.ctypes.data
    assert args[21:] == (0, 0, reserve.ptr, 256)
    gy = numpy.zeros_like(x)
    gx, ggamma, gbeta = highlevel.batch_normalization_backward(
        x, gamma, gy, save_mean, save_inv_std, 2e-5, True,
        C.CUDNN_BATCHNORM_SPATIAL, False, reserve_space=reserve)
    back, = fake.named('cudnnBatchNormalizationBackwardEx')
    assert back.args[3:7] == (1.0, 0.0, 1.0, 0.0)
    assert back.args[22] == 2e-5
    assert back.args[23] == save_mean.ctypes.data
    assert back.args[-4:-2] == (back.args[-4], 128)
    assert back.args[-2:] == (reserve.ptr, 256)
    assert gx.shape == x.shape and ggamma.dtype == gamma.dtype


def test_batch_normalization_without_reserve_space(backend):
    (reserve, *_), _, _, _ = _bn_training(backend, numpy.zeros((4, 8), 'f'))
    assert reserve is None
    desc = backend.fake.named('cudnnSetTensor4dDescriptor')[0]
    assert desc.args[3:] == (4, 8, 1, 1)       # (N, C) per activation


def test_batch_normalization_half_uses_float_parameters(backend):
    x = numpy.zeros((2, 4, 3, 3), numpy.float16)
    channels = 4
    mean = numpy.zeros(channels, numpy.float16)
    var = numpy.ones(channels, numpy.float16)
    y, save_mean, _ = highlevel.batch_normalization_forward_training(
        x, numpy.ones(channels, numpy.float16),
        numpy.zeros(channels, numpy.float16), mean, var, None, None, 1e-5,
        0.9, True, C.CUDNN_BATCHNORM_SPATIAL, False)
    assert y.dtype == numpy.float16 and save_mean.dtype == numpy.float32
    call, = backend.fake.named('cudnnBatchNormalizationForwardTrainingEx')
    assert call.args[15] != mean.ctypes.data    # a float32 copy, written back


def test_batch_normalization_inference(backend):
    x = numpy.zeros((2, 4, 3, 3), 'd')
    params = [numpy.ones(4, 'd') for _ in range(4)]
    y = highlevel.batch_normalization_forward_inference(
        x, *params, 1e-5, True, C.CUDNN_BATCHNORM_SPATIAL)
    call, = backend.fake.named('cudnnBatchNormalizationForwardInference')
    assert call.args[2:4] == (1.0, 0.0) and call.args[-1] == 1e-5
    assert call.args[7] == y.ctypes.data


def test_persistent_batch_normalization_checks_overflow_in_debug(backend):
    _bn_training(backend, numpy.zeros((2, 4, 3, 3), 'f'),
                 cudnn_mode=C.CUDNN_BATCHNORM_SPATIAL_PERSISTENT, debug=True)
    query, = backend.fake.named('cudnnQueryRuntimeError')
    assert query.args[2] == C.CUDNN_ERRQUERY_BLOCKING


def test_pooling(backend):
    fake = backend.fake
    x = numpy.zeros((2, 64, 112, 112), 'f')
    y = numpy.empty((2, 64, 56, 56), 'f')
    highlevel.pooling_forward(x, y, (3, 3), (2, 2), (1, 1),
                              C.CUDNN_POOLING_MAX)
    pool, = fake.named('cudnnSetPooling2dDescriptor')
    assert pool.args[1:] == (C.CUDNN_POOLING_MAX, C.CUDNN_NOT_PROPAGATE_NAN,
                             3, 3, 1, 1, 2, 2)
    gx = highlevel.pooling_backward(x, y, numpy.zeros_like(y), (3, 3), (2, 2),
                                    (1, 1), C.CUDNN_POOLING_MAX)
    back, = fake.named('cudnnPoolingBackward')
    assert back.args[4] == y.ctypes.data and back.args[-1] == gx.ctypes.data
    x3 = numpy.zeros((2, 4, 6, 6, 6), 'f')
    highlevel.pooling_forward(
        x3, numpy.empty((2, 4, 3, 3, 3), 'f'), (2, 2, 2), (2, 2, 2),
        (0, 0, 0), C.CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING)
    nd, = fake.named('cudnnSetPoolingNdDescriptor')
    assert nd.args[1:] == (C.CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING,
                           C.CUDNN_NOT_PROPAGATE_NAN, 3, (2, 2, 2), (0, 0, 0),
                           (2, 2, 2))
    with pytest.raises(ValueError, match='c-contiguous'):
        highlevel.pooling_forward(x, numpy.empty((2, 64, 56, 56), 'f').T,
                                  (3, 3), (2, 2), (1, 1), C.CUDNN_POOLING_MAX)


@pytest.mark.parametrize('shape, axis, view, mode', [
    ((32, 1000), 1, (32, 1000, 1, 1), C.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((4, 5, 6, 7), 1, (4, 5, 42, 1), C.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((4, 5, 6), -1, (20, 6, 1, 1), C.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((4, 1), 1, (4, 1, 1, 1), C.CUDNN_SOFTMAX_MODE_INSTANCE),
])
def test_softmax(backend, shape, axis, view, mode):
    x = numpy.zeros(shape, 'f')
    y = highlevel.softmax_forward(x, axis, C.CUDNN_SOFTMAX_LOG)
    highlevel.softmax_backward(y, numpy.zeros_like(y), axis,
                               C.CUDNN_SOFTMAX_LOG)
    fake = backend.fake
    # one plan for both directions
    assert [c.args[3:] for c in fake.named(
        'cudnnSetTensor4dDescriptor')] == [view]
    forward, = fake.named('cudnnSoftmaxForward')
    backward, = fake.named('cudnnSoftmaxBackward')
    assert forward.args[1:3] == backward.args[1:3] == (
        C.CUDNN_SOFTMAX_LOG, mode)
    assert forward.args[4] == backward.args[4] == backward.args[6]


def test_activation(backend):
    x = numpy.zeros((2, 3, 4, 5), 'f')
    y = highlevel.activation_forward(x, C.CUDNN_ACTIVATION_CLIPPED_RELU, 6.0)
    highlevel.activation_backward(x, y, numpy.zeros_like(y),
                                  C.CUDNN_ACTIVATION_CLIPPED_RELU, 6.0)
    fake = backend.fake
    expected = (C.CUDNN_ACTIVATION_CLIPPED_RELU, C.CUDNN_NOT_PROPAGATE_NAN,
                6.0)
    assert [c.args[1:] for c in fake.named(
        'cudnnSetActivationDescriptor')] == [expected]   # one plan
    assert fake.named('cudnnSetTensor4dDescriptor')[0].args[3:] == \
        (2, 60, 1, 1)
    back, = fake.named('cudnnActivationBackward')
    assert back.args[4] == y.ctypes.data and back.args[8] == x.ctypes.data


def test_dropout(backend):
    fake = backend.fake
    fake.sizes['cudnnDropoutGetStatesSize'] = 4096
    fake.sizes['cudnnDropoutGetReserveSpaceSize'] = 96
    states = highlevel.DropoutStates(None, 1234)
    first = fake.named('cudnnSetDropoutDescriptor')[0]
    assert first.args[2:] == (0.0, states._states.ptr, 4096, 1234)
    x = numpy.zeros((8, 12), 'f')
    reserve, y = states.forward(None, x, 0.25)
    assert reserve.nbytes == 96 and y.shape == x.shape
    dx = states.backward(None, numpy.zeros_like(y), 0.25, reserve)
    ratios = fake.named('cudnnSetDropoutDescriptor')[1:]
    # the ratio is set without re-seeding (NULL states)
    assert [c.args[2:] for c in ratios] == [(0.25, None, 0, 0)] * 2
    back, = fake.named('cudnnDropoutBackward')
    assert back.args[6:] == (reserve.ctypes.data, 96)
    assert back.args[5] == dx.ctypes.data
    desc = states._desc
    del states
    assert desc not in fake.live     # destroyed with the object


# -- what is not served -------------------------------------------------------
@pytest.mark.parametrize('module, name, caller', [
    (highlevel, 'create_rnn_descriptor', 'RNN'),
    (highlevel, 'rnn_forward_training', 'RNN'),
    (highlevel, 'create_filter_descriptor', 'RNN'),
    (highlevel, 'create_spatial_transformer_descriptor',
     'spatial_transformer'),
    (highlevel, 'create_tensor_descriptor', 'spatial_transformer'),
    (lowlevel, 'getRNNParamsSize', 'RNN'),
    (lowlevel, 'spatialTfSamplerForward', 'spatial_transformer'),
    (highlevel, 'ctc_loss', None),
])
def test_not_served_names_say_what_to_do(module, name, caller):
    with pytest.raises(not_served.NotServedError) as info:
        getattr(module, name)
    text = str(info.value)
    assert "'use_cudnn', 'never'" in text
    assert "use_cudnn = 'never'" in text
    assert name in text
    if caller:
        assert caller in text
    assert isinstance(info.value, AttributeError)
    assert not hasattr(module, name)
    with pytest.raises(AttributeError) as plain:
        module.__wrapped__
    assert not isinstance(plain.value, not_served.NotServedError)


def test_nhwc_is_not_served(backend):
    with pytest.raises(not_served.NotServedError, match='cudnn_fast'):
        highlevel.convolution_forward(
            numpy.zeros((1, 2, 3, 3), 'f'), numpy.zeros((1, 2, 1, 1), 'f'),
            None, numpy.empty((1, 1, 3, 3), 'f'), (0, 0), (1, 1), (1, 1), 1,
            auto_tune=False, tensor_core='auto',
            d_layout=C.CUDNN_TENSOR_NHWC)
    with pytest.raises(not_served.NotServedError, match='NCHW'):
        _bn_training(backend, numpy.zeros((2, 4, 3, 3), 'f'),
                     d_layout=C.CUDNN_TENSOR_NHWC)
    assert not backend.fake.calls


def test_versions_and_workspace_api(backend):
    assert lowlevel.getVersion() == 92801
    assert lowlevel.CUDNN_BN_MIN_EPSILON == 0.0
    highlevel.set_max_workspace_size(512 << 20)
    assert highlevel.get_max_workspace_size() == 512 << 20
    assert highlevel.get_handle() in backend.runtime.handles()
    assert highlevel.get_data_type(numpy.dtype('e')) == C.CUDNN_DATA_HALF
    with pytest.raises(TypeError, match='int32'):
        highlevel.get_data_type(numpy.dtype('i'))
    assert highlevel.is_tensor_core_available(numpy.dtype('e'))
    assert not highlevel.is_tensor_core_available(numpy.dtype('f'))


def test_not_installed_is_an_error():
    previous = runtime.activate(None)
    try:
        with pytest.raises(RuntimeError, match='not installed'):
            lowlevel.getVersion()
    finally:
        runtime.activate(previous)
