"""Who owns which layers and points: the layer partition and the level
hierarchy (pure; no MPI, so the performance model and the tests use it
without processes).

Layers are distributed over the processes in contiguous blocks. A *point*
is a state: forward point i is u_i, computed by layer i - 1, so it lives on
the owner of layer i - 1 (point 0, the opening layer's output, on rank 0).
The adjoint runs in reversed layer order: adjoint point k is ū_{N-k},
computed by the transposed layer N - k at the state u_{N-k}, both held by
the owner of layer N - k (point 0, ū_N from the loss, on the classifier's
owner, the owner of layer N - 1). Every process thus has, for each layer it
owns, the layer's weights, its input state and (after the adjoint) its
output's adjoint: the weight gradient is local.

Level l of the hierarchy has the points j = 0 .. M_l at fine index j c^l,
with M_0 = N and M_{l+1} = floor(M_l / c); a point lives where its fine
point lives, so restriction and correction never communicate.
"""
from typing import List, Optional, Sequence

#: A level is coarsened further while it keeps at least this many steps
#: (the coarsest level is solved serially: 2 <= M_L < 2c steps).
MIN_COARSE_STEPS = 2


def layer_blocks(n_layers: int, n_procs: int, coarsening: int) -> List[range]:
    """Contiguous blocks of layers, one per process, in rank order.

    Whole coarsening intervals (c layers) are dealt out as evenly as
    possible, so that a block starts at a C-point and relaxation needs
    one message per process; a trailing partial interval goes to the last
    block. With fewer intervals than processes, the layers themselves are
    split evenly (later blocks may then be empty).
    """
    if n_procs < 1:
        raise ValueError('n_procs must be positive, not {}'.format(n_procs))
    unit = coarsening if n_layers // coarsening >= n_procs else 1
    units = n_layers // unit
    sizes = [unit * (units // n_procs + (rank < units % n_procs))
             for rank in range(n_procs)]
    sizes[-1] += n_layers - sum(sizes)
    blocks, start = [], 0
    for size in sizes:
        blocks.append(range(start, start + size))
        start += size
    return blocks


def layer_owners(blocks: Sequence[range]) -> List[int]:
    """owner[n] of every layer n."""
    return [rank for rank, block in enumerate(blocks) for _ in block]


def forward_point_owners(owners: Sequence[int]) -> List[int]:
    """Owner of forward point i = 0 .. N (u_i, made by layer i - 1)."""
    return [owners[0]] + list(owners)


def adjoint_point_owners(owners: Sequence[int]) -> List[int]:
    """Owner of adjoint point k = 0 .. N (ū_{N-k}, made by layer N - k)."""
    return [owners[-1]] + list(reversed(owners))


def level_sizes(n_layers: int, coarsening: int,
                levels: Optional[int] = None) -> List[int]:
    """Steps M_l of every level, finest first.

    ``levels=None`` coarsens while a level keeps at least
    :data:`MIN_COARSE_STEPS` steps; an explicit number of levels needs at
    least one step on the coarsest.
    """
    if coarsening < 2:
        raise ValueError('coarsening must be at least 2, not {}'.format(
            coarsening))
    sizes = [n_layers]
    if levels is None:
        while sizes[-1] // coarsening >= MIN_COARSE_STEPS:
            sizes.append(sizes[-1] // coarsening)
        return sizes
    if levels < 1:
        raise ValueError('levels must be positive, not {}'.format(levels))
    while len(sizes) < levels:
        coarse = sizes[-1] // coarsening
        if coarse < 1:
            raise ValueError(
                '{} levels with coarsening {} need at least {} layers, '
                'not {}'.format(levels, coarsening,
                                coarsening ** (levels - 1), n_layers))
        sizes.append(coarse)
    return sizes


class LevelLayout:
    """The points of one level that one process owns, and its neighbours.

    Parameters
    ----------
    steps : int
        M_l: the level has points 0 .. M_l.
    stride : int
        c^l: point j is fine point j * stride.
    fine_owners : sequence of int
        Owner of every fine point.
    rank : int
        The process this layout is for.
    coarsening : int
        c: point j is a C-point when j % c == 0.
    """

    def __init__(self, steps: int, stride: int, fine_owners: Sequence[int],
                 rank: int, coarsening: int):
        self.steps = steps
        self.stride = stride
        self.coarsening = coarsening
        self.owners = [fine_owners[j * stride] for j in range(steps + 1)]
        mine = [j for j, owner in enumerate(self.owners) if owner == rank]
        self.first = mine[0] if mine else 0
        self.last = mine[-1] if mine else -1
        self.count = len(mine)
        self.left = (self.owners[self.first - 1]
                     if self.count and self.first > 0 else None)
        self.right = (self.owners[self.last + 1]
                      if self.count and self.last < steps else None)

    def points(self) -> range:
        """The owned points, in order."""
        return range(self.first, self.last + 1)

    def is_c(self, j: int) -> bool:
        return j % self.coarsening == 0

    def fine(self, j: int) -> int:
        """Fine index of point ``j``."""
        return j * self.stride

    def owned_c_points(self) -> List[int]:
        """Owned C-points j >= 1 (point 0 is the fixed initial value)."""
        return [j for j in self.points() if j > 0 and self.is_c(j)]

    def owned_f_points(self) -> List[int]:
        return [j for j in self.points() if not self.is_c(j)]


def coarse_weight_routes(owners: Sequence[int], coarsening: int,
                         sizes: Sequence[int]) -> List[tuple]:
    """(layer, owner, process) for every layer that a process needs on a
    coarse level of the forward solve but does not own, sorted.

    The forward step into coarse point J of level l is computed by the
    owner of fine point J c^l and uses the weights of layer (J - 1) c^l
    (injection), which another process owns when a block holds fewer than
    c^l layers. (The adjoint's coarse steps use the layer at their end,
    which their process owns.)
    """
    points = forward_point_owners(owners)
    routes = set()
    for level, steps in enumerate(sizes[1:], start=1):
        stride = coarsening ** level
        for j in range(1, steps + 1):
            layer = (j - 1) * stride
            computer = points[j * stride]
            if owners[layer] != computer:
                routes.add((layer, owners[layer], computer))
    return sorted(routes)
