"""The incremental detokenizer on a small byte-level BPE tokenizer trained here."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from workers.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TRAINING_TEXT = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "héllo again, wörld! 日本語の文章です 🙂🙂",
    "STOP here; stop there. END of the story",
]
# Characters never seen in training: they fall back to one token per byte, so a
# character is split over two to four tokens.
MULTI_BYTE_TEXTS = [
    "héllo wörld 日本語 🙂",
    "中文字符 and ✨ sparkles, ñandú, Ω≈ç√ 🚀🚀 done",
    "𝄞 music 𝄞𝄞 — «quotes» 日本語の文章です",
]
PROMPT_TEXT = "the quick brown fox "


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into consecutive chunks of the given sizes (cycled), none empty."""
    out, i, j = [], 0, 0
    while i < len(ids):
        size = max(1, sizes[j % len(sizes)]) if sizes else 1
        out.append(ids[i:i + size])
        i += size
        j += 1
    return out


def run(tokenizer: Any, prompt: list[int], output_chunks: list[list[int]], stop: list[str],
        ) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    deltas = []
    for chunk in output_chunks:
        delta, matched = detok.add_tokens(chunk)
        deltas.append(delta)
        if matched is not None:
            break
    else:
        deltas.append(detok.flush())
    return detok, deltas


def test_tokens_split_characters(tokenizer: Any) -> None:
    # The premise of the other tests: some tokens carry only part of a character.
    ids = tokenizer.encode(MULTI_BYTE_TEXTS[1])
    assert any(REPLACEMENT_CHAR in decode(tokenizer, [i]) for i in ids)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_one_token_at_a_time_rebuilds_the_text(tokenizer: Any, text: str) -> None:
    prompt = tokenizer.encode(PROMPT_TEXT)
    ids = tokenizer.encode(text)
    detok, deltas = run(tokenizer, prompt, [[i] for i in ids], [])
    assert "".join(deltas) == decode(tokenizer, ids) == text
    assert detok.output_text == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    # Text flows as it completes: only a split character is ever waiting.
    assert sum(1 for d in deltas if d) > len(text.split()) // 2


@settings(max_examples=60, deadline=None)
@given(text_index=st.integers(0, len(MULTI_BYTE_TEXTS) - 1),
       sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_any_split_rebuilds_the_text(tokenizer: Any, text_index: int, sizes: list[int]) -> None:
    text = MULTI_BYTE_TEXTS[text_index]
    ids = tokenizer.encode(text)
    _, deltas = run(tokenizer, tokenizer.encode(PROMPT_TEXT), chunks(ids, sizes), [])
    assert "".join(deltas) == decode(tokenizer, ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_stop_string_spanning_tokens(tokenizer: Any) -> None:
    text = "héllo wörld 日本語 🙂 and more after it"
    ids = tokenizer.encode(text)
    for stop in ("語 🙂", "wörld 日", " and m"):
        detok, deltas = run(tokenizer, [], [[i] for i in ids], [stop, "never there"])
        before = text[: text.index(stop)]
        assert detok.matched_stop == stop
        assert "".join(deltas) == detok.output_text == before
        assert detok.finished
        # Tokens after the stop are ignored.
        assert detok.add_tokens(ids[:2]) == ("", None)
        assert detok.flush() == ""
        assert detok.output_text == before


def test_stop_string_inside_one_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("the quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, [], ["quick"])
    delta, matched = detok.add_tokens(ids)
    assert (delta, matched) == ("the ", "quick")


def test_first_ending_stop_wins_whatever_the_split(tokenizer: Any) -> None:
    ids = tokenizer.encode("xx abcdef yy")
    for output_chunks in ([ids], [[i] for i in ids]):
        detok, deltas = run(tokenizer, [], output_chunks, ["abcdef", "cd", "de"])
        assert detok.matched_stop == "cd"
        assert "".join(deltas) == "xx ab"


def test_stop_prefix_is_held_then_released(tokenizer: Any) -> None:
    stop = "wörld!"
    ids = tokenizer.encode("héllo wörld again")
    detok = IncrementalDetokenizer(tokenizer, [], [stop])
    seen = ""
    held_at_some_point = False
    for n, i in enumerate(ids, start=1):
        delta, matched = detok.add_tokens([i])
        assert matched is None
        seen += delta
        # What is held back is exactly the longest tail that could still become the stop.
        so_far = decode(tokenizer, ids[:n])
        hold = max((k for k in range(1, len(stop)) if so_far.endswith(stop[:k])), default=0)
        assert seen == so_far[: len(so_far) - hold]
        held_at_some_point |= hold >= len("wörld")
    assert held_at_some_point
    assert seen == "héllo wörld again"
    # A prefix still open at the end of generation is released by flush.
    ids = tokenizer.encode("héllo wör")
    detok, deltas = run(tokenizer, [], [[i] for i in ids], ["wörld!"])
    assert deltas[-1].endswith("wör")
    assert "".join(deltas) == "héllo wör"
    assert detok.matched_stop is None


def test_flush_drops_an_incomplete_final_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok ✨")
    partial = ids[:-1]  # the last byte of ✨ is missing
    assert decode(tokenizer, partial).endswith(REPLACEMENT_CHAR)
    detok, deltas = run(tokenizer, [], [[i] for i in partial], [])
    assert "".join(deltas) == detok.output_text == "ok "


def test_decodes_only_a_short_window(tokenizer: Any) -> None:
    lengths: list[int] = []

    class CountingBackend:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            lengths.append(len(ids))
            return tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    class CountingTokenizer:
        backend_tokenizer = CountingBackend()

    ids = tokenizer.encode(" ".join(MULTI_BYTE_TEXTS) * 10)
    detok = IncrementalDetokenizer(CountingTokenizer(), tokenizer.encode(PROMPT_TEXT * 10), [])
    for i in ids:
        detok.add_tokens([i])
    detok.flush()
    assert detok.output_text == decode(tokenizer, ids)
    assert len(ids) > 500 and max(lengths) <= 12


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_tokens_and_stops_match_a_reference(tokenizer: Any, data: st.DataObject) -> None:
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), label="sizes")
    # Everything the stream ever lets through: the whole text minus an incomplete end.
    full = decode(tokenizer, ids).rstrip(REPLACEMENT_CHAR)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(0, 3), label="num_stops")):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            end = data.draw(st.integers(start + 1, min(len(full), start + 6)))
            stops.append(full[start:end])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=4)))
    detok, deltas = run(tokenizer, tokenizer.encode(PROMPT_TEXT), chunks(ids, sizes), stops)

    # Reference: the stop occurrence that ends first (ties: starts first) cuts the text.
    matches = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    if matches:
        _, start, stop = min(matches, key=lambda m: m[:2])
        assert detok.matched_stop == stop
        assert detok.output_text == full[:start]
    else:
        assert detok.matched_stop is None
        assert detok.output_text == full
    assert "".join(deltas) == detok.output_text
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_random_split_points_match_a_reference(tokenizer: Any) -> None:
    # The same check without hypothesis' shrinking, over longer outputs.
    rng = random.Random(5)
    text = " ".join(MULTI_BYTE_TEXTS)
    ids = tokenizer.encode(text)
    for _ in range(30):
        sizes = [rng.randint(1, 7) for _ in range(rng.randint(1, 5))]
        _, deltas = run(tokenizer, [], chunks(ids, sizes), [])
        assert "".join(deltas) == text


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style: Metaspace pieces, byte-fallback tokens <0xNN>, the decoder strips the
    leading space of the first piece."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base.train_from_iterator(TRAINING_TEXT * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False))
    spec = json.loads(base.to_str())["model"]
    vocab = spec["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_sentencepiece_style_leading_spaces_and_byte_fallback() -> None:
    sp = sentencepiece_style_tokenizer()
    prompt = sp.encode(PROMPT_TEXT.strip())
    assert any(token.startswith("<0x") for token in sp.tokenize(MULTI_BYTE_TEXTS[1]))
    for text in MULTI_BYTE_TEXTS:
        ids = sp.encode(text)
        # After a prompt, the first piece's space is part of the continuation.
        _, deltas = run(sp, prompt, [[i] for i in ids], [])
        assert "".join(deltas) == decode(sp, prompt + ids)[len(decode(sp, prompt)):]
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        # Without a prompt the text is the plain decode of the output.
        _, deltas = run(sp, [], [[i] for i in ids], [])
        assert "".join(deltas) == decode(sp, ids) == text
