"""The merge strategies' registry: each strategy class under its name, in its declared order."""

from __future__ import annotations

AUTO = "auto"  # the name that picks a registered strategy (``_strategies.resolve``)

#: name -> strategy class, iterated in the classes' declared ``order`` (then name). Filled
#: as ``mpitree._strategies`` imports its modules; the lists of strategy names
#: (``mpitree.STRATEGIES``, ``op_needed``, the command line's tables) are read from it.
REGISTRY: dict = {}
NAME_WIDTH = 12  # the demo's first column
FLAGS = ("needs_kv", "uses_op", "persistent", "reproducible", "modelled")
BUFFERS = ("host", "pinned", "device")  # the buffer kinds' names (``mpitree._buffers``)
HOST_MEMORY = BUFFERS[:2]


def host_strategies():
    """Return the registered strategies' names that merge in host memory, in their order.

    What numpy arrays can run (the command line's tables): a strategy that merges only
    in device buffers (``buffers = ("device",)``) needs a framework's device arrays.
    """
    return tuple(name for name, cls in REGISTRY.items() if set(cls.buffers) & set(HOST_MEMORY))


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
    if len(name) > NAME_WIDTH:
        raise ValueError(f"strategy {name!r}: a name of at most {NAME_WIDTH} characters")
    if isinstance(order, bool) or not isinstance(order, int):
        raise ValueError(f"strategy {name!r}: order must be an int, got {order!r}")
    if not isinstance(summary, str) or not summary.strip() or "\n" in summary:
        raise ValueError(f"strategy {name!r}: summary must be one line, got {summary!r}")
    _check_lists(cls, name)
    REGISTRY[name] = cls
    for later in sorted(REGISTRY.values(), key=lambda c: (c.order, c.name)):
        REGISTRY[later.name] = REGISTRY.pop(later.name)  # re-appended: the dict in order
    return cls


def _check_lists(cls, name):
    """Raise ValueError unless ``cls`` declares what every generated list reads, as it needs."""
    for flag in FLAGS:
        if type(getattr(cls, flag, None)) is not bool:
            raise ValueError(f"strategy {name!r}: {flag} must be True or False")
    buffers = getattr(cls, "buffers", None)
    if not buffers or not isinstance(buffers, tuple) or not set(buffers) <= set(BUFFERS):
        raise ValueError(f"strategy {name!r}: buffers must be a tuple from {BUFFERS}")
    short, label = getattr(cls, "short", ""), getattr(cls, "label", "")
    if not isinstance(short, str) or len(short or name) > 10:
        raise ValueError(f"strategy {name!r}: short (or the name) must be at most 10 characters")
    try:
        shown = (label or name).format(nodes="real", op="native")
    except Exception:  # not a str, or a field other than {nodes}, {op}
        shown = None
    if shown is None:
        raise ValueError(f"strategy {name!r}: label must be a str naming only {{nodes}}, {{op}}")
    if len(shown) > 34:
        raise ValueError(f"strategy {name!r}: label must be at most 34 characters (merge's)")
    priority = getattr(cls, "auto_priority", None)
    if priority is not None and (type(priority) is not int):
        raise ValueError(f"strategy {name!r}: auto_priority must be an int or None")
    if priority is not None and not set(buffers) <= set(HOST_MEMORY):
        raise ValueError(  # "auto" resolves after the agreement, which agreed on host memory
            f"strategy {name!r}: one 'auto' may pick merges in host memory: buffers from "
            f"{HOST_MEMORY}"
        )
    if priority is not None and cls.needs_kv:
        raise ValueError(
            f"strategy {name!r}: one that needs keys and values cannot be picked by 'auto' "
            "(allreduce_state merges states alone)"
        )


def needs_kv(name) -> bool:
    """Whether strategy ``name`` needs keys and values, not only records (``"auto"``: no)."""
    cls = REGISTRY.get(name)
    return cls is not None and cls.needs_kv


def merging_names() -> tuple:
    """Return the names of the strategies that merge records alone, ``"auto"`` first."""
    return (AUTO, *(name for name, cls in REGISTRY.items() if not cls.needs_kv))


def strategy_names() -> tuple:
    """Return the names ``strategy=`` takes: ``"auto"``, then the registry's, in its order."""
    return (AUTO, *REGISTRY)
