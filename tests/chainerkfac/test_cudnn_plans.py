"""Per-shape plans of chainerkfac.cudnn on a CPU, against the recording fake
(tests/chainerkfac/cudnn_fake.py): the library calls of a ResNet-50 SGD
step (tests/chainerkfac/cudnn_step.py replays them), the bounded cache,
descriptors destroyed, the stream set only when it changes, one handle per
thread, the workspace kept per stream."""
import collections
import threading

import numpy
import pytest

import chainer

import models
from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import highlevel
from chainerkfac.cudnn import library
from chainerkfac.cudnn import plans
from chainerkfac.cudnn import runtime
from tests.chainerkfac import cudnn_step
from tests.chainerkfac.cudnn_fake import FakeCudnn, NumpyArrays

LAUNCHES = {'cudnnConvolutionForward', 'cudnnConvolutionBackwardFilter',
            'cudnnConvolutionBackwardData',
            'cudnnBatchNormalizationForwardTrainingEx',
            'cudnnBatchNormalizationBackwardEx', 'cudnnActivationForward',
            'cudnnActivationBackward', 'cudnnPoolingForward',
            'cudnnPoolingBackward', 'cudnnSoftmaxForward'}


class Backend:
    def __init__(self, capacity=plans.CAPACITY):
        self.fake = FakeCudnn()
        self.arrays = NumpyArrays()
        self.runtime = runtime.Runtime(self.fake.library(), self.arrays,
                                       capacity)


@pytest.fixture
def backend():
    b = Backend()
    previous = runtime.activate(b.runtime)
    yield b
    runtime.activate(previous)
    b.runtime.close()
    assert not b.fake.live, 'descriptors or handles left undestroyed'


@pytest.fixture(scope='module')
def resnet50_events():
    """The cuDNN calls of one ResNet-50 forward and backward pass (batch 2,
    224x224, 1000 classes)."""
    numpy.random.seed(0)
    model = models.SoftLabelClassifier(models.build_model('resnet50', 1000))
    x = numpy.random.standard_normal((2, 3, 224, 224)).astype(numpy.float32)
    t = numpy.array([1, 2], numpy.int32)
    with chainer.using_config('use_ideep', 'never'):
        return cudnn_step.record(model, x, t)


def test_resnet50_step_is_one_launch_per_call(backend, resnet50_events):
    events = resnet50_events
    counts = collections.Counter(e.call for e in events)
    # ResNet-50 (models/resnet50.py): 53 convolutions (the stem's input
    # needs no gradient), 53 batch normalizations, 49 ReLUs, one max
    # pooling, the log-softmax of the loss.
    assert counts == {
        'convolution_forward': 53, 'convolution_backward_filter': 53,
        'convolution_backward_data': 52,
        'batch_normalization_forward_training_ex': 53,
        'batch_normalization_backward': 53, 'activation_forward': 49,
        'activation_backward': 49, 'pooling_forward': 1,
        'pooling_backward': 1, 'softmax_forward': 1}
    fake = backend.fake
    cudnn_step.replay(events)          # the first step builds the plans
    first = len(fake.calls)
    built = backend.runtime.plans.built
    del fake.calls[:]
    for _ in range(2):
        cudnn_step.replay(events)
    steady = len(fake.calls) // 2
    names = collections.Counter(c.name for c in fake.calls)
    # a steady-state step: one launch per call, nothing else (no
    # descriptor made or destroyed, no size asked, the stream already set)
    assert set(names) == LAUNCHES
    assert steady == len(events) == 365
    assert steady <= 400           # the bound (4,452 before plans)
    assert backend.runtime.plans.built == built
    # distinct shapes: the plans a ResNet-50 step needs, within the bound
    assert built == len(backend.runtime.plans) < plans.CAPACITY
    assert first > steady


def test_calls_of_the_first_step_before_plans(resnet50_events):
    """What every call made before plans (16 library calls per
    convolution direction, 21 per BN forward + backward, 16 per ReLU
    forward + backward, 11 per pooling direction, 5 per softmax) adds up
    to the profile's 4,452 calls per step of the issue."""
    counts = collections.Counter(e.call for e in resnet50_events)
    per_call = {'convolution_forward': 16, 'convolution_backward_filter': 16,
                'convolution_backward_data': 16,
                'batch_normalization_forward_training_ex': 11,
                'batch_normalization_backward': 10, 'activation_forward': 8,
                'activation_backward': 8, 'pooling_forward': 11,
                'pooling_backward': 11, 'softmax_forward': 5}
    assert sum(per_call[k] * n for k, n in counts.items()) == 4452


def _conv(shape_in, channels, dtype=numpy.float32):
    x = numpy.zeros(shape_in, dtype)
    W = numpy.zeros((channels, shape_in[1], 3, 3), dtype)
    y = numpy.empty((shape_in[0], channels) + shape_in[2:], dtype)
    highlevel.convolution_forward(x, W, None, y, (1, 1), (1, 1), (1, 1), 1,
                                  auto_tune=False, tensor_core='auto')


def test_cache_is_bounded_and_destroys_evicted_plans():
    b = Backend(capacity=2)
    previous = runtime.activate(b.runtime)
    try:
        fake = b.fake
        _conv((1, 4, 8, 8), 4)
        live_one = len(fake.live)         # the handle and 4 descriptors
        _conv((1, 4, 8, 8), 8)
        _conv((1, 4, 8, 8), 4)            # used: the most recent
        assert len(b.runtime.plans) == 2 and b.runtime.plans.built == 2
        _conv((1, 4, 8, 8), 16)           # evicts the plan of 8 channels
        assert len(b.runtime.plans) == 2 and b.runtime.plans.built == 3
        assert len(fake.live) == 1 + 2 * (live_one - 1)
        _conv((1, 4, 8, 8), 4)            # still cached
        assert b.runtime.plans.built == 3
        _conv((1, 4, 8, 8), 8)            # built again
        assert b.runtime.plans.built == 4
    finally:
        runtime.activate(previous)
    b.runtime.close()
    assert not b.fake.live
    with pytest.raises(ValueError, match='at least one plan'):
        plans.PlanCache(b.fake.library(), 0)


def test_failed_build_leaves_nothing(backend):
    fake = backend.fake
    fake.failures['cudnnSetConvolutionMathType'] = 2000
    with pytest.raises(library.CuDNNError) as info:
        _conv((1, 4, 8, 8), 4)
    assert 'in convolution_forward: x=shape (1, 4, 8, 8)' in str(info.value)
    assert len(backend.runtime.plans) == 0
    assert fake.live == set(backend.runtime.handles())
    del fake.failures['cudnnSetConvolutionMathType']
    _conv((1, 4, 8, 8), 4)
    assert len(backend.runtime.plans) == 1


def test_plans_are_keyed_by_what_they_depend_on(backend):
    _conv((1, 4, 8, 8), 4)
    _conv((1, 4, 8, 8), 4, numpy.float64)
    _conv((2, 4, 8, 8), 4)
    highlevel.set_max_workspace_size(1 << 20)
    _conv((1, 4, 8, 8), 4)
    backend.arrays.device = 1
    _conv((1, 4, 8, 8), 4)
    assert backend.runtime.plans.built == 5
    x = numpy.zeros((2, 8, 6, 6), 'f')
    for _ in range(2):
        highlevel.activation_forward(x, C.CUDNN_ACTIVATION_RELU)
    highlevel.activation_forward(x, C.CUDNN_ACTIVATION_CLIPPED_RELU, 6.0)
    assert backend.runtime.plans.built == 7


def test_bn_sizes_asked_once_per_shape(backend):
    fake = backend.fake
    fake.sizes['cudnnGetBatchNormalizationTrainingExReserveSpaceSize'] = 64
    fake.sizes['cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize'] = \
        32
    x = numpy.zeros((2, 4, 3, 3), 'f')
    reserves = []
    for _ in range(3):
        reserve, *_ = highlevel.batch_normalization_forward_training_ex(
            x, numpy.ones(4, 'f'), numpy.zeros(4, 'f'), numpy.zeros(4, 'f'),
            numpy.ones(4, 'f'), None, None, 2e-5, 0.9, True,
            C.CUDNN_BATCHNORM_SPATIAL, False)
        reserves.append(reserve)
    for name in ('cudnnGetBatchNormalizationTrainingExReserveSpaceSize',
                 'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize',
                 'cudnnGetBatchNormalizationBackwardExWorkspaceSize',
                 'cudnnDeriveBNTensorDescriptor'):
        assert len(fake.named(name)) == 1, name
    # a reserve space per call (each goes to its own backward pass), one
    # workspace buffer for the stream
    assert len({r.ptr for r in reserves}) == 3
    assert backend.arrays.allocations == [32, 64, 64, 64]
    launches = fake.named('cudnnBatchNormalizationForwardTrainingEx')
    assert len({c.args[-4] for c in launches}) == 1     # the workspace


def test_workspace_per_stream_grows_and_keeps_the_old(backend):
    """One buffer per stream, grown when a call needs more. A grown-out
    buffer of a stream a graph may have been captured on is kept (the
    graph may use it); the default stream's, which CUDA does not capture,
    goes back to the pool (kept, every grown-out buffer of the eager
    steps' stream stayed allocated until exit)."""
    rt, arrays = backend.runtime, backend.arrays
    arrays.current_stream = 0                # CuPy's null stream
    first = rt.workspace(100)
    assert rt.workspace(50) is first
    bigger = rt.workspace(200)
    assert bigger.nbytes == 200 and rt.workspace(10) is bigger
    assert rt._retired == []                 # never captured: let go
    arrays.current_stream = 0x7000           # a StepGraph's side stream
    captured = rt.workspace(10)
    other = rt.workspace(300)
    assert other.ptr not in (first.ptr, bigger.ptr, captured.ptr)
    assert [w for _, w in rt._retired] == [captured]   # a graph may use it
    assert rt.workspace(0).nbytes == 0
    rt.release_workspaces()
    assert rt.workspace(10) is not other


def test_release_stream_lets_go_of_that_streams_workspaces_only(backend):
    """A closed StepGraph's side stream: its buffer and its grown-out
    ones go, the other streams' stay."""
    rt, arrays = backend.runtime, backend.arrays
    arrays.current_stream = 0x7000
    small = rt.workspace(10)
    grown = rt.workspace(100)
    arrays.current_stream = 0x8000
    kept = rt.workspace(10)
    rt.release_stream(0x7000)
    assert rt.workspace(10) is kept
    assert all(k[1] != 0x7000 for k in rt._workspaces)
    assert all(w is not small for _, w in rt._retired)
    arrays.current_stream = 0x7000
    fresh = rt.workspace(10)
    assert fresh is not grown and fresh is not small


def test_one_handle_per_thread_each_on_its_stream(backend):
    rt, fake = backend.runtime, backend.fake
    handles = {}

    def work(name, stream):
        # the fake's stream is one attribute: each thread sets it itself
        backend.arrays.current_stream = stream
        handles[name] = rt.handle()

    for name, stream in (('a', 0x5100), ('b', 0x5200)):
        thread = threading.Thread(target=work, args=(name, stream))
        thread.start()
        thread.join()
    main = rt.handle()
    assert len({handles['a'], handles['b'], main}) == 3
    assert sorted(rt.handles()) == sorted([handles['a'], handles['b'], main])
    sets = [(c.args[0], c.args[1]) for c in fake.named('cudnnSetStream')]
    assert sets == [(handles['a'], 0x5100), (handles['b'], 0x5200),
                    (main, 0x5200)]
    rt.handle()
    rt.handle(handles['a'])            # a caller's handle: set every time
    assert len(fake.named('cudnnSetStream')) == 4


def test_close_destroys_everything(backend):
    fake, rt = backend.fake, backend.runtime
    _conv((1, 4, 8, 8), 4)
    highlevel.softmax_forward(numpy.zeros((4, 10), 'f'), 1,
                              C.CUDNN_SOFTMAX_LOG)
    assert fake.live
    rt.close()
    assert not fake.live
    assert len(rt.plans) == 0 and not rt.handles()
    _conv((1, 4, 8, 8), 4)             # usable again: a new handle, plan
    assert len(fake.named('cudnnCreate')) == 2
