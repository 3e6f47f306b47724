"""The layer partition and the level hierarchy (no processes needed)."""
import pytest

from chainerkfac.layer_parallel import partition


@pytest.mark.parametrize('n_layers,n_procs,c', [
    (2048, 512, 4), (64, 3, 4), (30, 4, 4), (13, 4, 4), (3, 4, 4), (9, 2, 2)])
def test_blocks_are_contiguous_and_cover_the_layers(n_layers, n_procs, c):
    blocks = partition.layer_blocks(n_layers, n_procs, c)
    assert len(blocks) == n_procs
    assert [n for block in blocks for n in block] == list(range(n_layers))
    sizes = [len(block) for block in blocks]
    if n_layers // c >= n_procs:
        # Whole intervals: every block but the last is a multiple of c.
        assert all(size % c == 0 for size in sizes[:-1])
        assert max(sizes[:-1]) - min(sizes) <= c
    else:
        assert max(sizes) - min(sizes) <= 1


def test_point_owners():
    owners = partition.layer_owners(partition.layer_blocks(8, 2, 4))
    assert owners == [0] * 4 + [1] * 4
    assert partition.forward_point_owners(owners) == [0] * 5 + [1] * 4
    assert partition.adjoint_point_owners(owners) == [1] * 5 + [0] * 4


def test_level_sizes():
    assert partition.level_sizes(2048, 4) == [2048, 512, 128, 32, 8, 2]
    assert partition.level_sizes(64, 4) == [64, 16, 4]
    assert partition.level_sizes(30, 4, 2) == [30, 7]
    assert partition.level_sizes(5, 4) == [5]
    with pytest.raises(ValueError, match='need at least 16 layers'):
        partition.level_sizes(15, 4, 3)


def test_level_layout():
    owners = partition.forward_point_owners(
        partition.layer_owners(partition.layer_blocks(16, 2, 4)))
    first, second = (partition.LevelLayout(4, 4, owners, rank, 4)
                     for rank in (0, 1))
    assert (first.first, first.last, first.left, first.right) == \
        (0, 2, None, 1)
    assert (second.first, second.last, second.left, second.right) == \
        (3, 4, 0, None)
    assert first.owned_c_points() == [] and second.owned_c_points() == [4]


def test_coarse_weight_routes():
    # 4 layers per process, c = 4: level 1 is local, level 2 is not.
    owners = partition.layer_owners(partition.layer_blocks(64, 16, 4))
    routes = partition.coarse_weight_routes(
        owners, 4, partition.level_sizes(64, 4))
    assert routes == [(0, 0, 3), (16, 4, 7), (32, 8, 11), (48, 12, 15)]
