"""Who computes what: which process inverts and preconditions each block.

Stages 4-5 of the paper are model parallel: each Fisher block is assigned to
an *owner* process, which receives the block's reduced gradients and factors
(ReduceScatterV), inverts the factors and preconditions the gradients, and
sends the result to everyone (AllGatherV). :class:`Assignment` decides the
owners from a cost model and needs no MPI, so it is tested on its own.

The cost of a block is :meth:`FisherBlock.inverse_cost
<chainerkfac.fisher_blocks.FisherBlock.inverse_cost>`: ``n³`` per ``n×n``
factor (Cholesky), ``(2C)³`` for a full BN Fisher, ``2C`` for a diagonal one,
the parameter count for blocks without curvature. Blocks are placed by
*longest processing time first* (LPT): heaviest block first, each onto the
least-loaded process, which keeps the heaviest load within
``(4/3 − 1/(3P))`` of the optimum and within ``average + heaviest block``.

With fewer K-FAC blocks than processes, the K-FAC blocks are owned
redundantly (round robin over the processes, heaviest blocks first) so that
no process idles in stage 4: every owner inverts the block, the first owner
sends its direction in the all-gather.
"""
import heapq
from typing import List, Optional, Sequence, Tuple


class Assignment:
    """Owner processes of each block.

    Parameters
    ----------
    costs : sequence of float
        Per block, its cost (non-negative; arbitrary units).
    size : int
        Number of processes.
    names : sequence of str, optional
        Per block, a name for :meth:`describe` (default: the index).
    curvature : sequence of bool, optional
        Per block, whether it is a K-FAC block (has factors to invert). Only
        these are computed redundantly when there are fewer of them than
        processes. Default: every block is.

    Attributes
    ----------
    owners : tuple of tuple of int
        Per block, its owner ranks; the first one sends the block's
        preconditioned gradient in the all-gather.
    loads : tuple of float
        Per rank, the summed cost of the blocks it owns.
    """

    def __init__(self, costs: Sequence[float], size: int,
                 names: Optional[Sequence[str]] = None,
                 curvature: Optional[Sequence[bool]] = None):
        if size < 1:
            raise ValueError('size must be >= 1, got {}'.format(size))
        self.costs = tuple(float(c) for c in costs)
        if any(c < 0 for c in self.costs):
            raise ValueError('block costs must be non-negative')
        n = len(self.costs)
        self.size = int(size)
        self.names = (tuple(str(i) for i in range(n)) if names is None
                      else tuple(names))
        self.curvature = ((True,) * n if curvature is None
                          else tuple(bool(c) for c in curvature))
        if not len(self.names) == len(self.curvature) == n:
            raise ValueError('costs, names and curvature need one entry per '
                             'block')
        owners: List[Tuple[int, ...]] = [()] * n
        loads = [0.0] * self.size
        kfac = [i for i in range(n) if self.curvature[i]]
        if 0 < len(kfac) < self.size:
            # Round robin, heaviest first: block k of the sorted list goes
            # to ranks k, k + L, k + 2L, ... so every rank owns one.
            for k, i in enumerate(self._heaviest_first(kfac)):
                owners[i] = tuple(range(k, self.size, len(kfac)))
                for r in owners[i]:
                    loads[r] += self.costs[i]
            rest = [i for i in range(n) if not self.curvature[i]]
        else:
            rest = list(range(n))
        # LPT: heaviest first onto the least-loaded rank (lowest rank on
        # ties, so the result is deterministic).
        heap = [(loads[r], r) for r in range(self.size)]
        heapq.heapify(heap)
        for i in self._heaviest_first(rest):
            load, r = heapq.heappop(heap)
            owners[i] = (r,)
            loads[r] = load + self.costs[i]
            heapq.heappush(heap, (loads[r], r))
        self.owners = tuple(owners)
        self.loads = tuple(loads)

    @classmethod
    def from_blocks(cls, blocks: Sequence, size: int) -> 'Assignment':
        """Assign Fisher blocks by their ``inverse_cost()``."""
        return cls([b.inverse_cost() for b in blocks], size,
                   names=[b.name for b in blocks],
                   curvature=[bool(b.factor_names) for b in blocks])

    def _heaviest_first(self, indices):
        return sorted(indices, key=lambda i: (-self.costs[i], i))

    def blocks_of(self, rank: int) -> List[int]:
        """Indices of the blocks ``rank`` owns, in model order."""
        return [i for i, o in enumerate(self.owners) if rank in o]

    def owns(self, rank: int, index: int) -> bool:
        return rank in self.owners[index]

    @property
    def redundant(self) -> List[int]:
        """Indices of the blocks owned by more than one rank."""
        return [i for i, o in enumerate(self.owners) if len(o) > 1]

    def describe(self) -> str:
        """Rank → blocks and share of the total cost, for the start-up log.

        Shares are of the summed cost of all blocks, so with redundant
        blocks they add up to more than 100 %.
        """
        total = sum(self.costs) or 1.0
        mean = sum(self.loads) / self.size
        lines = ['K-FAC assignment of {} blocks to {} processes (cost: '
                 'n^3 per n x n factor)'.format(len(self.costs), self.size)]
        for rank in range(self.size):
            mine = self.blocks_of(rank)
            lines.append('rank {}: {:5.1f}% of cost, {} blocks: {}'.format(
                rank, 100.0 * self.loads[rank] / total, len(mine),
                ', '.join(self.names[i] for i in mine) or '-'))
        if self.redundant:
            lines.append('computed redundantly (fewer K-FAC blocks than '
                         'processes): ' + ', '.join(
                             '{} on ranks {}'.format(
                                 self.names[i],
                                 ','.join(map(str, self.owners[i])))
                             for i in self.redundant))
        if mean > 0:
            lines.append('heaviest rank / mean: {:.2f}'.format(
                max(self.loads) / mean))
        return '\n'.join(lines)
