"""Incremental detokenization: the text of a growing token list, a few tokens' decode per push.

    text = Detokenizer(codec.decode)
    text.push([72])        -> "H"
    text.push([0xE2])      -> ""     (half of "€": held back, never a U+FFFD a later token completes)
    text.push([0x82, ...]) -> "€..."
    "".join(every push, the last with final=True) == codec.decode(all ids)

vLLM's two offsets over the ids: `ids[prefix:read]` is context already turned into text, the
tokens after `read` are new. Each push decodes the window `ids[prefix:]` and returns the part of
it past what was returned before; a decode of the context alone (`before`) says where the new text
starts, so detokenizers that drop a leading space or merge bytes see a token's left neighbour, as
in a whole decode. When the window's text ends in a complete character the offsets move on
(prefix = read, read = end), so a completion of n tokens pushed one at a time decodes about 3n
tokens in all, not n^2 / 2.

A window whose text ends in U+FFFD (half of a multi-byte character) keeps its offsets until a
token completes it. Bytes that never complete (a model can emit invalid UTF-8) would grow the
window forever, so once SETTLE tokens wait, the text of all but the last SETTLE - 1 of them is
final when it is a prefix of the window's text: a character is at most 4 bytes, so 3 tokens of
at least a byte each decide whether a sequence begun before them completes.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
SETTLE = 4  # pending tokens after which the older ones' text is checked for being final


class Detokenizer:
    """One sequence's text, released in deltas that concatenate to the whole decode."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: context, already text
        self.before = ""  # decode(ids[prefix:read])
        self.shown = 0  # characters of decode(ids[prefix:]) already returned

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """The new text of `ids` appended; with final=True also a trailing U+FFFD that nothing can complete."""
        self.ids.extend(int(t) for t in ids)
        if len(self.ids) == self.read:
            return ""
        text = self.decode(self.ids[self.prefix:])
        ready = text if final else text.rstrip(REPLACEMENT)
        delta = ready[self.shown:] if len(ready) > self.shown else ""
        self.shown = max(self.shown, len(ready))
        if ready == text:
            self._move(len(self.ids), 0)
        elif len(self.ids) - self.read >= SETTLE:
            delta += self._settle(text)
        return delta

    def _settle(self, text: str) -> str:
        """Make the text of all pending tokens but the last SETTLE - 1 final, when it is (see the module
        docstring); returns its characters not returned before."""
        end = len(self.ids) - (SETTLE - 1)
        head = self.decode(self.ids[self.prefix:end])
        if not text.startswith(head) or len(head) < len(self.before):
            return ""  # a later token changed the head's text: keep waiting
        delta = head[self.shown:] if len(head) > self.shown else ""
        self.shown = max(self.shown, len(head))
        self._move(end, self.shown - len(head))
        return delta

    def _move(self, read: int, beyond: int) -> None:
        """Context becomes ids[self.read:read]; `beyond` characters past it were returned already."""
        self.prefix, self.read = self.read, read
        self.before = self.decode(self.ids[self.prefix:self.read])
        self.shown = len(self.before) + beyond
