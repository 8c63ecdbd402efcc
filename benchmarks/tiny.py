"""Tiny random-weight causal LMs and engines built from configs in memory (no downloads): the one factory.

The test suite, the load tests (:mod:`.stress`, :mod:`.faults`, ``patchkv-agent stress``) and the host
benchmark (:mod:`.host_bench`) build their models here:

- :func:`tiny_config`: the config of one family (:data:`FAMILIES`, :data:`ROPE_VARIANTS` or ``dynamic``),
  :data:`COMMON` sizes unless overridden;
- :func:`tiny_model`: that config with seeded random weights (scaled so that attention is non-uniform);
- :func:`tiny_chat_tokenizer`: a character-level tokenizer with a chat template (ChatML by default) whose
  ids fit the tiny vocabulary, for the LangGraph / chat-model paths;
- :func:`tiny_engine`: a :class:`~patchkv_agent.engine.PatchKVEngine` over both (small blocks, built-in
  settings unless told otherwise).

Knows the engine and transformers' config classes; nothing about stores, benchmarks or LangGraph.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["COMMON", "FAMILIES", "ROPE_VARIANTS", "CHATML", "CHATML_TOOLS", "tiny_config", "tiny_model",
           "tiny_chat_tokenizer", "tiny_engine"]

COMMON = dict(vocab_size=211, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
"""The sizes every family shares unless overridden: vocabulary 211, 2 layers, 4 heads, 2 KV heads."""

FAMILIES = ["llama", "qwen2", "qwen3", "glm", "gemma3"]
ROPE_VARIANTS = ["llama3", "yarn", "linear"]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TOOLS = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                "<|im_end|>\n{% endif %}" + CHATML)

# family -> (config class name, family-specific fields); overrides win over both
_FAMILY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "yarn": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}}),
    "linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "dynamic": ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "glm": ("GlmConfig", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 24}),
}


def _sizes(layers: int | None, heads: int | None, kv_heads: int | None, head_dim: int | None,
           max_positions: int | None) -> dict[str, int]:
    named = {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "head_dim": head_dim, "max_position_embeddings": max_positions}
    return {k: v for k, v in named.items() if v is not None}


def tiny_config(family: str = "llama", **overrides):
    """The transformers config of a tiny ``family`` model: :data:`COMMON`, the family's fields, ``overrides``.

    Args:
        family: one of :data:`FAMILIES`, :data:`ROPE_VARIANTS` or ``dynamic``.
        **overrides: config fields (e.g. ``max_position_embeddings=4096``; ``pad_token_id=None``).

    Returns:
        The config (gemma3: sliding and full attention layers alternate, whatever the depth).

    Raises:
        KeyError: an unknown family.
    """
    import transformers as tf

    cls, extra = _FAMILY[family]
    fields = {**COMMON, **extra, **overrides}
    if family == "gemma3" and "layer_types" not in overrides:
        kinds = ("sliding_attention", "full_attention")
        fields["layer_types"] = [kinds[i % 2] for i in range(fields["num_hidden_layers"])]
    return getattr(tf, cls)(**fields)


def tiny_model(family: str = "llama", seed: int = 0, attn: str = "sdpa", *, scale: float = 3.0,
               layers: int | None = None, heads: int | None = None, kv_heads: int | None = None,
               head_dim: int | None = None, max_positions: int | None = None, device: str | None = None,
               **config):
    """A tiny fp32 causal LM of ``family`` with seeded random weights, in eval mode.

    Args:
        family: one of :data:`FAMILIES`, :data:`ROPE_VARIANTS` or ``dynamic``.
        seed: torch seed of the weights.
        attn: attention implementation (``sdpa`` or ``eager``).
        scale: factor on every 2-D non-embedding weight (random init is small; 3.0 makes attention
            non-uniform so that drift is visible; 1.0 keeps the plain init).
        layers, heads, kv_heads, head_dim, max_positions: the config's ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``
            (None: :data:`COMMON` / the family's).
        device: where the model goes (None: CPU).
        **config: more config fields overriding :data:`COMMON` (e.g. ``vocab_size=128``).

    Returns:
        The model.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **{**config, **_sizes(layers, heads, kv_heads, head_dim, max_positions)})
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.mul_(scale)
    if device is not None:
        model = model.to(device)
    return model.eval()


def tiny_chat_tokenizer(template: str = CHATML):
    """Char-level fast tokenizer: ids 0-4 special (``<|im_end|>`` = 2 = EOS), then newline, tab and
    printable ASCII (102 ids, inside the tiny models' vocabulary of 211), with ``template`` as its chat
    template (:data:`CHATML`, :data:`CHATML_TOOLS` or any other)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
    chars = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = template
    return tok


def tiny_engine(family: str = "llama", seed: int = 0, *, attn: str = "sdpa", scale: float = 3.0,
                layers: int | None = None, heads: int | None = None, kv_heads: int | None = None,
                head_dim: int | None = None, max_positions: int | None = None, device: str | None = None,
                config: Mapping[str, Any] | None = None, model=None, tokenizer=None, chat_template: str | None = None,
                block_size: int | None = 8, dirty_window: int | None = 8, profile: dict | str | None = None,
                **engine):
    """A :class:`~patchkv_agent.engine.PatchKVEngine` over a :func:`tiny_model` (no download).

    Args:
        family, seed, attn, scale, layers, heads, kv_heads, head_dim, max_positions, device: the model's
            (:func:`tiny_model`).
        config: more config fields of the model (e.g. ``{"vocab_size": 4096}``).
        model: an existing model instead (then the model arguments above are not used).
        tokenizer: the engine's tokenizer (default None: token ids only) ...
        chat_template: ... or a :func:`tiny_chat_tokenizer` with this template.
        block_size, dirty_window, profile: the engine's (default: 8-token blocks and window, built-in
            settings; None / ``"auto"`` give the engine's own defaults).
        **engine: more :class:`~patchkv_agent.engine.PatchKVEngine` keywords.

    Returns:
        The engine.

    Raises:
        ValueError: both ``tokenizer`` and ``chat_template``.
    """
    from patchkv_agent.engine import PatchKVEngine

    if tokenizer is not None and chat_template is not None:
        raise ValueError("pass a tokenizer or a chat_template, not both")
    if model is None:
        model = tiny_model(family, seed, attn, scale=scale, layers=layers, heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim, max_positions=max_positions, device=device, **dict(config or {}))
    if chat_template is not None:
        tokenizer = tiny_chat_tokenizer(chat_template)
    return PatchKVEngine(model, tokenizer, block_size=block_size, dirty_window=dirty_window, profile=profile, **engine)
