"""Typed training configuration: one JSON file per run, validated on load.

``load(path)`` returns a frozen :class:`TrainConfig`; any unknown key,
missing key, wrong type or impossible value raises :class:`ConfigError`
naming the key and the file. The keys that are arguments of
:class:`chainerkfac.optimizers.KFAC` are checked by the optimizer's own
rules and choices (:mod:`chainerkfac.optimizers.options`).
``save(config, path)`` writes the resolved config back as JSON that
``load`` reads unchanged (the training script keeps it next to its logs).

The learning rate and damping values carry the magnitudes of the authors'
published configs, 1000 times the values printed in Table 3 of the paper's
text; see ``config/README.md``.
"""
import dataclasses
import difflib
import json
import os
import typing
from typing import Optional, Union

from chainerkfac.optimizers import lars, options

_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


class ConfigError(ValueError):
    """An invalid configuration; the message names the key and the file.

    Attributes
    ----------
    key : str or None
        The offending key (``None`` for errors of the whole file).
    source : str
        The file (or ``'<TrainConfig>'`` for a config built in code).
    """

    def __init__(self, key, message, source='<TrainConfig>'):
        self.key = key
        self.message = message
        self.source = source
        where = source if key is None else "{}: key '{}'".format(source, key)
        super().__init__('{}: {}'.format(where, message))

    def with_source(self, source):
        """The same error attributed to ``source``."""
        return ConfigError(self.key, self.message, source)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one training run (Table 3 of the paper).

    Attributes
    ----------
    global_batch_size : int
        Mini-batch size of one K-FAC step over all processes (BS).
    epochs : int
        Number of training epochs (Table 1).
    alpha_mixup : float
        α_mixup of running mixup, eqs. (9)-(11); ``0`` disables mixup.
    damping : float
        γ(0), the initial damping (eq. 16).
    damping_target : float
        γ_target, the damping after warm-up; ``damping >= damping_target``.
    rho_bn : float
        ρ_BN: BatchNormalization layers use the damping ``ρ_BN γ(t)``.
    damping_warmup_steps : int
        t_warmup of eq. (15), in K-FAC steps.
    p_decay : float
        Exponent of the polynomial learning-rate decay, eq. (17).
    e_start, e_end : float
        Epochs where the decay of eq. (17) starts and ends.
    lr : float
        η(0), the initial learning rate.
    momentum : float
        m(0), the initial momentum, in ``[0, 1)``; ``m(e)`` follows eq. (18).
    batch_size_per_process : int
        Samples per process per micro-batch (32 per GPU in the paper).
    bn_fisher : str
        One of :data:`chainerkfac.optimizers.options.BN_FISHER_MODES`:
        ``'full'`` (2C x 2C Fisher of a BN layer) or ``'diag'`` (section 5.4).
    fisher : str
        One of :data:`chainerkfac.optimizers.options.FISHER_TYPES`:
        ``'emp'`` (empirical Fisher, the paper), ``'mc'`` (sampled labels),
        ``'exact'`` (the loss Hessian's root, KFLR).
    factor_dtype : str
        One of :data:`chainerkfac.optimizers.options.FACTOR_DTYPES`
        (``'float32'``, ``'float16'``, ``'tf32'``): precision of factor
        construction.
    precondition_dtype : str
        One of :data:`chainerkfac.optimizers.options.PRECONDITION_DTYPES`
        (``'float32'``, ``'tf32'``): stage 5's dense products on TF32
        Tensor Cores with ``'tf32'``.
    refresh_interval_a, refresh_interval_g, refresh_interval_f : int or str
        Steps between refreshes of the Kronecker factors A and G and of the
        BN Fisher F: a positive int, or a preset of
        :data:`chainerkfac.equations.REFRESH_PRESETS` (``'eq22'``,
        ``'eq23'``).
    weight_rescale : bool or str
        Eq. (20), rescaling Conv/FC weights after each step: ``true`` (every
        Conv/FC weight, the paper's ResNet-50 runs), ``false``, or
        ``"auto"`` (the layers the optimizer finds scale-invariant, i.e.
        followed by BatchNormalization).
    max_factor_dim : int or null
        The optimizer's cost guard (factors larger than this kept as their
        diagonal). ``null`` (the default here, unlike the library's): no
        limit, every factor full as in the paper (ResNet-50's largest is
        4608²).
    inverse_method : str
        One of :data:`chainerkfac.linalg.INVERSE_METHODS`: ``'cholesky'``
        (the default), ``'newton_schulz'`` (batched GEMMs for the factors
        up to n = 1024; for GPUs) or ``'cholesky_solve'`` (the CPU only:
        Cholesky factors kept, stage 5 by triangular solves).
    kl_clip : float or null
        The optimizer's bounded step (kfac-pytorch's ``kl_clip``).
        ``null`` (the default here, unlike the library's): no bound, the
        paper's update; the refresh intervals likewise default to 1 here
        (every step), not to the library's stale default.
    low_rank : bool
        The optimizer's low-rank factors (:mod:`chainerkfac.low_rank`):
        ``false`` (the default here, unlike the library's): every factor
        dense and inverted as the paper does.
    lars_momentum : str
        The momentum form of the LARS baseline (``--optimizer lars``), one
        of :data:`chainerkfac.optimizers.lars.MOMENTUM_FORMS`:
        ``'unscaled'`` (the default: seed 002's Figure 6, with which its
        Table 1 reaches the record 64 epochs at momentum 0.929) or
        ``'scaled'`` (Figure 5, the MLPerf-0.6 reference); the command
        line's ``--lars-momentum`` overrides it.
    n_class : int
        Number of classes of the data set (1000 for ImageNet); every label
        must lie in ``[0, n_class)``.
    description : str
        Free text naming the run (e.g. its row of Table 3).
    """

    global_batch_size: int
    epochs: int
    alpha_mixup: float
    damping: float
    damping_target: float
    rho_bn: float
    damping_warmup_steps: int
    p_decay: float
    e_start: float
    e_end: float
    lr: float
    momentum: float
    batch_size_per_process: int = 32
    bn_fisher: str = 'full'
    fisher: str = 'emp'
    factor_dtype: str = 'float32'
    precondition_dtype: str = 'float32'
    refresh_interval_a: Union[int, str] = 1
    refresh_interval_g: Union[int, str] = 1
    refresh_interval_f: Union[int, str] = 1
    weight_rescale: Union[bool, str] = True
    max_factor_dim: Optional[int] = None
    inverse_method: str = 'cholesky'
    kl_clip: Optional[float] = None
    low_rank: bool = False
    lars_momentum: str = 'unscaled'
    n_class: int = 1000
    description: str = ''

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = _check_type(field.name, getattr(self, field.name),
                                _field_types()[field.name])
            object.__setattr__(self, field.name, value)
        _check_values(self)

    def acc_iters(self, n_processes):
        """Micro-batches accumulated per step on ``n_processes`` processes.

        See :func:`derive_acc_iters`.
        """
        return derive_acc_iters(self.global_batch_size, n_processes,
                                self.batch_size_per_process)


def _field_types():
    return typing.get_type_hints(TrainConfig)


def _check_type(key, value, expected):
    """Return ``value`` (ints widened to float for float fields) or raise."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if expected is float and (is_int or isinstance(value, float)):
        return float(value)
    if expected is int and is_int:
        return value
    if expected in (str, bool) and isinstance(value, expected):
        return value
    if expected == Union[int, str] and (is_int or isinstance(value, str)):
        return value
    if expected == Union[bool, str] and isinstance(value, (bool, str)):
        return value
    if expected == Optional[int] and (value is None or is_int):
        return value
    if expected == Optional[float] and (value is None or is_int or
                                        isinstance(value, float)):
        return None if value is None else float(value)
    names = {float: 'a number', int: 'an integer', str: 'a string',
             bool: 'true or false', Union[int, str]:
             'a positive integer or a preset name',
             Union[bool, str]: 'true or false, or "auto"',
             Optional[int]: 'a positive integer or null',
             Optional[float]: 'a positive number or null'}
    raise ConfigError(key, 'must be {}, got {!r} ({})'.format(
        names[expected], value, type(value).__name__))


def _check_values(config):
    """The optimizer's arguments by the optimizer's own checks
    (:mod:`chainerkfac.optimizers.options`), then what a training run
    needs beyond them."""
    try:
        options.check_options(**kfac_options(config))
    except options.OptionError as error:
        # The config's keys are the names of KFAC's arguments.
        raise ConfigError(error.name, '{}, got {!r}'.format(
            error.why, error.value)) from None

    def require(condition, key, message):
        if not condition:
            raise ConfigError(key, '{}, got {!r}'.format(
                message, getattr(config, key)))

    require(config.lars_momentum in lars.MOMENTUM_FORMS, 'lars_momentum',
            'must be one of {}'.format(lars.MOMENTUM_FORMS))
    for key in ('global_batch_size', 'epochs', 'batch_size_per_process',
                'n_class'):
        require(getattr(config, key) >= 1, key, 'must be at least 1')
    require(config.lr > 0, 'lr', 'must be positive (with η(0) = 0 the run '
            'would never change the weights)')
    require(config.alpha_mixup >= 0, 'alpha_mixup',
            'must be non-negative (0 disables mixup)')
    require(config.p_decay >= 0, 'p_decay', 'must be non-negative')
    require(config.e_start >= 0, 'e_start', 'must be non-negative')
    require(config.e_end > config.e_start, 'e_end',
            'must be larger than e_start ({})'.format(config.e_start))
    require(config.global_batch_size % config.batch_size_per_process == 0,
            'global_batch_size', 'must be a multiple of '
            'batch_size_per_process ({})'.format(
                config.batch_size_per_process))


def from_dict(data, source='<dict>'):
    """Build a :class:`TrainConfig` from a mapping, validating every key.

    Parameters
    ----------
    data : dict
        Keys are the field names of :class:`TrainConfig`.
    source : str
        Named in error messages (the file the mapping came from).

    Raises
    ------
    ConfigError
    """
    if not isinstance(data, dict):
        raise ConfigError(None, 'a config must be a JSON object, got {}'
                          .format(type(data).__name__), source)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = '; did you mean {!r}?'.format(close[0]) if close else ''
            raise ConfigError(key, 'unknown key{}'.format(hint), source)
    for name, field in fields.items():
        if name not in data and field.default is dataclasses.MISSING:
            raise ConfigError(name, 'missing (required)', source)
    try:
        return TrainConfig(**data)
    except ConfigError as error:
        raise error.with_source(source) from None


def load(path):
    """Read and validate a JSON config.

    Parameters
    ----------
    path : str
        A JSON file, e.g. ``preset_path('bs32k')``.

    Returns
    -------
    TrainConfig

    Raises
    ------
    ConfigError
        Invalid JSON, unknown or missing key, wrong type or impossible
        value; the message names the key and ``path``.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ConfigError(None, 'invalid JSON: {}'.format(error),
                              path) from None
    return from_dict(data, source=path)


def to_dict(config):
    """The config as a plain dict (field order), ready for JSON."""
    return dataclasses.asdict(config)


def save(config, path):
    """Write the config as JSON; ``load(path)`` returns an equal config."""
    with open(path, 'w') as f:
        json.dump(to_dict(config), f, indent=2)
        f.write('\n')


def preset_names():
    """Names of the bundled configs (``'bs4k'``, ..., ``'bs32k_stale'``)."""
    return sorted(name[:-5] for name in os.listdir(_CONFIG_DIR)
                  if name.endswith('.json'))


def preset_path(name):
    """Path of a bundled config by name, e.g. ``preset_path('bs32k')``."""
    path = os.path.join(_CONFIG_DIR, name + '.json')
    if not os.path.isfile(path):
        raise ValueError('no bundled config {!r}; available: {}'.format(
            name, ', '.join(preset_names())))
    return path


def derive_acc_iters(global_batch, n_processes, batch_per_process):
    """Micro-batches each process accumulates before one K-FAC step.

    Parameters
    ----------
    global_batch : int
        Samples per step over all processes.
    n_processes : int
        Number of processes (GPUs / MPI ranks).
    batch_per_process : int
        Samples per process per micro-batch.

    Returns
    -------
    int
        ``acc_iters`` with ``n_processes * batch_per_process * acc_iters ==
        global_batch``.

    Raises
    ------
    ValueError
        The numbers do not fit; the message gives them and why.
    """
    for name, value in (('global batch', global_batch),
                        ('number of processes', n_processes),
                        ('batch per process', batch_per_process)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError('{} must be a positive int, got {!r}'.format(
                name, value))
    per_micro_batch = n_processes * batch_per_process
    if per_micro_batch > global_batch:
        raise ValueError(
            '{} processes x {} samples = {} samples per micro-batch exceed '
            'the global batch of {}: use at most {} processes'.format(
                n_processes, batch_per_process, per_micro_batch,
                global_batch, global_batch // batch_per_process))
    if global_batch % batch_per_process:
        raise ValueError(
            'global batch {} is not a multiple of the batch per process {} '
            '(ratio {:.4g})'.format(global_batch, batch_per_process,
                                    global_batch / batch_per_process))
    if global_batch % per_micro_batch:
        raise ValueError(
            'global batch {} is not divisible by {} processes x {} samples '
            '= {} (ratio {:.4g}): the number of processes must divide {}'
            .format(global_batch, n_processes, batch_per_process,
                    per_micro_batch, global_batch / per_micro_batch,
                    global_batch // batch_per_process))
    return global_batch // per_micro_batch


def kfac_options(config):
    """Keyword arguments of :class:`chainerkfac.optimizers.KFAC` for a config.

    The one mapping from a :class:`TrainConfig` to the optimizer (the
    training script, the analysis fixtures and the benchmarks use it); the
    caller adds what is not a property of the config (``acc_iters``,
    ``fisher_diff``, ``verbose``, ``seed``).

    Returns
    -------
    dict
        ``lr``, ``momentum``, the damping of eqs. (13)-(16), ``rho_bn``,
        ``bn_fisher``, ``fisher``, the refresh intervals, ``factor_dtype``,
        ``precondition_dtype``,
        ``weight_rescale``, ``max_factor_dim``, ``inverse_method``,
        ``kl_clip`` and ``low_rank``: every option whose library default
        differs from the paper (the stale intervals, the bounded step, the
        low-rank factors) is set explicitly.
    """
    return dict(
        lr=config.lr, momentum=config.momentum, damping=config.damping,
        damping_target=config.damping_target,
        damping_warmup_steps=config.damping_warmup_steps,
        rho_bn=config.rho_bn, bn_fisher=config.bn_fisher,
        fisher=config.fisher, refresh_interval_a=config.refresh_interval_a,
        refresh_interval_g=config.refresh_interval_g,
        refresh_interval_f=config.refresh_interval_f,
        factor_dtype=config.factor_dtype,
        precondition_dtype=config.precondition_dtype,
        weight_rescale=config.weight_rescale,
        max_factor_dim=config.max_factor_dim,
        inverse_method=config.inverse_method, kl_clip=config.kl_clip,
        low_rank=config.low_rank)


def check_epochs(config, source=None, option=None):
    """Refuse a run longer than the learning-rate decay of eq. (17).

    K-FAC's learning rate is exactly 0 from ``e_end`` on, so epochs beyond
    it would spend compute without changing the weights.

    Parameters
    ----------
    config : TrainConfig
    source : str or None
        The config file.
    option : str or None
        The command-line option that set ``epochs`` (``'--epochs'``), named
        in the message; ``None``: ``epochs`` is the config's own.

    Raises
    ------
    ConfigError
        ``epochs > e_end``, with both numbers.
    """
    if config.epochs > config.e_end:
        given = '' if option is None else \
            ' (from {} on the command line, not the config)'.format(option)
        raise ConfigError(
            'epochs', '{} epochs{} exceed e_end = {:g}, where the learning '
            'rate of eq. (17) reaches 0: the last {:g} epochs would not '
            'change the weights; use at most {} epochs or raise e_end'.format(
                config.epochs, given, config.e_end,
                config.epochs - config.e_end,
                int(config.e_end)), source or '<TrainConfig>')
