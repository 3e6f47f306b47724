"""An optimizer whose ``update(lossfun, *inputs)`` goes through a
:class:`~chainerkfac.graphs.step.StepGraph`: the one-line switch.

::

    optimizer = chainerkfac.graphs.graphed(optimizer)   # after setup
    optimizer.update(model, x, t)     # eager, captured or replayed

:func:`graphed` picks the adapter by the optimizer's type
(:class:`~chainerkfac.optimizers.KFAC`,
:class:`~chainerkfac.optimizers.GuardedOptimizer`, a Chainer
:class:`~chainer.GradientMethod`); everything else (``lr``, ``t``,
``serialize``, ``new_epoch`` ...) reaches the wrapped optimizer, so a
Trainer, its extensions and snapshots use it as before. The wrapper's own
are ``warmup`` (settable), ``graph``, ``stats`` and ``close``.
"""
from chainerkfac.graphs import step as step_module


class GraphedOptimizer:
    """An optimizer driven through a :class:`StepGraph` (module
    docstring).

    Parameters
    ----------
    optimizer : chainer.Optimizer or chainerkfac.optimizers.GuardedOptimizer
        Set up with its model.
    adapter : object
        The :class:`StepGraph` adapter of ``optimizer``.
    warmup : int
    cupy : module, optional
    route_linear : callable, optional
        See :class:`StepGraph`.
    """

    def __init__(self, optimizer, adapter, warmup: int = step_module.WARMUP,
                 cupy=None, route_linear=None):
        state = self.__dict__
        state['optimizer'] = optimizer
        state['adapter'] = adapter
        state['_options'] = dict(warmup=step_module.checked_warmup(warmup),
                                 cupy=cupy, route_linear=route_linear)
        state['_lossfun'] = None
        state['graph'] = None

    def __getattr__(self, name):
        return getattr(self.__dict__['optimizer'], name)

    def __setattr__(self, name, value):
        if name in self.__dict__ or isinstance(
                getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        else:
            setattr(self.optimizer, name, value)

    @property
    def warmup(self) -> int:
        """Eager steps of an input signature before its capture
        (:attr:`StepGraph.warmup`): set here, it counts for the
        signatures not captured yet, those of a new loss function
        included."""
        return self._options['warmup']

    @warmup.setter
    def warmup(self, value: int) -> None:
        value = step_module.checked_warmup(value)
        self._options['warmup'] = value
        if self.graph is not None:
            self.graph.warmup = value

    def update(self, lossfun=None, *args, **kwds) -> str:
        """One step of ``lossfun`` on the positional arrays ``args``
        through the graph; without ``lossfun`` or with keyword arguments,
        the wrapped optimizer's own update. Returns ``'eager'``,
        ``'captured'`` or ``'replayed'``."""
        if lossfun is None or kwds:
            if self.graph is not None:
                self.graph.stats['eager: update() without a loss function '
                                 'or with keyword arguments'] += 1
            self.optimizer.update(lossfun, *args, **kwds)
            return 'eager'
        if lossfun is not self._lossfun:
            optimizer = self.optimizer
            if self.graph is not None:
                self.graph.close()      # another loss: its graphs go
            self.graph = step_module.StepGraph(None, self.adapter,
                                               **self._options)
            make = getattr(self.adapter, 'step_function', None)
            self.graph.step = (
                make(lossfun, self.graph) if make is not None else
                lambda *inputs: optimizer.update(lossfun, *inputs))
            self._lossfun = lossfun
        return self.graph(*args)

    def close(self) -> None:
        """Let go of the graph and its memory (:meth:`StepGraph.close`);
        the optimizer stays usable (a later step captures afresh)."""
        if self.graph is not None:
            self.graph.close()

    @property
    def stats(self):
        """The graph's counts (:attr:`StepGraph.stats`), empty before the
        first step."""
        return self.graph.stats if self.graph is not None else {}


def graphed(optimizer, warmup: int = step_module.WARMUP, cupy=None,
            route_linear=None, refresh_steps: bool = False
            ) -> GraphedOptimizer:
    """``optimizer`` with its steps captured and replayed as CUDA graphs
    where they can be (module docstring; what runs eagerly, and why, is
    counted in ``.stats``).

    With ``refresh_steps`` (K-FAC only) K-FAC's refresh steps are replayed
    too but for their factors' average and inverse stage, which run
    eagerly between two graphs: their forward and backward passes
    (:class:`~chainerkfac.graphs.kfac_step.RefreshPasses`, counted in
    ``.stats`` as ``'refresh passes: ...'``) and their end, stage 5 and the
    update (:class:`~chainerkfac.graphs.kfac_step.RefreshUpdate`,
    ``'refresh update: ...'``).

    Raises
    ------
    TypeError
        For an optimizer with no adapter.
    ValueError
        If it is not set up yet.
    """
    from chainer import optimizer as chainer_optimizer
    from chainer import optimizer_hooks
    from chainerkfac.optimizers import GuardedOptimizer, KFAC
    from chainerkfac.graphs import guarded_step, kfac_step
    if not isinstance(optimizer, (GuardedOptimizer,
                                  chainer_optimizer.GradientMethod)):
        raise TypeError('graphed takes chainerkfac.optimizers.KFAC, '
                        'GuardedOptimizer or a chainer.GradientMethod, got '
                        '{}'.format(type(optimizer).__name__))
    if getattr(optimizer, 'target', None) is None:
        raise ValueError('graphed: set the optimizer up with its model '
                         'first (optimizer.setup(model))')
    if refresh_steps and not isinstance(optimizer, KFAC):
        raise TypeError('graphed(refresh_steps=True) is for K-FAC, got '
                        '{}'.format(type(optimizer).__name__))
    if isinstance(optimizer, KFAC):
        adapter = kfac_step.KFACOptimizer(optimizer, refresh_steps)
    elif isinstance(optimizer, GuardedOptimizer):
        adapter = guarded_step.GuardedOptimizer(optimizer)
    else:
        adapter = step_module.ChainerOptimizer(
            optimizer, hyperparameters_on_device=True,
            replayable_hooks=(optimizer_hooks.WeightDecay,))
    return GraphedOptimizer(optimizer, adapter, warmup, cupy, route_linear)
