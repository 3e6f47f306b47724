"""The processes a K-FAC optimizer shares its factors with.

Distributed K-FAC (Algorithm 1) sums the factors over the processes, so it
needs the communicator. It gets it one of two ways:

* :func:`chainerkfac.create_multi_node_optimizer` ``(KFAC(...), comm)``
  (:func:`distribute`, before the first update);
* ChainerMN's ``chainermn.create_multi_node_optimizer(KFAC(...), comm)``,
  whose wrapper averages the gradients and calls ``update()`` of the
  optimizer it holds as ``actual_optimizer``: at the first update
  :func:`join` finds that wrapper by identity — an object that refers to
  this very optimizer as its ``actual_optimizer`` and is an instance of
  ChainerMN's wrapper class (subclasses included) — through the garbage
  collector's referrers, not the caller's frame, and takes its
  communicator (one pass over the collector's objects, once: 0.03 s in a
  process with ResNet-50 set up, 81,000 objects, on a shared 2-core CPU).

Any other way of running K-FAC in a process group of more than one
process (mpi4py's ``COMM_WORLD``, once MPI is initialised — as every
ChainerMN communicator does) is refused at the first update: the
processes would precondition with their own curvature and drift apart
with no error. ``KFAC(process_local=True)`` keeps process-local factors
on purpose (each process an independent optimizer: a single-process
reference under ``mpiexec``, or independent runs).
"""
import gc
import sys

from chainerkfac.transport import LocalTransport, MultiNodeTransport


def distribute(optimizer, comm) -> None:
    """Give ``optimizer`` (a :class:`~chainerkfac.optimizers.KFAC`) a
    :class:`~chainerkfac.transport.MultiNodeTransport` over ``comm`` and
    install ChainerMN's global except hook (one failing process ends the
    job)."""
    if optimizer.process_local:
        raise ValueError('KFAC(process_local=True) keeps process-local '
                         'factors: it cannot be made distributed')
    # Imported here: ChainerMN's communicators import mpi4py (MPI_Init),
    # which ``import chainerkfac`` must not do.
    from chainerkfac.communicators import install_except_hook
    from chainerkfac.communicators.adapter import kfac_collectives
    collectives = kfac_collectives(comm)
    install_except_hook()
    optimizer.transport = MultiNodeTransport(comm, collectives)


def world_size() -> int:
    """The number of processes of mpi4py's ``COMM_WORLD`` once MPI is
    initialised (1 before: nothing is shared then)."""
    mpi = sys.modules.get('mpi4py.MPI')
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 1
    return mpi.COMM_WORLD.Get_size()


def chainermn_wrapper(optimizer):
    """ChainerMN's multi-node wrapper that holds ``optimizer`` as its
    ``actual_optimizer`` (an instance of ``chainermn.optimizers.
    _MultiNodeOptimizer`` or of a subclass), or None.

    Raises
    ------
    ValueError
        The wrapper is ChainerMN's double-buffering one, or several
        wrappers of different communicators hold the optimizer.
    """
    module = sys.modules.get('chainermn.optimizers')
    if module is None:
        return None
    kinds = (module._MultiNodeOptimizer, module._DoubleBufferingOptimizer)
    found = []
    for referrer in gc.get_referrers(optimizer):
        if isinstance(referrer, kinds):
            found.append(referrer)
        elif isinstance(referrer, dict) and \
                referrer.get('actual_optimizer') is optimizer:
            # The wrapper's attribute dictionary once materialised
            # (``vars(wrapper)``, a copy): its owner refers to it.
            found += [owner for owner in gc.get_referrers(referrer)
                      if isinstance(owner, kinds)]
    found = [w for w in found if
             object.__getattribute__(w, 'actual_optimizer') is optimizer]
    if any(isinstance(w, module._DoubleBufferingOptimizer) for w in found):
        raise ValueError(
            'K-FAC under chainermn.create_multi_node_optimizer('
            'double_buffering=True) would precondition the previous '
            "iteration's gradients with this one's factors: use "
            'double_buffering=False')
    communicators = {id(object.__getattribute__(w, 'communicator')): w
                     for w in found}
    if len(communicators) > 1:
        raise ValueError('{} ChainerMN multi-node wrappers of different '
                         'communicators hold this K-FAC optimizer: keep '
                         'one'.format(len(communicators)))
    return found[0] if found else None


def join(optimizer, gradients_reduced) -> None:
    """Before the first step of ``optimizer``: find its communicator if it
    has none, or refuse to run process-local in a process group.

    Parameters
    ----------
    optimizer : chainerkfac.optimizers.KFAC
    gradients_reduced : bool
        The first update came without a loss function (as ChainerMN's
        wrapper calls it, after averaging the gradients).

    Raises
    ------
    RuntimeError
        No communicator is known, K-FAC is not ``process_local``, and
        mpi4py's world has more than one process.
    """
    if not isinstance(optimizer.transport, LocalTransport) or \
            optimizer.process_local:
        return
    wrapper = chainermn_wrapper(optimizer)
    if wrapper is not None:
        distribute(optimizer, object.__getattribute__(wrapper,
                                                      'communicator'))
        optimizer.gradients_reduced = gradients_reduced
        return
    size = world_size()
    if size > 1:
        raise RuntimeError(
            'K-FAC runs in a process group of {} processes (mpi4py '
            "COMM_WORLD) but knows no communicator: each process would "
            'precondition with its own factors and the processes would '
            'drift apart. Make it distributed with '
            'chainerkfac.create_multi_node_optimizer(KFAC(...), comm) (or '
            "ChainerMN's chainermn.create_multi_node_optimizer(KFAC(...), "
            'comm)), or pass KFAC(process_local=True) to keep '
            'process-local factors on purpose'.format(size))
