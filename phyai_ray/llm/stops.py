"""Stop strings on the ranks' side: a sequence ends at the token that completes one of them.

    scan = StopScan(codec, ["\\n\\n", "Observation:"])
    for token in generated:
        if scan.push(token):          # the text so far now holds a stop string
            break                     # this token ends the sequence; it is its last
    scan.text                         # the completion up to (not including) the stop string

The text grows by incremental detokenization (`phyai_ray.llm.detok.Detokenizer`: vLLM's prefix
and read offsets), so each token costs a decode of a few tokens, not of the whole completion, and
bytes that never complete a character stop holding the window open after a few tokens. Only the
tail is scanned: the new text plus the longest stop string's length - 1 characters before it,
where a stop string could begin.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.llm.detok import Detokenizer

MAX_STOP_CHARS = 256  # a stop string longer than this is refused where the request is parsed


def cut_at_stop(text: str, stops: list[str] | tuple[str, ...]) -> str:
    """`text` up to (not including) the first of `stops` in it; all of it when none is."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(found)] if found else text


class StopScan:
    """One sequence's text, decoded incrementally, and whether a stop string has appeared in it."""

    def __init__(self, codec: Any, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.reach = max((len(s) for s in self.stops), default=1) - 1
        self.detok = Detokenizer(codec.decode)
        self.parts: list[str] = []  # the text so far, as released
        self.length = 0  # characters in `parts`
        self.tail = ""  # the last `reach` characters of the text: where a stop string could begin
        self.cut: int | None = None  # where the first stop string begins, once one appeared

    def push(self, token: int) -> bool:
        """Add a generated token; True once the text holds a stop string (then `text` ends before it)."""
        if self.cut is not None:
            return True
        new = self.detok.push([int(token)])
        if not new:
            return False  # no new character yet (half of one, or a token of no text)
        window = self.tail + new
        found = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if found:
            self.cut = self.length - len(self.tail) + min(found)
        self.parts.append(new)
        self.length += len(new)
        self.tail = window[len(window) - self.reach:] if self.reach else ""
        return self.cut is not None

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    @property
    def text(self) -> str:
        """The text so far, up to (not including) the stop string once one appeared."""
        shown = "".join(self.parts)
        return shown if self.cut is None else shown[:self.cut]
