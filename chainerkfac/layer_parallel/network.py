"""The residual network as forward Euler: :class:`ResidualODE`.

u_0 = σ(L_in y), u_{n+1} = u_n + h σ(K_n u_n + b_n) for n < N, logits
W u_N + μ, with h = T / N (seed eqs. 2.2-2.5, 2.13). ``net(x)`` runs the
layers in order with Chainer's autodiff (the layer-serial reference); MGRIT
(:mod:`.mgrit`) calls the per-layer methods below on plain arrays.
"""
from typing import Optional, Tuple, Union

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import backend

from chainerkfac.layer_parallel import activations

LAYER_KINDS = ('dense', 'conv')
WEIGHTS = ('independent', 'smooth')


class ResidualODE(chainer.Chain):
    """A ResNet u_{n+1} = u_n + h σ(K_n u_n + b_n) of ``n_layers`` layers.

    Parameters
    ----------
    n_in : int
        Input features (``'dense'``) or input channels (``'conv'``).
    width : int
        Width q of the state u_n: features, or channels for ``'conv'``.
    n_layers : int
        Number N of residual layers (time steps).
    n_out : int
        Number of classes.
    t_final : float
        Final time T; every layer's step is h = T / N.
    activation : str
        ``'smooth_relu'`` (the seed's eq. 5.34), ``'tanh'`` or ``'relu'``.
    layer : str
        ``'dense'``: K_n is a q×q matrix and states are (batch, q);
        ``'conv'``: K_n is a ``ksize``×``ksize`` convolution of q channels
        (stride 1, same padding) and states are (batch, q, H, W).
    ksize : int
        Odd kernel size of the convolutions (``'conv'`` only).
    image_size : int or (int, int)
        Input height and width (``'conv'`` only; sizes the classifier).
    weights : str
        Initial K_n: ``'independent'`` — every layer its own draw of
        Chainer's default initializer (θ(t) is white noise in t);
        ``'smooth'`` — K_n = (1 - s_n) A + s_n B with s_n = n / (N - 1)
        for two such draws A, B, linear in t, the regime the seed's
        time-derivative regularisation keeps training in
        (:mod:`.regularization`). Biases start at zero either way.

    Notes
    -----
    The opening layer L_in (a linear map or a convolution, followed by σ,
    as in the seed's Peaks network) and the classifier (W, μ) are ordinary
    links; parameters take Chainer's default dtype
    (``chainer.using_config('dtype', numpy.float64)`` for float64).
    """

    def __init__(self, n_in: int, width: int, n_layers: int, n_out: int,
                 t_final: float = 5.0, activation: str = 'smooth_relu',
                 layer: str = 'dense', ksize: int = 3,
                 image_size: Optional[Union[int, Tuple[int, int]]] = None,
                 weights: str = 'independent'):
        super().__init__()
        if weights not in WEIGHTS:
            raise ValueError('weights must be one of {}, not {!r}'.format(
                WEIGHTS, weights))
        if layer not in LAYER_KINDS:
            raise ValueError('layer must be one of {}, not {!r}'.format(
                LAYER_KINDS, layer))
        if n_layers < 1:
            raise ValueError('n_layers must be positive, not {}'.format(
                n_layers))
        _check_t_final(t_final)
        if layer == 'conv':
            if image_size is None:
                raise ValueError("layer='conv' needs image_size (H or (H, W))")
            if ksize % 2 != 1:
                raise ValueError('ksize must be odd (same padding), not {}'
                                 .format(ksize))
        self.n_layers = n_layers
        self.t_final = t_final
        self.layer = layer
        self.activation = activation
        with self.init_scope():
            if layer == 'dense':
                self.opening = L.Linear(n_in, width)
                self.layers = chainer.ChainList(
                    *[L.Linear(width, width) for _ in range(n_layers)])
                self.classifier = L.Linear(width, n_out)
            else:
                h, w = ((image_size, image_size)
                        if isinstance(image_size, int) else image_size)
                self.image_size = (int(h), int(w))
                pad = ksize // 2
                self.opening = L.Convolution2D(n_in, width, ksize, pad=pad)
                self.layers = chainer.ChainList(
                    *[L.Convolution2D(width, width, ksize, pad=pad)
                      for _ in range(n_layers)])
                self.classifier = L.Linear(width * h * w, n_out)
        if weights == 'smooth':
            self._interpolate_weights()

    # -- the ODE's time and activation: read at every step ------------------
    @property
    def t_final(self) -> float:
        """T, the final time; settable (a finite positive time): the step
        :attr:`h` follows (a copy taken at construction kept the first
        one's)."""
        try:
            return self.__dict__['_t_final']
        except KeyError:
            raise AttributeError('t_final') from None

    @t_final.setter
    def t_final(self, value) -> None:
        _check_t_final(value)
        self.__dict__['_t_final'] = float(value)

    @property
    def h(self) -> float:
        """The step T / N of each layer."""
        return self.t_final / self.n_layers

    @property
    def activation(self) -> str:
        """σ's name (:mod:`.activations`); settable."""
        try:
            return self.__dict__['_activation_name']
        except KeyError:
            raise AttributeError('activation') from None

    @activation.setter
    def activation(self, name) -> None:
        function = activations.get(name)      # refuses an unknown name
        self.__dict__['_activation'] = function
        self.__dict__['_activation_name'] = name

    def _interpolate_weights(self) -> None:
        """K_n from the first and the last layer's draws, linearly."""
        first = self.layers[0].W.array.copy()
        last = self.layers[-1].W.array.copy()
        span = max(self.n_layers - 1, 1)
        for n, link in enumerate(self.layers):
            s = n / span
            link.W.array[...] = (1 - s) * first + s * last

    # -- the serial network ------------------------------------------------

    def check_input(self, x) -> None:
        """Refuse a batch whose images are not the size the network was
        built for (its classifier's width is set by it), before any
        layer runs.

        Raises
        ------
        ValueError
            The size of ``x``'s images, and the network's.
        """
        size = getattr(self, 'image_size', None)
        if size is not None and tuple(x.shape[2:]) != size:
            raise ValueError(
                'the batch has images of {} but the network was built for '
                'image_size={} (ResidualODE(..., image_size=...))'.format(
                    'x'.join(str(s) for s in x.shape[2:]) or 'no size',
                    'x'.join(str(s) for s in size)))

    def forward(self, x) -> chainer.Variable:
        """Logits of ``x``, layer-serial, with Chainer's graph."""
        self.check_input(x)
        u = self.open(x)
        for n in range(self.n_layers):
            u = u + self.h * self.residual(n, u)
        return self.classifier(u)

    def open(self, x) -> chainer.Variable:
        """u_0 = σ(L_in x)."""
        return self._activation.function(self.opening(x))

    def residual(self, n: int, u) -> chainer.Variable:
        """F(u, θ_n) = σ(K_n u + b_n), with Chainer's graph."""
        return self._activation.function(self.layers[n](u))

    # -- one layer on arrays (MGRIT's propagators) -------------------------

    def step(self, n: int, u, dt: float, out=None):
        """u + dt σ(K_n u + b_n): layer ``n`` with step ``dt`` (h on the
        finest level, c^l h on level l), into ``out`` (not ``u``) or a new
        array."""
        z = self._affine(n, u)
        self._activation.values(z, out=z)
        z *= dt
        return self.xp.add(u, z, out=out)

    def slope(self, n: int, u):
        """σ'(K_n u + b_n), the linearisation of layer ``n`` at ``u``."""
        z = self._affine(n, u)
        return self._activation.slope(z, out=z)

    def step_adjoint(self, n: int, slope, ubar, dt: float, out=None):
        """(∂_u [u + dt σ(K_n u + b_n)])^T ubar at the state whose
        :meth:`slope` is ``slope``: ubar + K_n^T (σ' ⊙ dt ubar), into
        ``out`` (not ``ubar``) or a new array.

        The operations are the ones Chainer's backward of :meth:`forward`
        performs, in the same order.
        """
        gz = ubar * dt
        gz *= slope
        link = self.layers[n]
        if self.layer == 'dense':
            gx = gz.dot(link.W.array)
        else:
            with chainer.no_backprop_mode():
                gx = F.deconvolution_2d(
                    gz, link.W.array, stride=link.stride, pad=link.pad,
                    outsize=ubar.shape[2:]).array
        return self.xp.add(ubar, gx, out=out)

    def _affine(self, n: int, u):
        """K_n u + b_n as a new array, computed as ``F.linear`` /
        ``F.convolution_2d`` compute it."""
        link = self.layers[n]
        if self.layer == 'dense':
            z = u.dot(link.W.array.T)
            z += link.b.array
            return z
        with chainer.no_backprop_mode():
            return link(u).array

    def accumulate_layer_grad(self, n: int, u, slope, ubar_next,
                              dt: float) -> None:
        """Add dt (∂_θ σ(K_n u + b_n))^T ubar_next to the grads of layer
        ``n`` (the design equation 2.19 for one layer), at the state ``u``
        whose :meth:`slope` is ``slope``.

        Like Chainer's backward: grads that are ``None`` are set, others
        accumulated into. The products are Chainer's own: the backward of
        the layer's link called on ``u`` with ``dt σ' ⊙ ubar_next`` as the
        gradient w.r.t. its output ``K_n u + b_n``, where function hooks
        (:mod:`chainerkfac.capture`, which feeds K-FAC's factors) see the
        call. A dense layer with no hook installed skips the call (its
        forward is not needed) and forms the same two products of its
        ``linear`` backward directly: the same bits, a third of the time.
        """
        gz = ubar_next * dt
        gz *= slope
        link = self.layers[n]
        if self.layer == 'dense' and not chainer.get_function_hooks():
            _accumulate(link.W, gz.T.dot(u))
            _accumulate(link.b, gz.sum(axis=0))
        else:
            z = link(chainer.Variable(u, requires_grad=False))
            z.grad = gz
            z.backward()

    def layer_params(self, n: int):
        """The parameters of residual layer ``n``, in a fixed order."""
        return [param for _, param in sorted(self.layers[n].namedparams())]

    def pack_layer(self, n: int):
        """Layer ``n``'s parameters as one new flat array (to send)."""
        return self.xp.concatenate(
            [param.array.ravel() for param in self.layer_params(n)])

    def unpack_layer(self, n: int, flat) -> None:
        """Set layer ``n``'s parameters from :meth:`pack_layer`'s layout."""
        offset = 0
        for param in self.layer_params(n):
            size = param.array.size
            param.array[...] = flat[offset:offset + size].reshape(
                param.array.shape)
            offset += size

    def state_shape(self, x_shape) -> tuple:
        """Shape of every state u_n for an input batch of ``x_shape``."""
        opening = self.opening
        if self.layer == 'dense':
            return (x_shape[0], opening.out_size)
        return (x_shape[0], opening.out_channels) + tuple(x_shape[2:])

    @property
    def xp(self):
        """NumPy or CuPy: where the parameters live."""
        return backend.get_array_module(self.opening.W.array)

    def synchronize(self) -> None:
        """Wait for the work queued on the device (for timings; nothing on
        the CPU)."""
        xp = self.xp
        if xp is not numpy:
            xp.cuda.get_current_stream().synchronize()


def _accumulate(param: chainer.Parameter, grad) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _check_t_final(t_final) -> None:
    if isinstance(t_final, bool) or not isinstance(
            t_final, (int, float, numpy.integer, numpy.floating)) or \
            not 0 < t_final < float('inf'):
        raise ValueError('t_final must be a finite positive time, not '
                         '{!r}'.format(t_final))
