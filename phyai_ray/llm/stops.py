"""Stop strings on the ranks' side: a sequence ends at the token that completes one of them.

    scan = StopScan(codec, ["\\n\\n", "Observation:"])
    for token in generated:
        if scan.push(token):          # the text so far now holds a stop string
            break                     # this token ends the sequence; it is its last
    scan.text                         # the completion up to (not including) the stop string

The text grows by incremental detokenization with vLLM's two offsets: `decode(ids[prefix:])`
minus `decode(ids[prefix:read])` is the new text of the tokens after `read`, so each token costs
a decode of a few tokens, not of the whole completion; a trailing U+FFFD (half of a multi-byte
character) is not text yet, and the offsets stay until the token that completes it. Only the tail is scanned: the new text plus
the longest stop string's length - 1 characters before it, where a stop string could begin.
"""

from __future__ import annotations

from typing import Any

MAX_STOP_CHARS = 256  # a stop string longer than this is refused where the request is parsed


def cut_at_stop(text: str, stops: list[str] | tuple[str, ...]) -> str:
    """`text` up to (not including) the first of `stops` in it; all of it when none is."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(found)] if found else text


class StopScan:
    """One sequence's text, decoded incrementally, and whether a stop string has appeared in it."""

    def __init__(self, codec: Any, stops: list[str] | tuple[str, ...]) -> None:
        self.codec, self.stops = codec, tuple(s for s in stops if s)
        self.reach = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] is context already turned into text
        self.decoded = ""  # the text of ids[:read]
        self.shown = ""  # decoded, plus the complete characters of the tokens after `read`
        self.cut: int | None = None  # where the first stop string begins, once one appeared

    def push(self, token: int) -> bool:
        """Add a generated token; True once the text holds a stop string (then `text` ends before it)."""
        self.ids.append(int(token))
        if self.cut is not None:
            return True
        before = self.codec.decode(self.ids[self.prefix:self.read])
        after = self.codec.decode(self.ids[self.prefix:])
        visible = after.rstrip("\ufffd")  # complete characters only
        if len(visible) <= len(before):
            return False  # no new character yet (half of one, or a token of no text)
        start = max(0, len(self.shown) - self.reach)
        self.shown = self.decoded + visible[len(before):]
        if visible == after:  # nothing half-decoded: the offsets move on
            self.decoded, self.prefix, self.read = self.shown, self.read, len(self.ids)
        found = [i for i in (self.shown.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.cut = min(found)
        return self.cut is not None

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    @property
    def text(self) -> str:
        """The text so far, up to (not including) the stop string once one appeared."""
        return self.shown if self.cut is None else self.shown[:self.cut]
