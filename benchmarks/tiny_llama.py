"""The random-weight Llama that the per-layer decode benchmarks run (one definition).

Imported by ``decode_overhead.py`` and ``layer_cost.py``; it imports no mpitree, so
``layer_cost.py`` can time any tree with it.
"""

from __future__ import annotations

import torch
import transformers


def tiny_llama(layers, context, positions):
    """Return ``(config, model, ids)``: a Llama decoder and a ``context``-token prompt.

    Parameters
    ----------
    layers : int
        Decoder layers.
    context : int
        Prompt tokens.
    positions : int
        ``max_position_embeddings``: the prompt and every step to come.

    Returns
    -------
    config : transformers.LlamaConfig
        Hidden 256, MLP 512, 8 query and 2 KV heads of D = 32, vocabulary 1024.
    model : transformers.LlamaForCausalLM
        float32, eval mode, weights from seed 0.
    ids : torch.Tensor
        ``(1, context)`` int64 token ids from seed 1.
    """
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=positions,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 1024, (1, context), generator=torch.Generator().manual_seed(1))
    return cfg, model, ids
