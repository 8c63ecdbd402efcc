"""Tiny random-weight causal LMs built from configs in memory (no downloads), one per family."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=211, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _config(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**COMMON)
    if family == "llama3":
        return tf.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "yarn":
        return tf.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})
    if family == "linear":
        return tf.LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if family == "dynamic":
        return tf.LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    if family == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16)
    if family == "glm":
        return tf.GlmConfig(**COMMON, head_dim=16, partial_rotary_factor=0.5)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=24,
                                   layer_types=["sliding_attention", "full_attention"])
    raise KeyError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "glm", "gemma3"]
ROPE_VARIANTS = ["llama3", "yarn", "linear"]


def tiny_model(family: str, seed: int = 0, attn: str = "sdpa"):
    """A tiny fp32 causal LM of ``family`` with seeded random weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(family)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    # Random init is small; scale weights up so attention is not uniform and drift is visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(3.0)
    return model.eval()
