"""Tiny random-weight causal LMs built from configs in memory (no downloads), one per family.

The one builder of the test suite: every test that needs a model calls :func:`tiny_model` (with config
overrides where it needs another size, e.g. more positions for char-level chat contexts).
"""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=211, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _config(family: str, **overrides):
    import transformers as tf

    common = {**COMMON, **overrides}
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "llama3":
        return tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "yarn":
        return tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})
    if family == "linear":
        return tf.LlamaConfig(**common, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if family == "dynamic":
        return tf.LlamaConfig(**common, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if family == "glm":
        return tf.GlmConfig(**common, head_dim=16, partial_rotary_factor=0.5)
    if family == "gemma3":
        kinds = ("sliding_attention", "full_attention")  # alternating, whatever the depth
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=24,
                                   layer_types=[kinds[i % 2] for i in range(common["num_hidden_layers"])])
    raise KeyError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "glm", "gemma3"]
ROPE_VARIANTS = ["llama3", "yarn", "linear"]


def tiny_model(family: str, seed: int = 0, attn: str = "sdpa", *, scale: float = 3.0, **config):
    """A tiny fp32 causal LM of ``family`` with seeded random weights, in eval mode.

    Args:
        family: one of :data:`FAMILIES`, :data:`ROPE_VARIANTS` or ``dynamic``.
        seed: torch seed of the weights.
        attn: attention implementation (``sdpa`` or ``eager``).
        scale: factor on every 2-D non-embedding weight (random init is small; 3.0 makes attention
            non-uniform so that drift is visible; 1.0 keeps the plain init).
        **config: config fields overriding :data:`COMMON` (e.g. ``max_position_embeddings=4096``).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(family, **config)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.mul_(scale)
    return model.eval()
