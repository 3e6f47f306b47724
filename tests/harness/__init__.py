"""Tests of the harness; :class:`OneProcess` is the communicator surface
the harness uses (rank, size, ``mpi_comm.allgather``,
``multi_node_mean_grad``), for one process."""


class OneProcess:
    """The communicator surface the harness uses, for one process."""
    rank, size = 0, 1

    class mpi_comm:
        @staticmethod
        def allgather(value):
            return [value]

    @staticmethod
    def multi_node_mean_grad(model):
        pass
