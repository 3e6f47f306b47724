"""K-FAC across the layer-parallel grid: data × layers × Fisher blocks.

:func:`setup_kfac` sets a :class:`chainerkfac.optimizers.KFAC` up for
layer-parallel training of a :class:`.ResidualODE`:

* **blocks by layer ownership** — every process has Fisher blocks for the
  links it owns (:meth:`.MGRIT.owned_params`: its residual layers, the
  opening layer on the first process, the classifier on the last); the
  others are left to their owners (``skip_layers``: no factors, never
  updated here);
* **factors from MGRIT's finest level** — K-FAC's capture
  (:mod:`chainerkfac.capture`) sees every owned layer's call when
  :meth:`.MGRIT.backward` forms its weight gradient
  (:meth:`.ResidualODE.accumulate_layer_grad`): ``A`` from the layer's
  input, the forward state ``u_n``; ``G`` from the gradient w.r.t. its
  output ``K_n u_n + b_n``, ``h σ' ⊙ ū_{n+1}`` from the adjoint state; the
  opening layer and the classifier are Chainer calls as usual;
* **process-local otherwise** — with one replica each process's optimizer
  holds its own layers' blocks alone (``process_local``: nothing to share);
* **one bounded step** — with ``kl_clip`` (K-FAC's default), ν is the
  bound over the whole network: each process's sum over its layers'
  blocks (and its replicas) is summed over the layer groups in rank order
  (:attr:`chainerkfac.step_bound.StepBound.sum_across`), so every layer
  scales by the same ν as in serial training;
* **data replicas** — with a :class:`.ProcessGrid` of several replicas the
  optimizer is distributed over the grid's data group
  (:func:`chainerkfac.create_multi_node_optimizer` on a ChainerMN
  communicator of the processes that own the same layers): gradients and
  factors are summed over the replicas (each replica's loss is the mean
  over its equal share, so the average is the global batch's) and the
  blocks are spread over the replicas for inversion, Algorithm 1 within
  each data group.

Only the empirical Fisher (``fisher='emp'``): the Monte-Carlo and exact
Fisher run extra backward passes from the logits through Chainer's graph,
which MGRIT does not build through the layers.
"""
import functools
import math

import numpy

from chainerkfac.optimizers.kfac import KFAC


_EMP_ONLY = (
    "layer-parallel K-FAC supports fisher='emp' only, not {!r}: the "
    'Monte-Carlo and exact Fisher take extra backward passes from the '
    "logits through Chainer's graph, which MGRIT does not build through "
    'the layers')


def setup_kfac(optimizer: KFAC, mgrit, grid=None,
               communicator: str = 'naive', wire_dtype=None) -> KFAC:
    """Set ``optimizer`` up on ``mgrit.net`` for the links this process
    owns; distributed over ``grid``'s data replicas when it has several.

    Parameters
    ----------
    optimizer : KFAC
        Not set up yet, ``fisher='emp'``.
    mgrit : chainerkfac.layer_parallel.MGRIT
    grid : ProcessGrid, optional
        ``mgrit`` runs on ``grid.layer_comm`` (checked, a collective of
        the grid's processes: a ``ValueError`` on all of them otherwise).
    communicator : str
        The kind of ChainerMN communicator over the data group
        (:func:`chainerkfac.create_communicator`: ``'naive'`` on the CPU,
        ``'pure_nccl'`` or ``'host_staged'`` for CuPy arrays).
    wire_dtype : dtype, optional
        Of the factors on the wire; by default the parameters' (K-FAC's
        float32 would round a float64 network's factors).

    Returns
    -------
    KFAC
        ``optimizer``, set up.
    """
    if not isinstance(optimizer, KFAC):
        raise TypeError('setup_kfac takes a chainerkfac.optimizers.KFAC, '
                        'not {}'.format(type(optimizer).__name__))
    if optimizer.target is not None:
        raise ValueError('setup_kfac sets the optimizer up on the owned '
                         'layers: pass it before optimizer.setup')
    if optimizer.fisher != 'emp':
        raise ValueError(_EMP_ONLY.format(optimizer.fisher))
    if grid is not None:
        grid.check_layer_group(mgrit)
    net = mgrit.net
    owned = {name for name, _ in mgrit.owned_links()}
    others = [name for rank in range(mgrit.transport.size)
              for name, _ in mgrit.owned_links(rank) if name not in owned]
    optimizer.skip_layers = tuple(_as_tuple(optimizer.skip_layers)) + \
        tuple(others)
    optimizer.setup(net)
    optimizer.fisher_only = ('emp', _EMP_ONLY)    # also set later
    if grid is None or grid.n_replicas == 1:
        # Every process's blocks are its own layers': its factors are
        # process-local by design, whatever the number of processes.
        optimizer.process_local = True
    else:
        from chainerkfac import communicators
        from chainerkfac.multi_node_optimizer import \
            create_multi_node_optimizer
        dtype = numpy.dtype(wire_dtype or net.opening.W.dtype)
        comm = communicators.create_communicator(
            communicator, mpi_comm=grid.data_comm.comm,
            wire_dtype=dtype.name)
        create_multi_node_optimizer(optimizer, comm)
    layers = mgrit.transport
    if layers.size > 1:
        # every bound's, also one set later (optimizer.kl_clip = ...)
        optimizer.bound_sum_across = functools.partial(_sum_in_rank_order,
                                                       layers)
        if optimizer.step_bound is not None:
            optimizer.step_bound.sum_across = optimizer.bound_sum_across
    return optimizer


def _sum_in_rank_order(transport, value: float) -> float:
    """``value`` summed over ``transport``'s processes in rank order (the
    same float on every process)."""
    return math.fsum(transport.allgather(float(value)))


def replicas_reduced(optimizer, grid) -> bool:
    """Whether ``optimizer`` averages the gradients over ``grid``'s
    replicas itself (a K-FAC distributed over its data group); raise for a
    K-FAC whose processes are not the grid's replicas."""
    if not isinstance(optimizer, KFAC) or grid is None:
        return False
    size = optimizer.transport.size
    if size != grid.n_replicas:
        raise ValueError(
            'K-FAC runs on {} process(es) but the grid has {} data '
            'replicas: set it up with chainerkfac.layer_parallel.setup_kfac'
            '(optimizer, mgrit, grid)'.format(size, grid.n_replicas))
    return size > 1


def _as_tuple(skip_layers):
    if isinstance(skip_layers, (list, tuple)):
        return skip_layers
    return (skip_layers,) if skip_layers else ()
