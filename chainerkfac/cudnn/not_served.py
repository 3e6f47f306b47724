"""What the backend does not serve, and the error that says so.

Chainer 7.8.1 chooses its cuDNN path by ``chainer.should_use_cudnn`` alone,
so for a function whose cuDNN API is gone from cuDNN 9 (the RNN API Chainer
uses) or that the backend leaves out (the spatial transformer) it cannot
fall back by itself. The installed modules therefore refuse those names
when Chainer looks them up, before any work, with a
:class:`NotServedError` that names the way out:
``chainer.config.use_cudnn = 'never'`` around the call, which makes Chainer
take its own path for it.

Layer by layer (Chainer 7.8.1):

=====================================================  =======================
Chainer function                                       with this backend
=====================================================  =======================
convolution / deconvolution 2-D and N-D, with bias,     cuDNN
groups, dilation; BatchNormalization (training,
inference, backward), GroupNormalization; max and
average pooling 2-D and N-D; softmax, log_softmax
(softmax_cross_entropy); relu, sigmoid, tanh,
clipped_relu (``use_cudnn='always'``); dropout
n_step_rnn / lstm / gru and bidirectional forms         NotServedError on first
(``L.NStepLSTM`` ...)                                   call (``cupy.cudnn.
                                                        create_rnn_descriptor``)
spatial_transformer_grid / _sampler                     NotServedError on first
                                                        call
convolutions with ``compute_mode='cudnn_fast'``         NotServedError (NHWC)
=====================================================  =======================
"""

_WAY_OUT = ("Run it on Chainer's own path: with chainer.using_config("
            "'use_cudnn', 'never'): ... (or chainer.config.use_cudnn = "
            "'never').")

#: Names Chainer 7.8.1 looks up, and which of its functions does.
CHAINER_CALLERS = {
    'cupy.cudnn': {
        **dict.fromkeys(
            ('create_rnn_descriptor', 'get_rnn_lin_layer_matrix_params',
             'get_rnn_lin_layer_bias_params', 'rnn_forward_inference',
             'rnn_forward_training', 'rnn_backward_data',
             'rnn_backward_weights', 'create_tensor_nd_descriptor',
             'create_filter_descriptor'),
            "Chainer's cuDNN RNN (F.n_step_rnn / n_step_lstm / n_step_gru "
            "and their bidirectional forms, L.NStepLSTM ...): cuDNN 9 "
            "removed the RNN API it calls"),
        **dict.fromkeys(
            ('create_spatial_transformer_descriptor',
             'create_tensor_descriptor'),
            'F.spatial_transformer_grid / F.spatial_transformer_sampler'),
    },
    'cupy.cuda.cudnn': {
        'getRNNParamsSize': "Chainer's cuDNN RNN",
        **dict.fromkeys(
            ('spatialTfGridGeneratorForward', 'spatialTfGridGeneratorBackward',
             'spatialTfSamplerForward', 'spatialTfSamplerBackward'),
            'F.spatial_transformer_grid / F.spatial_transformer_sampler'),
    },
}


class NotServedError(NotImplementedError):
    """Chainer asked the cuDNN 9 backend for something it does not serve."""


class NotServedAttributeError(NotServedError, AttributeError):
    """A name of CuPy 13's cuDNN modules that the backend does not define.

    An ``AttributeError`` too, so that ``hasattr`` and ``getattr(module,
    name, default)`` on the installed modules behave as on any module.
    """


def refuse(module: str, name: str) -> NotServedAttributeError:
    """The error for ``module.name`` (``module`` as Chainer imports it)."""
    caller = CHAINER_CALLERS.get(module, {}).get(name)
    return NotServedAttributeError(
        "chainerkfac.cudnn (cuDNN 9 for Chainer on CuPy 14) does not serve "
        "{}.{}{}. {}".format(
            module, name, ', which {} calls'.format(caller) if caller else '',
            _WAY_OUT))


def layout(what: str) -> NotServedError:
    """The error for an NHWC layout (``compute_mode='cudnn_fast'``)."""
    return NotServedError(
        'chainerkfac.cudnn serves NCHW arrays only; {} was asked for NHWC '
        "(chainer.config.compute_mode = 'cudnn_fast'). Leave compute_mode "
        'unset, or: {}'.format(what, _WAY_OUT))


def module_getattr(module: str):
    """A module-level ``__getattr__`` refusing every other public name."""
    def __getattr__(name):
        if name.startswith('__'):
            raise AttributeError('module {!r} has no attribute {!r}'.format(
                module, name))
        raise refuse(module, name)
    return __getattr__
