"""Stages 3 and 6: how gradients, factors and preconditioned gradients
travel between processes.

:class:`LocalTransport` is the single-process case (nothing travels, this
process owns every block). The multi-process transport (ReduceScatterV /
AllGatherV over a ChainerMN communicator) lives in
:mod:`chainerkfac.multi_node_optimizer` and has the same methods.
"""
from typing import Dict, List, Sequence


class LocalTransport:
    """One process: every block is owned here and nothing is sent."""

    rank = 0
    size = 1

    def setup(self, optimizer) -> None:
        """Called once the blocks exist (at the first update)."""

    def owns(self, block) -> bool:
        return True

    def reduce_scatter(self, blocks: Sequence, grads: Dict[object, List],
                       factors: Dict[object, Dict]):
        """Return (grads, factors) summed over processes for owned blocks,
        averaged over the global batch."""
        return grads, factors

    def all_gather(self, blocks: Sequence, directions: Dict[object, List]
                   ) -> Dict[object, List]:
        """Give every process the preconditioned gradients of all blocks."""
        return directions

    def agree(self, flag: bool) -> bool:
        """A boolean that holds on every process (logical and)."""
        return flag
