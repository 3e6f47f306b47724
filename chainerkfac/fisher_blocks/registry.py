"""Which Fisher block each link gets: the block registry.

Every link type K-FAC models is registered here with a *block factory*, a
callable ``factory(name, link, options) -> FisherBlock`` (a
:class:`~chainerkfac.fisher_blocks.FisherBlock` subclass is one). The
built-in Linear, Convolution2D and BatchNormalization blocks are registered
through the same table as a user's::

    chainerkfac.register_block(MyLink, MyBlock)

A link is looked up by its class and then its base classes (the most
specific registration wins). A factory may decline a particular link by
raising :class:`~chainerkfac.fisher_blocks.Unsupported` with the reason
(e.g. a grouped convolution). Links with no registration, declined links
and links matched by ``skip_layers`` get the plain gradient
(:class:`~chainerkfac.fisher_blocks.PlainBlock`), with the reason in the
registration table.
"""
import re
import sys
import warnings
from typing import Callable, Dict, Iterable, List, Tuple

from chainerkfac.fisher_blocks.base import (BlockOptions, FisherBlock,
                                            PlainBlock, Unsupported)

BlockFactory = Callable[[str, object, BlockOptions], FisherBlock]

_REGISTRY: Dict[type, BlockFactory] = {}
_LOGIT_FUNCTIONS: List[type] = []


def register_block(link_class: type, block_factory: BlockFactory) -> None:
    """Make links of ``link_class`` (and its subclasses, unless they have a
    registration of their own) get the block ``block_factory`` builds.

    Parameters
    ----------
    link_class : type
        A :class:`chainer.Link` subclass.
    block_factory : callable
        ``block_factory(name, link, options)`` returns a
        :class:`~chainerkfac.fisher_blocks.FisherBlock` for the link named
        ``name`` (its path in the model), or raises
        :class:`~chainerkfac.fisher_blocks.Unsupported`; ``options`` is a
        :class:`~chainerkfac.fisher_blocks.BlockOptions`. A registration
        replaces an earlier one for the same class. Use
        :func:`plain_gradient` to register a type as unpreconditioned.
    """
    if not isinstance(link_class, type):
        raise TypeError('register_block takes a link class, got {!r}'.format(
            link_class))
    if not callable(block_factory):
        raise TypeError('register_block: the block factory for {} is not '
                        'callable: {!r}'.format(link_class.__name__,
                                                block_factory))
    _REGISTRY[link_class] = block_factory


def register_logits_function(function_type: type) -> None:
    """Make calls of ``function_type`` (a FunctionNode class whose first
    input is the logits of a categorical model: softmax, log-softmax,
    softmax cross-entropy) mark the logits that ``fisher='mc'`` and
    ``fisher='exact'`` take their extra backward passes from."""
    if not isinstance(function_type, type):
        raise TypeError('register_logits_function takes a FunctionNode '
                        'class, got {!r}'.format(function_type))
    if function_type not in _LOGIT_FUNCTIONS:
        _LOGIT_FUNCTIONS.append(function_type)


def logits_functions() -> tuple:
    """The registered logits-consuming function types."""
    return tuple(_LOGIT_FUNCTIONS)


def plain_gradient(reason: str) -> BlockFactory:
    """A block factory that declines every link with ``reason``."""
    def factory(name, link, options):
        raise Unsupported(reason)
    return factory


def _register_chainermn() -> None:
    """ChainerMN's MultiNodeBatchNormalization gets the BN block, unless a
    registration for it exists: its function is Chainer's
    BatchNormalization with the statistics of every process (registered
    once ChainerMN's links are imported: ``import chainerkfac`` does not
    import ChainerMN)."""
    module = sys.modules.get('chainermn.links.batch_normalization')
    link_class = getattr(module, 'MultiNodeBatchNormalization', None)
    if link_class is not None and link_class not in _REGISTRY:
        from chainerkfac.fisher_blocks.batch_norm import \
            BatchNormalizationBlock
        _REGISTRY[link_class] = BatchNormalizationBlock


def registered_factory(link):
    """The factory registered for ``link``'s class or nearest base class,
    or None."""
    _register_chainermn()
    for cls in type(link).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def registered_block_classes() -> List[type]:
    """The :class:`~chainerkfac.fisher_blocks.FisherBlock` subclasses
    registered as factories (a factory function is not one): their class
    attributes say which functions they model whatever blocks a model
    builds."""
    return [factory for factory in _REGISTRY.values()
            if isinstance(factory, type) and issubclass(factory, FisherBlock)]


def block_for(name: str, link, options: BlockOptions) -> FisherBlock:
    """The block of ``link``: its registered block, or a plain one with the
    reason."""
    own = own_params(link)
    factory = registered_factory(link)
    if factory is None:
        return PlainBlock(name, link, options, own, 'no Fisher block for {}'
                          .format(type(link).__name__))
    try:
        return factory(name, link, options)
    except Unsupported as why:
        return PlainBlock(name, link, options, own, str(why),
                          rescaled_weight=why.rescaled_weight,
                          output_size=why.output_size)


def own_params(link) -> List:
    """A link's own parameters (not those of its children), by name."""
    return [getattr(link, n) for n in sorted(link._params)]


def build_blocks(target, options: BlockOptions = None, skip_layers=()
                 ) -> List[FisherBlock]:
    """One block per link of ``target`` that has parameters, in model order.

    Every parameter belongs to exactly one block: a link placed twice in
    the model has one block (which sees every call); a parameter of two
    links (tied weights) belongs to the first link's block, and the
    second link's other parameters get the plain gradient (with a
    warning).

    Parameters
    ----------
    target : chainer.Link
    options : BlockOptions
    skip_layers : iterable
        Link names (``'/predictor/fc'``; the leading ``/`` may be left out),
        regular expressions (strings or compiled, matched against the whole
        name) or link classes; matched links get the plain gradient.

    Returns
    -------
    list of FisherBlock
    """
    options = options or BlockOptions()
    matchers = skip_matchers(skip_layers)
    blocks = []
    links = set()       # a link placed twice (Sequential(l, F.relu, l))
    owners = {}         # id(parameter) -> the block that holds it
    for name, link in target.namedlinks():
        own = own_params(link)
        if not own or id(link) in links:
            # once: its one block sees every call (two blocks updated its
            # parameters twice, one of them with the plain gradient)
            continue
        links.add(id(link))
        tied = [p for p in own if id(p) in owners]
        if tied:
            # a parameter of another link too (tied weights): one update,
            # by its first block; this link's Kronecker factors would hold
            # only its own use of it
            free = [p for p in own if id(p) not in owners]
            where = sorted({owners[id(p)] for p in tied})
            warnings.warn(
                'KFAC: {} shares {} with {} (tied weights): {} the plain '
                'gradient; the shared parameter is updated once, as {}'
                .format(name, ', '.join(p.name for p in tied),
                        ', '.join(where),
                        'its other parameters take' if free else
                        'it takes', ' and '.join(where)))
            if free:
                block = PlainBlock(name, link, options, free,
                                   'shares {} with {}'.format(
                                       ', '.join(p.name for p in tied),
                                       ', '.join(where)))
                blocks.append(block)
                owners.update((id(p), name) for p in free)
            continue
        skipped = [text for text, match in matchers if match(name, link)]
        if skipped:
            blocks.append(PlainBlock(name, link, options, own,
                                     'skipped (skip_layers: {})'.format(
                                         skipped[0])))
            owners.update((id(p), name) for p in own)
            continue
        block = block_for(name, link, options)
        if sorted(map(id, block.params)) != sorted(map(id, own)):
            raise ValueError(
                'the block {} built for {} ({}) does not hold exactly the '
                "link's own parameters {}".format(
                    type(block).__name__, name, type(link).__name__,
                    sorted(link._params)))
        blocks.append(block)
        owners.update((id(p), name) for p in own)
    return blocks


def skip_matchers(skip_layers: Iterable) -> List[Tuple[str, Callable]]:
    """``[(description, match(name, link))]`` for ``skip_layers``."""
    if isinstance(skip_layers, (str, type, re.Pattern)):
        skip_layers = [skip_layers]
    try:
        skip_layers = list(skip_layers)
    except TypeError:
        raise TypeError('skip_layers takes a link name, a regular '
                        'expression, a link class or a sequence of them '
                        '(None or () for none), got {!r}'.format(
                            skip_layers)) from None
    matchers = []
    for item in skip_layers:
        if isinstance(item, type):
            matchers.append((item.__name__,
                             lambda name, link, cls=item:
                             isinstance(link, cls)))
        elif isinstance(item, (str, re.Pattern)):
            pattern = re.compile(item) if isinstance(item, str) else item

            def match(name, link, text=item, pattern=pattern):
                bare = name.lstrip('/')
                return (name == text or bare == text or
                        pattern.fullmatch(name) is not None or
                        pattern.fullmatch(bare) is not None)
            matchers.append((item if isinstance(item, str)
                             else item.pattern, match))
        else:
            raise TypeError('skip_layers takes link names, regular '
                            'expressions or link classes, got {!r}'.format(
                                item))
    return matchers
