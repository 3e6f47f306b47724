"""Layers × data: a 2-D grid of processes.

The communicator is split into *layer groups* of ``layer_procs``
processes, each holding one replica of the network with its layers
distributed (MGRIT runs on the group), and *data groups*: the processes
that own the same layers in every replica, over which the gradients of
those layers are averaged. Rank r is layer rank r mod ``layer_procs`` of
replica r div ``layer_procs``.
"""
import numpy

from chainerkfac.layer_parallel.transport import agree_on_weights
from chainerkfac.layer_parallel.transport import transport_for


class ProcessGrid:
    """``layer_procs`` × (size / ``layer_procs``) processes.

    Parameters
    ----------
    comm : None, mpi4py or ChainerMN communicator
        All processes.
    layer_procs : int
        Processes per layer group (a divisor of the communicator's size).

    Attributes
    ----------
    layer_comm, data_comm : transport
        Pass ``layer_comm`` to :class:`.MGRIT`; ``data_comm`` averages the
        gradients (:meth:`allreduce_grads`).
    replica : int
        Which data replica (layer group) this process belongs to.
    n_replicas : int
    """

    def __init__(self, comm, layer_procs: int):
        world = transport_for(comm)
        if isinstance(layer_procs, bool) or not isinstance(
                layer_procs, (int, numpy.integer)):
            raise ValueError('layer_procs must be an integer (processes a '
                             'layer group), not {!r}'.format(layer_procs))
        if layer_procs < 1 or world.size % layer_procs:
            raise ValueError('layer_procs={} does not divide the {} '
                             'processes'.format(layer_procs, world.size))
        self.replica = world.rank // layer_procs
        self.n_replicas = world.size // layer_procs
        self.layer_procs = int(layer_procs)
        layer_rank = world.rank % layer_procs
        self.layer_comm = world.split(color=self.replica, key=layer_rank)
        self.data_comm = world.split(color=layer_rank, key=self.replica)
        self._world = world

    def check_layer_group(self, mgrit) -> None:
        """Raise unless ``mgrit`` runs on this grid's layer group (built
        with ``comm=grid.layer_comm``), on every process at once: an MGRIT
        of the whole communicator, or of another split, owns other layers
        than the replicas average, and their first collective would hang
        or abort with ``MPI_ERR_TRUNCATE``. A collective of all the grid's
        processes: call it where all of them do (the trainings do, at
        construction).

        Raises
        ------
        ValueError
            On every process, where any process's MGRIT is on another
            group.
        """
        mine = mgrit.transport
        group = self.layer_comm
        if mine.size != group.size or mine.rank != group.rank:
            same = False
        elif mine.size == 1:
            same = True
        else:
            from mpi4py import MPI
            same = mine.comm.Compare(group.comm) in (MPI.IDENT,
                                                     MPI.CONGRUENT)
        verdicts = self._world.allgather((same, mine.size))
        if not all(ok for ok, _ in verdicts):
            sizes = sorted({size for _, size in verdicts})
            raise ValueError(
                'the MGRIT is not on the grid\'s layer group: it runs on '
                '{} process(es), the grid\'s layer groups have '
                'layer_procs={} (of {} replica(s)); build it with '
                'MGRIT(net, comm=grid.layer_comm)'.format(
                    '/'.join(str(size) for size in sizes), self.layer_procs,
                    self.n_replicas))

    def local_batch(self, *arrays):
        """This replica's equal share of every array of the global batch."""
        size = len(arrays[0])
        if size % self.n_replicas:
            raise ValueError('a global batch of {} does not split into {} '
                             'equal replicas'.format(size, self.n_replicas))
        share = size // self.n_replicas
        part = slice(self.replica * share, (self.replica + 1) * share)
        return tuple(array[part] for array in arrays)

    def agree_on_weights(self, mgrit) -> bool:
        """Give every replica the weights of replica 0 wherever they
        differ (networks built with different seeds): data-parallel
        replicas must start equal. Returns whether they differed.
        ``mgrit`` must be on the layer group (:meth:`check_layer_group`,
        checked first)."""
        self.check_layer_group(mgrit)
        return agree_on_weights(self.data_comm, mgrit.net)

    def allreduce_grads(self, mgrit) -> None:
        """Average the gradients of ``mgrit``'s owned parameters over the
        replicas: each replica's loss is the mean over its equal share, so
        the average is the gradient of the global batch's mean loss."""
        if self.n_replicas == 1:
            return
        params = [param for _, param in mgrit.owned_params()]
        if not params:
            return
        xp = mgrit.net.xp
        flat = xp.concatenate([param.grad.ravel() for param in params])
        self.data_comm.allreduce_sum(flat)
        flat /= self.n_replicas
        offset = 0
        for param in params:
            size = param.grad.size
            param.grad[...] = flat[offset:offset + size].reshape(
                param.grad.shape)
            offset += size

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the replicas."""
        return sum(self.data_comm.allgather(value)) / self.n_replicas
