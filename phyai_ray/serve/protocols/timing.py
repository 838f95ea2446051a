"""A request's own deadline in, its timing out: the same two fields on every protocol.

    deadline_ms("150", "X-Request-Deadline-Ms")   -> 0.15 (s); None when absent; ValueError outside (0, 1 day]
    timing_fields(future.timing(), 0.15)          -> {queue_ms, infer_ms, batch_size, ..., deadline_ms: 150.0}
    late_mode("drop", "openpi late")              -> "drop"; None when absent; ValueError unless finish / drop
    freshness(received_at)                        -> {received_at, sent_at}: Unix seconds, the server's clock

Freshness: every reply says when the server received the request and sent the answer, in Unix
seconds (`time.time()`: the one clock a client on another host can compare against, given NTP),
beside `weight_version` and `deadline_met`. A robot discards a chunk whose `deadline_met` is
false, or that is older than its control period allows (`examples/robot_fleet.py`); with
`late="drop"` the server never sends such a chunk at all (it answers "deadline_missed").

The deadline arrives as `X-Request-Deadline-Ms` (the JSON route `/v1/step`), OIP
`parameters.deadline_ms` (HTTP and gRPC) or openpi `deadline_ms` (the URL's query or a frame),
counted in milliseconds from the request's arrival; it becomes `Engine.submit(deadline_s=)`. The
timing goes back in `Server-Timing` (/v1/step), the OIP response parameters and openpi's
`server_timing`. A deadline that passes before the request starts is a failure (504
`deadline_missed`, `error_map.py`); everything here belongs to requests that succeed.
"""

from __future__ import annotations

import math
import time
from typing import Any

DEADLINE_HEADER = "x-request-deadline-ms"
MAX_DEADLINE_MS = 24 * 3600 * 1e3


def deadline_ms(value: Any, where: str) -> float | None:
    """A request's own deadline given in milliseconds from its arrival (`where` names the field) as
    seconds; None when absent. Anything but a number in (0, 1 day] is a ValueError saying so."""
    if value is None:
        return None
    number = value
    if isinstance(value, (bytes, str)):
        try:
            number = float(value.decode() if isinstance(value, bytes) else value)
        except (UnicodeDecodeError, ValueError):
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) \
            or not 0 < number <= MAX_DEADLINE_MS:
        raise ValueError(f"{where}={value!r:.40} must be a number of milliseconds in (0, {MAX_DEADLINE_MS:.0f}], "
                         "counted from when the request arrives")
    return float(number) / 1e3


def late_mode(value: Any, where: str) -> str | None:
    """A request's `late` ("finish" or "drop"; bytes accepted), None when absent; a ValueError naming `where`."""
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    if text not in ("finish", "drop"):
        raise ValueError(f"{where}={value!r:.40} must be 'finish' (deliver a result ready after its deadline) or "
                         "'drop' (answer deadline_missed instead of a stale result)")
    return text


def freshness(received_at: float) -> dict[str, float]:
    """When the server received a request (`received_at`, from `time.time()`) and sends its reply, Unix seconds."""
    return {"received_at": received_at, "sent_at": time.time()}


def timing_fields(timing: dict, deadline_s: float | None) -> dict[str, Any]:
    """A request's `EngineFuture.timing()` for a reply, its deadline as the client gave it."""
    out = dict(timing)
    out["deadline_ms"] = None if deadline_s is None else round(deadline_s * 1e3, 3)
    return out
