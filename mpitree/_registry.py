"""The merge strategies' registry: each strategy class under its name, in its declared order."""

from __future__ import annotations

AUTO = "auto"  # the name that picks a registered strategy (``_strategies.resolve``)

#: name -> strategy class, iterated in the classes' declared ``order`` (then name). Filled
#: as ``mpitree._strategies`` imports its modules; the lists of strategy names
#: (``mpitree.STRATEGIES``, ``op_needed``, the command line's tables) are read from it.
REGISTRY: dict = {}


def register(cls):
    """Add a strategy class to :data:`REGISTRY` under its ``name``, in its ``order``.

    Parameters
    ----------
    cls : type
        A :class:`~mpitree._strategies.Strategy` subclass with a new ``name``, an
        int ``order`` and a one-line ``summary``.

    Returns
    -------
    type
        ``cls`` itself (a class decorator).

    Raises
    ------
    ValueError
        A name that is empty, ``"auto"`` or taken; an ``order`` not an int; a
        summary that is empty or more than one line.
    """
    name, order, summary = cls.name, cls.order, cls.summary
    if not isinstance(name, str) or not name or name == AUTO or name in REGISTRY:
        raise ValueError(f"a strategy needs a name not 'auto' nor taken, got {name!r}")
    if isinstance(order, bool) or not isinstance(order, int):
        raise ValueError(f"strategy {name!r}: order must be an int, got {order!r}")
    if not isinstance(summary, str) or not summary.strip() or "\n" in summary:
        raise ValueError(f"strategy {name!r}: summary must be one line, got {summary!r}")
    REGISTRY[name] = cls
    for later in sorted(REGISTRY.values(), key=lambda c: (c.order, c.name)):
        REGISTRY[later.name] = REGISTRY.pop(later.name)  # re-appended: the dict in order
    return cls


def strategy_names() -> tuple:
    """Return the names ``strategy=`` takes: ``"auto"``, then the registry's, in its order."""
    return (AUTO, *REGISTRY)
