"""Incremental detokenization (`phyai_ray.llm.detok`) and the OpenAI edge's streamed text (`ChoiceText`).

Run: .venv/bin/pytest tests/test_detok.py -q

The concatenated deltas of a stream equal the whole decode, for random byte strings (a UTF-8
decoder with replacement: characters split across tokens, invalid bytes) and for the test
checkpoints' byte-level BPE tokenizer (random ids, multilingual text with emoji, pushes of one
token and of several). The tokens decoded in all stay linear in the completion's length: before,
every push decoded the whole completion again (n^2 / 2 tokens for n pushes).
"""

from __future__ import annotations

import random

import pytest

from phyai_ray.llm.detok import Detokenizer
from phyai_ray.serve.protocols.openai.text import ChoiceText, cut_at_stop

TEXTS = ["€ voilà — 日本語 “quotes” fox 🤖🦾 and 한국어 👩‍👩‍👧 done", "plain ascii words, nothing else",
         "🙂" * 40, "日本語の文章" * 20 + " end"]


class Counting:
    """A decode function that counts the tokens it was given."""

    def __init__(self, decode) -> None:
        self.inner, self.tokens, self.calls = decode, 0, 0

    def __call__(self, ids) -> str:
        self.tokens += len(ids)
        self.calls += 1
        return self.inner(ids)


def byte_decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream(decode, ids: list[int], sizes: list[int]) -> list[str]:
    """Push `ids` in chunks of the given sizes (cycled), the last push final."""
    text, pieces, i = Detokenizer(decode), [], 0
    while i < len(ids):
        n = sizes[len(pieces) % len(sizes)]
        pieces.append(text.push(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    return pieces


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    pytest.importorskip("transformers")
    from phyai_ray.llm.tokenizer import TextCodec
    from tests.hf_checkpoints import write_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return TextCodec.open(folder)


@pytest.mark.parametrize("sizes", [[1], [3], [1, 2, 5]])
def test_valid_utf8_bytes_stream_to_the_whole_text_and_never_show_half_a_character(sizes) -> None:
    for text in TEXTS:
        ids = list(text.encode())
        pieces = stream(byte_decode, ids, sizes)
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_random_bytes_with_invalid_sequences_stream_to_the_whole_decode() -> None:
    rng = random.Random(0)
    alphabet = list(range(0x20, 0x7F)) + [0x80, 0xBF, 0xC3, 0xE2, 0xE6, 0xF0, 0x9F, 0xFF]
    for trial in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 60))]
        sizes = [rng.randint(1, 4) for _ in range(3)]
        assert "".join(stream(byte_decode, ids, sizes)) == byte_decode(ids), (trial, ids, sizes)


def test_the_tokens_decoded_in_all_grow_linearly_even_through_bytes_that_never_complete() -> None:
    for ids in (list(("ab€日🙂" * 400).encode()), [0xE2] * 3000, [0xF0, 0x9F] * 1500):
        decode = Counting(byte_decode)
        assert "".join(stream(decode, ids, [1])) == byte_decode(ids)
        assert decode.tokens <= 8 * len(ids), (decode.tokens, len(ids))


def test_the_checkpoint_tokenizer_streams_text_and_random_ids_as_its_whole_decode(codec) -> None:
    rng = random.Random(1)
    cases = [codec.encode(t, special=False) for t in TEXTS]
    cases += [[rng.randrange(codec.vocab_size) for _ in range(rng.randint(1, 80))] for _ in range(200)]
    for ids in cases:
        for sizes in ([1], [rng.randint(1, 5), rng.randint(1, 5)]):
            decode = Counting(codec.decode)
            pieces = stream(decode, ids, sizes)
            assert "".join(pieces) == codec.decode(ids), (ids, sizes, pieces)
            assert decode.tokens <= 8 * len(ids) + 8
    for text, ids in zip(TEXTS, cases):
        assert codec.decode(ids) == text and not any("\ufffd" in p for p in stream(codec.decode, ids, [1]))


def test_a_long_completion_decodes_a_linear_number_of_tokens_where_the_whole_decode_was_quadratic(codec) -> None:
    ids = codec.encode("🤖 robots fold laundry — 日本語 " * 150, special=False)
    decode = Counting(codec.decode)
    assert "".join(stream(decode, ids, [1])) == codec.decode(ids)
    quadratic = len(ids) * (len(ids) + 1) // 2  # what decoding the whole list per push cost
    assert len(ids) > 1000 and decode.tokens <= 6 * len(ids) < quadratic // 100


def test_streamed_choices_cut_at_the_first_stop_string_as_the_whole_text_does(codec) -> None:
    rng = random.Random(2)
    for text in TEXTS * 5:
        ids = codec.encode(text, special=False)
        start = rng.randrange(len(text) - 3)
        stops = [text[start:start + rng.randint(1, 3)], "zzz never"]
        choice, pieces = ChoiceText(codec, stops), []
        for i, t in enumerate(ids):
            pieces.append(choice.push([t], final=i == len(ids) - 1))
        want, stopped = cut_at_stop(text, stops)
        assert "".join(pieces) == want and choice.stopped == stopped is True, (text, stops, pieces)
        assert choice.push([ids[0]]) == "" and choice.push([], final=True) == ""  # nothing after a stop


def test_a_choice_without_a_stop_string_sends_all_of_its_text_by_the_final_push(codec) -> None:
    ids = codec.encode(TEXTS[0], special=False)
    choice = ChoiceText(codec, ["ZZZZZZ"])
    sent = [choice.push([t]) for t in ids]
    assert len("".join(sent)) == len(TEXTS[0]) - 5  # the last 5 characters could begin the stop string
    assert "".join(sent) + choice.push([], final=True) == TEXTS[0] and not choice.stopped
