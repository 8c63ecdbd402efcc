"""SegmentEncoder against its oracle: the tokenizer's own ids of the whole text, on conversations edited the
way agents edit them, for byte-level BPE, SentencePiece-style (Metaspace, prepend "first") and char-level
tokenizers built in memory; a tokenizer whose added tokens strip whitespace turns the memo off. Also: the
char-level chat tokenizer of the tiny models (:func:`benchmarks.tiny.tiny_chat_tokenizer`) round-trips
chat text inside their vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from patchkv_agent.core.encoding import SegmentEncoder
from benchmarks.tiny import tiny_chat_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]
CORPUS = ["The agent called the tool and got a JSON result: {\"city\": \"Sofia\", \"temp\": 12}.",
          "  indented code:\n\tdef f(x):\n\t\treturn x + 1\n", "naïve café — 12345 ünïcode ok", "[cleared]",
          "Tool result offloaded to /tmp/results/call_7.json (preview: 3 rows)", "Summary: the user asked twice."]
WORDS = (" ".join(CORPUS) + " <tool_call> ").split(" ")


def _wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def bytelevel_bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _wrap(core)


def metaspace_bpe() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    core.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS]))
    return _wrap(core)


TOKENIZERS = {"bytelevel": bytelevel_bpe, "metaspace": metaspace_bpe, "char": tiny_chat_tokenizer}


def _conversation(rng: np.random.Generator, n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a careful agent."}]
    for i in range(n):
        k = int(rng.integers(0, 40))
        content = " ".join(rng.choice(WORDS, size=k)) if k else ""
        if rng.random() < 0.2:
            content = " " + content  # pieces that start with a space
        msgs.append({"role": ("user", "assistant", "tool")[i % 3], "content": content})
    return msgs


def _edits(rng: np.random.Generator, msgs: list[dict]):
    """The shapes agents' editors make: clear a tool result, offload one, summarize the head, append."""
    m = [dict(x) for x in msgs]
    i = int(rng.integers(1, len(m)))
    m[i]["content"] = "[cleared]"
    yield m
    m = m + [{"role": "tool", "content": "Tool result offloaded to /tmp/results/call_9.json"}]
    yield m
    yield [m[0], {"role": "user", "content": "Summary: " + " ".join(rng.choice(WORDS, size=12))}] + m[-3:]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("seed", range(6))
def test_segmented_ids_equal_the_whole_texts_on_edited_conversations(kind, seed):
    tok = TOKENIZERS[kind]()
    enc = SegmentEncoder(tok)
    assert enc.reason is None, enc.reason
    rng = np.random.default_rng(seed)
    base = _conversation(rng, int(rng.integers(1, 12)))
    for msgs in [base, *_edits(rng, base)]:
        for gen in (True, False):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            want = tok(text, add_special_tokens=False)["input_ids"]
            assert enc.encode(text).tolist() == want
    # raw texts: specials anywhere (adjacent, leading, trailing), pieces of one character, empty text
    for text in ("", "<|im_start|>", "<|im_end|><|im_start|>x", " a<tool_call>b ", "x" * 3 + "<|im_end|>",
                 "<|im_start|>user\n<|im_end|>\n<|im_start|>", "\n\n"):
        assert enc.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"], text
    assert enc.hits > 0  # the unchanged messages were served from the memo


def test_memo_is_bounded_and_exact_when_evicting():
    tok = bytelevel_bpe()
    enc = SegmentEncoder(tok, max_tokens=64)
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = tok.apply_chat_template(_conversation(rng, 8), tokenize=False, add_generation_prompt=True)
        assert enc.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert enc.cached_tokens <= 64
    enc.clear()
    assert enc.cached_tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SegmentEncoder(tok, max_tokens=-1)
    assert SegmentEncoder(tok, max_tokens=0).reason == "max_tokens=0"


def test_returned_ids_are_the_callers_to_change():
    tok = bytelevel_bpe()
    enc = SegmentEncoder(tok)
    text = tok.apply_chat_template(_conversation(np.random.default_rng(1), 4), tokenize=False)
    first = enc.encode(text)
    first[:] = 0  # a caller writing into its ids never changes the memo
    assert enc.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(TypeError, match="str"):
        enc.encode(b"bytes")


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_added_tokens_that_strip_turn_the_memo_off_and_stay_exact(flag):
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    core.add_special_tokens([AddedToken("<mask>", **{flag: True})])
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    enc = SegmentEncoder(tok)
    assert enc.reason is not None and flag in enc.reason
    for text in ("a <mask> b", " <mask>x", "plain"):
        assert enc.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"]


def test_a_slow_or_foreign_tokenizer_is_tokenized_whole():
    class Plain:  # not a fast tokenizer: one id per character
        def __call__(self, text, add_special_tokens=False):
            if isinstance(text, list):
                return {"input_ids": [[ord(c) for c in t] for t in text]}
            return {"input_ids": [ord(c) for c in text]}

    enc = SegmentEncoder(Plain())
    assert enc.reason == "not a fast tokenizer"
    assert enc.encode("héllo").tolist() == [ord(c) for c in "héllo"]


def test_engine_encode_uses_the_memo_and_matches_the_tokenizer():
    from benchmarks.tiny import tiny_engine

    eng = tiny_engine(chat_template=CHATML)
    msgs = _conversation(np.random.default_rng(2), 6)
    text = eng.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert eng.encode(msgs) == eng.tokenizer(text, add_special_tokens=False)["input_ids"]
    before = eng.encoder.hits
    eng.encode(msgs[:-1] + [{"role": "tool", "content": "[cleared]"}])
    assert eng.encoder.hits > before
    other = bytelevel_bpe()
    eng.tokenizer = other  # the memo follows the tokenizer
    assert eng.encoder.tokenizer is other


def test_a_piece_the_tokenizer_does_not_cut_turns_the_memo_off_not_the_call():
    tok = bytelevel_bpe()
    enc = SegmentEncoder(tok)
    text = tok.apply_chat_template(_conversation(np.random.default_rng(3), 3), tokenize=False)
    enc._anchor = ("zz", enc._anchor[1])  # as if the anchor were not an added token: its id never leads
    assert enc.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert enc.reason is not None and "segmentation failed" in enc.reason and enc.cached_tokens == 0


def test_tiny_tokenizer_round_trips_chat_text():
    tok = tiny_chat_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi  there\n{\"a\": 1}"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < 211 and tok.eos_token_id == 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi  there\n{\"a\": 1}\nassistant\n"
