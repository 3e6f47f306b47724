"""Eq. (20): which weights are rescaled to the norm √(2·d_out) after each
step.

The candidates come from the blocks (the registry is the one home of
layer-type knowledge): a block names the weight eq. (20) concerns and its
d_out (:attr:`~chainerkfac.FisherBlock.rescaled_weight`,
:attr:`~chainerkfac.FisherBlock.output_size`). ``'auto'`` keeps only the
scale-invariant ones, found from the graph of the first step
(:mod:`chainerkfac.scale_invariance`) and agreed by every process.
"""
import math
from typing import List, Sequence, Set, Tuple

import numpy

from chainerkfac import scale_invariance
from chainerkfac.fisher_blocks import registry


class WeightRescale:
    """The eq. (20) decision of one optimizer.

    Parameters
    ----------
    mode : {'auto', True, False}
        See :class:`~chainerkfac.optimizers.KFAC`'s ``weight_rescale``.
    """

    def __init__(self, mode):
        self.mode = mode
        #: Whether the rescaled set is known ('auto': after the first step).
        self.decided = False
        self._blocks: Sequence = ()

    def setup(self, blocks) -> None:
        """Take the candidates from ``blocks``; ``True`` / ``False`` decide
        now."""
        self._blocks = list(blocks)
        if self.mode is True:
            self._apply({id(w) for w, _ in self.candidates()})
        elif self.mode is False:
            self._apply(set())

    def candidates(self) -> List[Tuple[object, int]]:
        """``[(W, d_out)]`` of the weights eq. (20) may concern."""
        return [(b.rescaled_weight, int(b.output_size))
                for b in self._blocks if b.rescaled_weight is not None]

    def decide_from_graph(self, graph, agree_all) -> None:
        """'auto': rescale the candidates that are scale invariant in
        ``graph`` (the function nodes of the first step's backward passes)
        on every process (``agree_all(flags) -> flags summed over
        processes``)."""
        invariant = scale_invariance.scale_invariant_weights(
            graph, weighted=self.weighted_function_types(),
            normalizing=self.normalizing_function_types())
        candidates = self.candidates()
        flags = numpy.array([int(id(w) in invariant) for w, _ in candidates],
                            dtype=numpy.int64)
        everywhere = agree_all(flags)
        self._apply({id(w) for (w, _), ok in zip(candidates, everywhere)
                     if ok})

    def waits_for_train_mode(self, graph) -> bool:
        """Whether ``graph`` ran the normalising layers in test mode only
        (running statistics: a frozen-BN warm-up before training them):
        no step to decide 'auto' from yet."""
        test_mode = self._declared('test_mode_function_types')
        if not test_mode:
            return False
        seen = [record.function for record in graph]
        normalizing = self.normalizing_function_types()
        return any(isinstance(f, test_mode) for f in seen) and not any(
            isinstance(f, normalizing) for f in seen)

    def weighted_function_types(self) -> tuple:
        """The function types of the candidates' calls: their blocks', or,
        for a candidate on the plain gradient (a grouped convolution), the
        types of the block class registered for its link."""
        types = set()
        for block in self._blocks:
            if block.rescaled_weight is None:
                continue
            own = tuple(block.function_types)
            if not own:
                factory = registry.registered_factory(block.link)
                own = tuple(getattr(factory, 'function_types', ()))
            types.update(own)
        return tuple(types)

    def normalizing_function_types(self) -> tuple:
        """The normalising function types of the blocks and of every
        registered block class: a BatchNormalization call normalises
        whether its link got a block (MultiNodeBatchNormalization, BN
        without γ or β get the plain gradient) or not."""
        return self._declared('normalizing_function_types')

    def _declared(self, attribute: str) -> tuple:
        """The function types that ``attribute`` names in the blocks and
        in every registered block class."""
        return tuple({t for b in list(self._blocks) +
                      registry.registered_block_classes()
                      for t in getattr(b, attribute)})

    def apply(self, weights) -> None:
        """Decide now: rescale ``weights`` (of :meth:`candidates`) and no
        other (a snapshot's decision)."""
        self._apply({id(w) for w in weights})

    def _apply(self, ids: Set[int]) -> None:
        for weight, d_out in self.candidates():
            weight.update_rule.rescale_norm = (
                math.sqrt(2.0 * d_out) if id(weight) in ids else None)
        self.decided = True

    def column(self, block) -> str:
        """The registration table's eq. (20) column of ``block``."""
        weight = block.rescaled_weight
        if weight is None:
            return '-'
        if not self.decided:
            return 'auto'
        return 'yes' if weight.update_rule.rescale_norm is not None else 'no'

    def rescaled(self) -> List[object]:
        """The weights rescaled now."""
        return [w for w, _ in self.candidates()
                if w.update_rule.rescale_norm is not None]
