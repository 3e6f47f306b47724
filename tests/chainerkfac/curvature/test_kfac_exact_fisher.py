"""``KFAC(fisher='exact')``: the optimizer's factors against the dense GGN
of a two-layer net and against ``curvature``'s ``kflr`` factors.

The optimizer keeps K-FAC's conventions: ``A`` with the bias column, ``G``
averaged over the batch (and, for a convolution, over output positions as
in KFC). For a Linear layer these are BackPACK's ``kflr_A`` (bordered by
the bias column) and ``kflr_B`` exactly; for a convolution ``G`` is
``kflr_B`` with ``conv_factors='kfc'``.
"""
import numpy

import chainer.functions as F

from chainerkfac import curvature
from tests.chainerkfac import helpers
from tests.chainerkfac.curvature import nets, oracles


def exact_factors(model, x, t):
    optimizer = helpers.kfac(fisher='exact', lr=0.0, momentum=0.0)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    return {block.name: {n: helpers.dense(f) for n, f in
                         block.factors.items()}
            for block in optimizer.blocks}


def augmented_ggn(model, x, link):
    """The exact GGN block of ``[W | b]`` of ``link``, row-major."""
    start, offset = {}, 0
    for path, p in oracles.params_of(model):
        start[path] = offset
        offset += p.size
    out, inp = link.W.shape
    weight, bias = start['/{}/W'.format(link.name)], \
        start['/{}/b'.format(link.name)]
    index = []
    for o in range(out):
        index += [weight + o * inp + i for i in range(inp)] + [bias + o]
    return oracles.ggn(model, x)[numpy.ix_(index, index)]


def test_batch_of_one_kron_of_factors_is_the_layers_exact_ggn():
    model = helpers.MLP(sizes=(5, 4, 3))
    rng = numpy.random.RandomState(7)
    x, t = rng.randn(1, 5), numpy.array([2], numpy.int32)
    factors = exact_factors(model, x, t)
    for link in (model.l1, model.l2):
        f = factors['/' + link.name]
        numpy.testing.assert_allclose(
            numpy.kron(f['G'], f['A']), augmented_ggn(model, x, link),
            rtol=1e-9, atol=1e-14, err_msg=link.name)


def test_batch_g_is_the_definition_and_kflr_b():
    model = helpers.MLP(sizes=(5, 4, 3))
    rng = numpy.random.RandomState(8)
    x, t = rng.randn(6, 5), rng.randint(0, 3, 6).astype(numpy.int32)
    factors = exact_factors(model, x, t)
    kflr = curvature.extract(model, x, t, quantities=('kflr',))
    hessians = oracles.softmax_hessians(model(x).array)

    def first(v):
        z = model.l1(v)
        return z, model.l2(F.tanh(z))

    def second(v):
        z = model.l2(F.tanh(model.l1(v)))
        return z, z

    for name, wrt in (('l1', first), ('l2', second)):
        jac = oracles.jacobians(model, x, wrt)            # (n, C, n, h)
        jac = numpy.array([jac[i, :, i] for i in range(len(x))])
        expected = numpy.einsum('nci,ncd,ndj->ij', jac, hessians,
                                jac) / len(x)
        f = factors['/' + name]
        q = kflr['/{}/W'.format(name)]
        numpy.testing.assert_allclose(f['G'], expected, rtol=1e-9,
                                      atol=1e-14, err_msg=name)
        numpy.testing.assert_allclose(f['G'], q['kflr_B'], rtol=1e-9,
                                      atol=1e-14, err_msg=name)
        numpy.testing.assert_allclose(f['A'][:-1, :-1], q['kflr_A'],
                                      rtol=1e-12, err_msg=name)


def test_convolution_g_is_kflr_b_in_kfc_convention():
    model = nets.ConvPool(stride=2)
    x, t = nets.data(n=4)
    factors = exact_factors(model, x, t)['/conv']
    kfc = curvature.extract(model, x, t, quantities=('kflr',),
                            conv_factors='kfc')['/conv/W']
    numpy.testing.assert_allclose(factors['G'], kfc['kflr_B'], rtol=1e-9,
                                  atol=1e-14)
    numpy.testing.assert_allclose(factors['A'][:-1, :-1], kfc['kflr_A'],
                                  rtol=1e-12)
    # BackPACK's factor is not KFC's times the positions (it sums the
    # pull-backs over positions before the outer product).
    backpack = curvature.extract(model, x, t, quantities=('kflr',))
    positions = 2 * 2
    assert not numpy.allclose(factors['G'] * positions,
                              backpack['/conv/W']['kflr_B'])
