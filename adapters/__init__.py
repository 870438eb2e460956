"""Framework adapters for mpitree, installed as ``mpitree.adapters``.

Each adapter is a submodule that imports its framework (torch, CuPy, flash-attn)
only when the submodule itself is imported; ``import mpitree`` never does.
The core works on numpy arrays; adapters convert at the edge, including log-sum-exp
bases (mpitree uses natural log; see :meth:`mpitree.State.from_lse`).
"""
