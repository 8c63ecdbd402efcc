"""The char-level chat tokenizer of the LangGraph tests (:func:`patchkv_agent.eval.tiny.tiny_chat_tokenizer`,
built in memory, no downloads) round-trips chat text inside the tiny models' vocabulary."""

from __future__ import annotations

from patchkv_agent.eval.tiny import tiny_chat_tokenizer


def test_tiny_tokenizer_round_trips_chat_text():
    tok = tiny_chat_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi  there\n{\"a\": 1}"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < 211 and tok.eos_token_id == 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi  there\n{\"a\": 1}\nassistant\n"
