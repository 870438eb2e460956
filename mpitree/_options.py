"""Option checks, the strategy names' check and the accumulation-dtype rule, each defined once."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ._registry import AUTO, REGISTRY, needs_kv, strategy_names

FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
NODE_SIZE_ENV = "MPITREE_NODE_SIZE"
_MAX_NODE_SIZE = 1 << 30
INVARIANT = "invariant"  # deterministic= value: the same bits for any rank count and placement
DEFAULT_BLOCK_SIZE = 1024  # keys per invariant leaf block: one local-kernel call each


_NAMES: dict = {}  # dtype object -> name: str() of a numpy dtype costs microseconds


def dtype_name(dtype) -> str:
    """Return the plain name of a numpy, torch, CuPy or JAX dtype ("float32", "bfloat16")."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        name = np.dtype(dtype).name if isinstance(dtype, type) else str(dtype).rsplit(".", 1)[-1]
        try:
            _NAMES[dtype] = name
        except TypeError:  # unhashable
            pass
        return name


def acc_name(dtype) -> str:
    """Return the accumulation dtype for inputs of ``dtype``: float64 stays, all else float32."""
    return "float64" if dtype_name(dtype) == "float64" else "float32"


def __getattr__(name):
    """``STRATEGIES``: :func:`~mpitree._registry.strategy_names`, read from the registry."""
    if name == "STRATEGIES":
        return strategy_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_strategy(strategy) -> str:
    """Validate a strategy name: ``"auto"`` or a registered strategy's."""
    if not isinstance(strategy, str) or (strategy != AUTO and strategy not in REGISTRY):
        raise ValueError(f"strategy must be one of {strategy_names()}, got {strategy!r}")
    return strategy


def check_flag(name, value) -> bool:
    """Validate a boolean option (Python or numpy bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_deterministic(value, invariant=False):
    """Validate ``deterministic``: True, False or, where ``invariant`` is allowed, "invariant"."""
    if isinstance(value, str) and value == INVARIANT:
        if not invariant:
            raise ValueError(
                "deterministic='invariant' is supported by tree_decode, DecodePlan and "
                "mpitree.adapters.transformers.ShardedCache"
            )
        return INVARIANT
    if not isinstance(value, (bool, np.bool_)):
        choices = "True, False or 'invariant'" if invariant else "True or False"
        raise TypeError(f"deterministic must be {choices}, got {value!r}")
    return bool(value)


def resolve_block_size(value, deterministic) -> int:
    """Return the invariant mode's keys per block (default 1024); 0 outside that mode."""
    if deterministic != INVARIANT:
        if value is not None:
            raise ValueError("block_size is only used with deterministic='invariant'")
        return 0
    if value is None:
        return DEFAULT_BLOCK_SIZE
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"block_size must be an int, got {value!r}")
    if not 0 < value <= _MAX_NODE_SIZE:
        raise ValueError(f"block_size must lie in [1, 2**30], got {value}")
    return int(value)


def resolve_scale(scale, head_dim) -> float:
    """Return the softmax scale as a finite Python float (default ``1/sqrt(D)``)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"scale must be a real number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def resolve_node_size(value=None) -> int:
    """Return the virtual node size: the argument, else ``MPITREE_NODE_SIZE``, else 0 (real)."""
    source = "node_size"
    if value is None:
        value, source = os.environ.get(NODE_SIZE_ENV, "0") or "0", NODE_SIZE_ENV
    if isinstance(value, (bool, np.bool_, float)):
        raise TypeError(f"{source} must be an integer, got {value!r}")
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be an integer, got {value!r}") from None
    if not 0 <= value <= _MAX_NODE_SIZE:
        raise ValueError(f"{source} must lie in [0, 2**30] (0: real nodes), got {value}")
    return value


@dataclass(frozen=True)
class Options:
    """The resolved options of a collective call, identical on every rank once agreed."""

    strategy: str = "auto"
    scale: float = 1.0
    deterministic: bool | str = False
    node_size: int = 0
    validate: bool = False
    block_size: int = 0

    @classmethod
    def resolve(
        cls,
        head_dim,
        strategy="auto",
        scale=None,
        deterministic=False,
        node_size=None,
        validate=False,
        *,
        block_size=None,
        invariant=False,
    ) -> Options:
        """Validate user options for head dim ``head_dim``; raise TypeError/ValueError.

        ``invariant``: whether the caller supports ``deterministic="invariant"``.
        """
        deterministic = check_deterministic(deterministic, invariant)
        strategy = check_strategy(strategy)
        if deterministic == INVARIANT and strategy != "auto":
            raise ValueError(
                "deterministic='invariant' merges over its own canonical tree: "
                f"leave strategy='auto', got {strategy!r}"
            )
        return cls(
            strategy,
            resolve_scale(scale, head_dim),
            deterministic,
            resolve_node_size(node_size),
            check_flag("validate", validate),
            resolve_block_size(block_size, deterministic),
        )

    @property
    def needs_kv(self) -> bool:
        """Whether the strategy moves keys and values between ranks, not only records (``ring``).

        An adapter that merges records alone refuses such a strategy in its checks.
        """
        return needs_kv(self.strategy)

    def signature(self) -> dict:
        """Return the fields every rank must agree on."""
        return {
            "strategy": self.strategy,
            "scale": self.scale,
            "deterministic": self.deterministic,
            "node size": self.node_size,
            "validate": self.validate,
            "block size": self.block_size,
        }
