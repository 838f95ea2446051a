"""Stop strings of `hf_causal_lm` end the sequence on the ranks, at the token that completed them.

Run: .venv/bin/pytest tests/test_hf_stop_strings.py -q

Before, `stop` strings only cut the text at the OpenAI edge: `token_ids`, log-probs and usage went
on past the stop (an RL trainer trained on tokens its reward never saw). Now the request's `stop`
reaches the ranks, the sequence ends at the iteration that produced the stop string, and the text
omits the stop string. The incremental detokenizer (`StopScan`) gives the same text as a whole decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phyai_ray import Engine, EngineArgs, EngineConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.llm.stops import StopScan, cut_at_stop
from phyai_ray.llm.tokenizer import TextCodec

pytest.importorskip("transformers")

TEXT = ["The quick brown fox", "Le café — voilà"]
TOKENS = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from tests.hf_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama")


def engine(folder: Path) -> Engine:
    return Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                             config=EngineConfig(device=DeviceConfig(target="cpu"))))


def test_the_scan_decodes_incrementally_as_a_whole_decode_does_and_finds_a_stop_across_tokens(llama) -> None:
    codec = TextCodec.open(llama)
    text = "€ voilà — 日本語 “quotes” fox and more"
    ids = codec.encode(text, special=False)
    scan = StopScan(codec, [])
    assert not any(scan.push(t) for t in ids) and scan.text == codec.decode(ids) == text
    scan = StopScan(codec, ["日本", "zzz"])
    ends = [i for i, t in enumerate(ids) if scan.push(t)]
    assert scan.text == "€ voilà — " and codec.decode(ids[: ends[0]]).find("日本") < 0 <= \
        codec.decode(ids[: ends[0] + 1]).find("日本")  # the first True is the token that completed it


def test_a_stop_string_ends_tokens_log_probs_and_text_at_the_token_that_completed_it(llama) -> None:
    codec = TextCodec.open(llama)
    with engine(llama) as eng:
        full = eng.step({"text": TEXT, "max_tokens": TOKENS, "ignore_eos": True})
        stops = []
        for out in full:  # a stop string from the middle of each completion
            start = len(out.text) // 2
            stops.append(out.text[start:start + 2])
        cut = eng.step({"text": TEXT, "max_tokens": TOKENS, "ignore_eos": True, "stop": stops})
        streamed = list(eng.stream({"text": TEXT, "max_tokens": TOKENS, "ignore_eos": True, "stop": stops}))
    for whole, out in zip(full, cut):
        ends = next(k for k in range(1, TOKENS + 1)
                    if any(s in codec.decode(whole.token_ids[:k]) for s in stops))
        assert out.token_ids == whole.token_ids[:ends] and len(out.token_ids) < TOKENS
        assert out.log_probs == pytest.approx(whole.log_probs[:ends], abs=1e-5)
        assert out.stop_reason == "completed"
        assert out.text == cut_at_stop(whole.text, stops) and not any(s in out.text for s in stops)
    per_choice: list[list[int]] = [[] for _ in TEXT]  # the stream's tokens end where the whole response's do
    for chunk in streamed:
        for i, delta in enumerate(chunk["token_ids"]):
            per_choice[i] += [] if delta is None else [delta] if isinstance(delta, int) else list(delta)
    assert per_choice == [o.token_ids for o in cut]


def test_stop_strings_need_the_tokenizer_and_are_bounded(llama) -> None:
    with engine(llama) as eng:
        with pytest.raises(ValueError, match="stop"):
            eng.submit({"prompts": [[1, 2]], "stop": ["x" * 300]})


class ByteCodec:
    """A byte-level codec (token id = one byte, decoded as UTF-8 with replacement) that counts the
    ids it decodes: how much work the scan does."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids) -> str:
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def test_bytes_that_never_complete_a_character_keep_the_scan_linear():
    codec, n = ByteCodec(), 2000
    scan = StopScan(codec, ["END"])
    ids = [0xE2] * n + list(b"ok END")  # every 0xE2 begins a character no byte completes
    stopped_at = next(i for i, t in enumerate(ids) if scan.push(t))
    assert stopped_at == len(ids) - 1 and scan.text == bytes(ids[:-3]).decode("utf-8", errors="replace")
    assert codec.decoded <= 12 * len(ids), f"{codec.decoded} ids decoded for {len(ids)} tokens"
