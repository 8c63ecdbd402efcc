"""Shared helpers of the LangGraph tests: a character-level tokenizer with a ChatML template, built in
memory (no downloads), and a tiny random llama with room for char-level contexts."""

from __future__ import annotations

import functools

import pytest
import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TOOLS = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                "<|im_end|>\n{% endif %}" + CHATML)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread (and do not stall on shared, busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_chat_tokenizer(template: str = CHATML):
    """Char-level fast tokenizer: ids 0-4 special (``<|im_end|>`` = 2 = EOS), then newline, tab and
    printable ASCII (102 ids, inside the tiny models' vocabulary of 211)."""
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


@functools.lru_cache(maxsize=None)
def tiny_llama(seed: int = 0):
    """The tiny llama of ``tiny_models`` with 4096 positions (char-level contexts run ~1k tokens)."""
    from tiny_models import tiny_model

    return tiny_model("llama", seed, max_position_embeddings=4096)


def tiny_engine(template: str = CHATML, **kwargs):
    """A :class:`PatchKVEngine` over :func:`tiny_llama` and :func:`tiny_chat_tokenizer` (small blocks)."""
    from patchkv_agent import PatchKVEngine

    opts = dict(block_size=16, dirty_window=16)
    opts.update(kwargs)
    return PatchKVEngine(tiny_llama(), tiny_chat_tokenizer(template), **opts)


def test_tiny_tokenizer_round_trips_chat_text():
    tok = tiny_chat_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi  there\n{\"a\": 1}"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < 211 and tok.eos_token_id == 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi  there\n{\"a\": 1}\nassistant\n"
