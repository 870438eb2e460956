"""mpitree inside Hugging Face transformers: decode with the KV cache sharded over ranks.

Importing this module registers an attention implementation named ``"mpitree"``
with transformers' ``AttentionInterface`` and its mask function with
``AttentionMaskInterface``. Every rank loads the same model and runs the same
``generate``; a :class:`ShardedCache` keeps each rank's share of the tokens, and
each attention call merges the ranks' partial (m, d, n) states with the tree
reduction, so the outputs equal one process's::

    import mpitree.adapters.transformers as mtt

    model = AutoModelForCausalLM.from_config(config, attn_implementation="mpitree")
    cache = mtt.ShardedCache(model.config)          # placement="interleave"
    mtt.prefill(model, input_ids[:, :-1], cache)    # optional: shard the prompt's work
    out = model.generate(input_ids, cache=cache, do_sample=False)

A :class:`StaticShardedCache` (``max_cache_len=``) holds the shards in buffers of fixed
capacity: with ``MPITREE_KERNEL=triton`` its decode step runs on the device with no host
read, and at one rank a CUDA graph can capture the model's decode forward.

Queries are computed on every rank (the dense layers are replicated); only the
attention over the cache is split. Under :func:`prefill` the dense work of the
prompt is split too. Without a ShardedCache (``use_cache=False``, or transformers'
own cache) every rank attends locally over the whole sequence, exactly. Importing
this module imports torch and transformers; ``import mpitree`` never does.
"""

from .._hint import missing

try:
    import torch  # noqa: F401  (the adapter needs it; the core never imports it)
except ImportError as exc:
    raise missing(__name__, "transformers", exc) from exc
try:
    import transformers
except ImportError as exc:
    raise missing(__name__, "transformers", exc) from exc

from ._attention import ShardMask, attention_interface, mask_interface
from ._cache import PLACEMENTS, ShardedCache
from ._checkpoint import default_model, load
from ._drafters import Drafter, DraftModel, PromptLookup
from ._generate import Speculation, generate
from ._prefill import prefill
from ._sampling import Sampler, sampler
from ._spec import verify
from ._static import StaticShardedCache

__all__ = [
    "PLACEMENTS",
    "DraftModel",
    "Drafter",
    "PromptLookup",
    "Sampler",
    "ShardMask",
    "ShardedCache",
    "Speculation",
    "StaticShardedCache",
    "attention_interface",
    "default_model",
    "generate",
    "load",
    "mask_interface",
    "prefill",
    "register",
    "sampler",
    "verify",
]

NAME = "mpitree"


def register():
    """Register ``"mpitree"`` with transformers' attention and mask interfaces (idempotent)."""
    transformers.AttentionInterface.register(NAME, attention_interface)
    transformers.masking_utils.AttentionMaskInterface.register(NAME, mask_interface)


register()
