"""Framework adapters for mpitree, installed as ``mpitree.adapters``.

- ``mpitree.adapters.torch``: :func:`tree_decode` for torch tensors on CPU or CUDA.
- ``mpitree.adapters.flash_attn``: local attention from ``flash_attn_with_kvcache``
  (contiguous or paged KV cache), merged by the tree.
- ``mpitree.adapters.cupy``: :func:`tree_decode` for CuPy arrays (cuBLAS local
  attention; the small per-row states are merged through the host).
- ``mpitree.adapters.jax``: :func:`tree_decode` usable inside ``jax.jit`` and
  differentiable by ``jax.grad`` (the merge is an ordered host callback).
- ``mpitree.adapters.transformers``: ``attn_implementation="mpitree"`` and a
  ``ShardedCache`` for Hugging Face models.

Each adapter is a submodule that imports its framework only when the submodule
itself is imported; ``import mpitree`` never does. The core works on numpy arrays;
adapters convert at the edge, including log-sum-exp bases (mpitree uses natural log;
see :meth:`mpitree.State.from_lse`).
"""
