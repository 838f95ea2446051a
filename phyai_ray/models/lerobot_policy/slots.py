"""Each running frame's prefix cache in a slot of one pool, written once and read in place every step.

    slots = PrefixSlots()
    slots.place(frame)               # its prefix's layers copied into a free slot, the prefix's tensors
                                     # become views of that slot (the frame's own copies are freed)
    view = slots.view(frames)        # what the expert reads this step: each layer's rows of these frames
    slots.keep(live)                 # the slots of frames no longer running return to the pool; with
                                     # none left in use the pool itself is freed (nothing held while idle)

The pool holds, per kind and layer, one tensor [slots, T, KV, D] in the family's layout ("k" / "v":
a VLM layer's keys / values; "ck" / "cv": SmolVLA's projected cross-attention ones). T is the longest
prefix placed so far; a frame's rows past its own length are zero and masked out by `prefix_pad`, as
in a right-padded stack. A step reads the stepping frames' rows by their slot indices: when those
are the pool's first rows in order (a batch that arrived together and runs together) the read is a
view, with no copy at all; otherwise one `index_select` per layer gathers them. Nothing is re-stacked
when a robot joins or leaves: its slot is written once at its first step and freed with its chunk.

The pool grows (slots doubled, T widened) only when a frame does not fit; the live frames' views then
point at the new pool.
"""

from __future__ import annotations

from typing import Any

import torch


def _parts(prefix: Any) -> dict[tuple[str, int], torch.Tensor]:
    """{(kind, layer): [L, KV, D]} of one frame's prefix."""
    parts = {("k", i): t for i, t in enumerate(prefix.keys)}
    parts.update({("v", i): t for i, t in enumerate(prefix.values)})
    for i, (k, v) in getattr(prefix, "cross", {}).items():
        parts[("ck", i)], parts[("cv", i)] = k, v
    return parts


def _repoint(prefix: Any, pools: dict[tuple[str, int], torch.Tensor], slot: int) -> None:
    """The prefix's tensors become views of its slot's rows (its own storage is then freed)."""
    n = prefix.length
    prefix.keys = [pools[("k", i)][slot, :n] for i in range(len(prefix.keys))]
    prefix.values = [pools[("v", i)][slot, :n] for i in range(len(prefix.values))]
    if getattr(prefix, "cross", None):
        prefix.cross = {i: (pools[("ck", i)][slot, :n], pools[("cv", i)][slot, :n]) for i in prefix.cross}


class SlotView:
    """The prefixes of one expert step as the network reads them: `lengths`, `lmax` and, per kind and
    layer, the rows [B, lmax, KV, D] of the stepping frames (`get`)."""

    def __init__(self, pools: dict[tuple[str, int], torch.Tensor], slots: list[int], lengths: list[int]) -> None:
        self.pools, self.lengths, self.lmax = pools, lengths, max(lengths)
        first = next(iter(pools.values()))
        self.contiguous = slots == list(range(len(slots)))
        self.index = None if self.contiguous else torch.tensor(slots, device=first.device)

    def get(self, kind: str, layer: int) -> torch.Tensor:
        pool = self.pools[(kind, layer)]
        if self.contiguous:
            return pool[:len(self.lengths), :self.lmax]
        return pool[:, :self.lmax].index_select(0, self.index)


class PrefixSlots:
    """One rank's slot pool of prefix caches (see the module docstring)."""

    def __init__(self, initial_slots: int = 8) -> None:
        self.initial = initial_slots
        self.pools: dict[tuple[str, int], torch.Tensor] = {}
        self.owner: dict[int, Any] = {}  # slot -> the frame whose prefix it holds
        self.capacity = self.length = 0

    def slot_of(self, frame: Any) -> int | None:
        return getattr(frame, "slot", None)

    def place(self, frame: Any) -> None:
        """Write `frame.prefix` into a free slot (once: a frame already placed is left as it is)."""
        if self.slot_of(frame) is not None:
            return
        parts = _parts(frame.prefix)
        slot = min(set(range(self.capacity + 1)) - set(self.owner))
        self._fit(parts, slot + 1, frame.prefix.length)
        n = frame.prefix.length
        for key, tensor in parts.items():
            row = self.pools[key][slot]
            row[:n] = tensor
            row[n:] = 0
        self.owner[slot], frame.slot = frame, slot
        _repoint(frame.prefix, self.pools, slot)

    def view(self, frames: list[Any]) -> SlotView:
        """The stepping frames' prefixes, read from their slots (each frame placed before)."""
        return SlotView(self.pools, [frame.slot for frame in frames], [f.prefix.length for f in frames])

    def keep(self, live: list[Any]) -> None:
        """Free the slots of frames not in `live`; with no slot in use, free the pool."""
        alive = {id(f) for f in live}
        for slot, frame in list(self.owner.items()):
            if id(frame) not in alive:
                del self.owner[slot]
                frame.slot = None
        if not self.owner:
            self.pools, self.capacity, self.length = {}, 0, 0

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pools.values())

    def shrink(self) -> int:
        """Give the pool back down to the slots in use (sleep); the bytes freed."""
        before = self.held_bytes()
        if not self.owner:
            self.keep([])
            return before
        self._rebuild(max(self.owner) + 1, self.length)
        return before - self.held_bytes()

    def _fit(self, parts: dict[tuple[str, int], torch.Tensor], slots: int, length: int) -> None:
        if not self.pools:
            self.pools = {key: t.new_zeros((max(self.initial, slots), length, *t.shape[1:]))
                          for key, t in parts.items()}
            self.capacity, self.length = max(self.initial, slots), length
        elif slots > self.capacity or length > self.length:
            grown = self.capacity * 2 if slots > self.capacity else self.capacity
            self._rebuild(grown, max(length, self.length))

    def _rebuild(self, capacity: int, length: int) -> None:
        """A new pool of `capacity` slots and `length` rows holding the live slots; views re-pointed."""
        keep = min(capacity, self.capacity)
        new = {}
        for key, old in self.pools.items():
            pool = old.new_zeros((capacity, length, *old.shape[2:]))
            pool[:keep, :min(length, self.length)] = old[:keep, :length]
            new[key] = pool
        self.pools, self.capacity, self.length = new, capacity, length
        for slot, frame in self.owner.items():
            _repoint(frame.prefix, self.pools, slot)
