"""Tiny random-weight transformers models for the tests (torch and transformers needed)."""

import copy

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


def tiny_mistral(window):
    """:func:`tiny_llama`'s shapes as a Mistral with a sliding window of ``window`` tokens."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=window,
    )
    return transformers.MistralForCausalLM(cfg).eval()


def prompt(length, padded, batch=2):
    """Prompt, the same on every rank; row 1 left-padded by 5 when ``padded``."""
    ids = torch.from_numpy(np.random.default_rng(length).integers(1, VOCAB, (batch, length)))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    return ids, mask


def greedy(model, ids, mask, cache, new_tokens):
    """Greedy ``generate`` of ``new_tokens`` tokens, with its per-step logits."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


def positions(mask):
    """generate's position rule: count real tokens; padding at position 0."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def float64_logits(model, sequences, mask, prompt_len):
    """Teacher-forced float64 logits at every generated step.

    sdpa, not eager: float64 eager turns left-padded rows into NaN (its additive
    mask ``finfo.min`` plus a negative score overflows to -inf on fully masked rows).
    """
    m64 = copy.deepcopy(model).double()
    m64.set_attn_implementation("sdpa")
    full = None
    if mask is not None:
        full = torch.cat([mask, torch.ones_like(sequences[:, prompt_len:])], 1)
    with torch.no_grad():
        logits = m64(sequences, attention_mask=full).logits
    return logits[:, prompt_len - 1 : -1]
