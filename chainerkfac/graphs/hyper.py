"""Hyperparameters in device memory, so that a replayed step reads the
values of its own step.

A kernel launched with a host float holds that float: a CUDA graph that
captured it replays the learning rate of the captured step for ever (or
must be captured again whenever a schedule moves it, every iteration for
K-FAC's eq. 17). :class:`DeviceScalars` keeps named values in one small
array per dtype on the device; :meth:`DeviceScalars.write` rewrites them in
place before each step (a fill per value on the current stream: no copy
from host memory), and the kernels take 0-d views of that array as their
scalar arguments (:mod:`chainerkfac.fused` accepts them). A view of
``dtype`` holds the host value rounded to ``dtype``, as a host float
passed to a kernel of that dtype is: the replayed and eager steps compute
the same numbers.

:func:`bind_rule_hyperparameters` gives Chainer update rules such views
for ``lr`` and ``momentum`` (the rule's own :class:`chainer.Hyperparameter`
overrides its optimizer's); their kernels (Chainer's MomentumSGD and SGD,
K-FAC's :class:`~chainerkfac.optimizers.update_rule.KFACRule`) then read
the device values. The optimizer's own hyperparameters stay host floats,
set by schedules as before and written to the device by the step's
adapter.
"""
from typing import Dict, Iterable, Sequence, Tuple

import numpy

import chainer
from chainer.backend import get_array_module


class DeviceScalars:
    """Named scalars in device memory, one array per dtype.

    Parameters
    ----------
    names : sequence of str
        The values held (fixed: the arrays are made once).
    device : chainer.backend.Device
        Where they live (a CPU device: NumPy arrays, the tests' twin).
    """

    def __init__(self, names: Sequence[str], device):
        self.names = tuple(names)
        self.device = device
        self._index = {name: i for i, name in enumerate(self.names)}
        self._arrays: Dict[numpy.dtype, object] = {}
        self._views: Dict[Tuple[str, numpy.dtype], object] = {}
        self._values: Dict[str, float] = {}

    def view(self, name: str, dtype):
        """The 0-d view of ``name`` in ``dtype`` (the same object at every
        call; the array of a dtype is made at its first call, outside a
        capture; :meth:`write` fills it)."""
        dtype = numpy.dtype(dtype)
        key = (name, dtype)
        if key not in self._views:
            array = self._arrays.get(dtype)
            if array is None:
                with chainer.using_device(self.device):
                    array = self.device.xp.zeros(len(self.names), dtype)
                self._arrays[dtype] = array
                for known, value in self._values.items():
                    self._fill(array, known, value)
            i = self._index[name]
            self._views[key] = array[i:i + 1].reshape(())
        return self._views[key]

    def holds(self, value) -> bool:
        """Whether ``value`` is one of the views :meth:`view` gave."""
        return any(value is view for view in self._views.values())

    def write(self, values: Dict[str, float]) -> None:
        """Set the named values (host floats) in every dtype, in place."""
        for name, value in values.items():
            value = float(value)
            self._values[name] = value
            for array in self._arrays.values():
                self._fill(array, name, value)

    def _fill(self, array, name, value) -> None:
        i = self._index[name]
        if get_array_module(array) is numpy:
            array[i] = array.dtype.type(value)
        else:
            array[i:i + 1].fill(value)   # a kernel, stream-ordered

    def arrays(self) -> Tuple:
        """The arrays holding the values, one per dtype."""
        return tuple(self._arrays.values())


def update_dtype(param) -> numpy.dtype:
    """The dtype in which a parameter's update rule computes: float32 for
    a float16 parameter whose rule has ``use_fp32_update()`` (Chainer
    updates a float32 copy and casts it back), else the parameter's. The
    rule's kernel takes its hyperparameters in this dtype."""
    rule = param.update_rule
    if getattr(rule, '_use_fp32_update', False) and \
            param.dtype == numpy.float16:
        return numpy.dtype(numpy.float32)
    return numpy.dtype(param.dtype)


def bind_rule_hyperparameters(params: Iterable, scalars: DeviceScalars,
                              names: Sequence[str]) -> None:
    """Give the update rule of each of ``params`` the device views of
    ``names`` in the dtype its kernel computes in (:func:`update_dtype`),
    as its own hyperparameters. A rule bound already keeps its views. A
    value the rule has of its own (``param.update_rule.hyperparam.lr =
    ...``: a layer's own learning rate), set before its first binding or
    since (in place of its view), stays: the optimizer's view would
    replace it (it did, silently); a host value the captured kernels
    bake, and a change of it captures again (:func:`chainerkfac.graphs.
    step.baked_hyperparameters`). The rule's ``device_hyperparameters``
    names the views it holds (``device_hyperparameter_views``: each
    view by name)."""
    by_dtype = {}
    for param in params:
        rule, dtype = param.update_rule, update_dtype(param)
        bound = by_dtype.get(dtype)
        if bound is None:
            bound = by_dtype[dtype] = [(name, scalars.view(name, dtype))
                                       for name in names]
        own = rule.hyperparam.__dict__
        views = dict(getattr(rule, 'device_hyperparameter_views', {}))
        for name, view in bound:
            if name in own and _own_value(own[name], views.get(name),
                                          scalars):
                views.pop(name, None)
                continue        # the parameter's own value
            if own.get(name) is not view:
                setattr(rule.hyperparam, name, view)
            views[name] = view
        rule.device_hyperparameter_views = views
        # which of the rule's own hyperparameters are the optimizer's, on
        # the device (not values of the parameter's own:
        # chainerkfac.step_bound.own_lr)
        rule.device_hyperparameters = frozenset(views)


def _own_value(value, given, scalars: DeviceScalars) -> bool:
    """Whether a rule's hyperparameter ``value`` is the parameter's own:
    set by the user (before the rule's first binding, or since, in place
    of the view it was given: a float, a NumPy scalar or array), not a
    view of ``scalars`` nor ``given``, the view an earlier binding gave
    the rule (another graph's)."""
    return not (scalars.holds(value) or value is given)
