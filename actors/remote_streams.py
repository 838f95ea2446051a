"""`RemoteReader`: the consumer's end of a stream that the output rank of a Ray replica produces.

    future, reader = executor.submit_stream(request, max_buffered)
    chunks, done = reader.read(timeout_s)    # waits in the kernel while the request is queued, then
                                             # pulls chunks from the rank's sink (its control lane)
    reader.cancel()                          # queued: nothing runs; running: every rank stops at its next emit
"""

from __future__ import annotations

from typing import Any

from actors import fetch


class RemoteReader:
    """The consumer's end of a stream produced by the output rank of a Ray replica (its control lane)."""

    def __init__(self, executor: Any, work: Any) -> None:
        self.executor, self.work = executor, work
        self._sink = executor.actor(executor.output_rank)

    def read(self, timeout_s: float) -> tuple[list, bool]:
        if self.work.future.cancelled():
            return [], True
        sent = self.work.state
        if sent is None:  # still queued in the engine: wait (in the kernel) until the replica sends it
            self.work.launched.wait(timeout_s)
            sent = self.work.state
            if sent is None:
                return [], self.work.future.done()
        try:
            return fetch.get(self._sink.read_stream.remote(sent.seq, 64, timeout_s), timeout=timeout_s + 10)
        except Exception:  # the replica failed: the future says why
            return [], self.work.future.done()

    def subscribe(self, wake: Any) -> bool:
        return False  # its chunks are pulled from the rank: a consumer reads from a thread of its own

    def cancel(self) -> None:
        if self.work.future.cancel():
            return
        sent = self.work.state
        if sent is not None and self.executor.healthy:
            self._sink.cancel_stream.remote(sent.seq)
