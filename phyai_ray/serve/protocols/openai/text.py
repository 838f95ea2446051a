"""Text for the OpenAI routes: prompts tokenized, completions decoded, stop strings, incremental streams.

    codec = text_codec(runner.entry)               # the plugin's Tokenizer (hf_causal_lm), or None
    ids = encode_prompts(codec, ["Hello", [1, 2]])  # strings with the tokenizer's BOS rule; id lists as they are
    text, stopped = cut_at_stop(codec.decode(out.token_ids), ["\\n\\n"])

A choice that meets a stop string ends there: its text excludes the stop string and its
finish_reason is "stop" (OpenAI's rule). A streamed choice is decoded incrementally (`TextStream`:
a few tokens per push, never half of a multi-byte character), holds back the last len(stop) - 1
characters while they could still begin a stop string and scans only those and the new text;
once every choice of a streamed request has stopped, the generation is cancelled. Without a
tokenizer, text is refused with a 400 that says to send ids. What a plugin's tokenizer provides is
declared in `phyai_ray.plugins.tokens` (`Tokenizer`).
"""

from __future__ import annotations

from typing import Any

from phyai_ray.plugins.tokens import Tokenizer, has_codec, tokenizer
from phyai_ray.serve.protocols.openai.common import BAD_REQUEST, OpenAIError


def _error(message: str, param: str) -> OpenAIError:
    return OpenAIError(BAD_REQUEST, message, param=param)


def text_codec(entry: Any) -> Tokenizer | _Missing | None:
    """The plugin's `Tokenizer` when it offers one (a `codec` property), `_Missing` (why it could not be
    loaded), else None. A codec that is no `Tokenizer` is the plugin's fault: TypeError naming what it lacks."""
    if not has_codec(entry):
        return None
    try:
        codec = entry.codec
    except Exception as exc:  # a checkpoint without tokenizer.json: text is refused with this reason
        return _Missing(str(exc))
    return tokenizer(codec, entry)


def usable(codec: Any) -> Tokenizer | None:
    """`codec` when it can decode, else None (no tokenizer: choices carry token ids and empty text)."""
    return None if codec is None or isinstance(codec, _Missing) else codec


class _Missing:
    def __init__(self, why: str) -> None:
        self.why = why


def require(codec: Any, what: str) -> Tokenizer:
    if codec is None or isinstance(codec, _Missing):
        why = codec.why if isinstance(codec, _Missing) else "this model has no tokenizer"
        raise _error(f"{what} needs a tokenizer: {why}; send token ids instead, e.g. prompt=[1, 2, 3]",
                     "prompt" if "prompt" in what else "messages")
    return codec


def encode_prompts(codec: Any, prompts: list) -> list[list[int]]:
    """Each prompt as token ids: a string through the tokenizer (with its BOS rule), a list of ids as it is."""
    if any(isinstance(p, str) for p in prompts):
        codec = require(codec, "a text prompt")
    return [codec.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def stop_lists(stop: Any) -> tuple[list[int], list[str]]:
    """OpenAI's `stop` (a string, a list of strings, or here token ids) -> (stop ids, stop strings)."""
    items = [] if stop is None else stop if isinstance(stop, list) else [stop]
    ids = [s for s in items if isinstance(s, int)]
    strings = [s for s in items if isinstance(s, str) and s]
    if len(strings) > 4:
        raise _error(f"stop holds {len(strings)} strings; OpenAI allows at most 4", "stop")
    return ids, strings


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to (not including) the first stop string in it, and whether one was found."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


class ChoiceText:
    """One streamed choice's text: deltas safe to send now, and whether a stop string ended it.

    The text comes from `TextStream` (a few tokens decoded per push). Only the characters not yet
    sent are kept: the last len(longest stop) - 1 of the text, which could still begin a stop
    string, plus the new delta; a stop string that appears must end in the delta, so this tail is
    all that is scanned. A choice of n tokens costs O(n) however long it grows.
    """

    def __init__(self, codec: Tokenizer, stops: list[str]) -> None:
        from phyai_ray.llm.tokenizer import TextStream

        self.stream, self.stops = TextStream(codec), [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.unsent, self.stopped = "", False

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        tail = self.unsent + self.stream.push(ids, final)
        found = [i for i in (tail.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.unsent = True, ""
            return tail[:min(found)]
        end = len(tail) if final else max(0, len(tail) - self.hold)
        self.unsent = tail[end:]
        return tail[:end]
