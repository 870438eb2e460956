"""Tiny random-weight transformers models for the tests (torch and transformers needed)."""

import numpy as np
import torch
import transformers

VOCAB = 97


def tiny_llama(layers=2):
    """A random Llama with GQA (4 q heads, 2 kv heads), identical on every rank."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def prompt(length, padded, batch=2):
    """Prompt, the same on every rank; row 1 left-padded by 5 when ``padded``."""
    ids = torch.from_numpy(np.random.default_rng(length).integers(1, VOCAB, (batch, length)))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    return ids, mask


def positions(mask):
    """generate's position rule: count real tokens; padding at position 0."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
