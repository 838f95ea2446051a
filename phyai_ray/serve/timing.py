"""A request's own deadline in, its timing out: the same two fields on every protocol.

    deadline_ms("150", "X-Request-Deadline-Ms")   -> 0.15 (s); None when absent; ValueError outside (0, 1 day]
    timing_fields(future.timing(), 0.15)          -> {queue_ms, infer_ms, batch_size, ..., deadline_ms: 150.0}

The deadline arrives as `X-Request-Deadline-Ms` (the JSON route `/v1/step`), OIP
`parameters.deadline_ms` (HTTP and gRPC) or openpi `deadline_ms` (the URL's query or a frame),
counted in milliseconds from the request's arrival; it becomes `Engine.submit(deadline_s=)`. The
timing goes back in `Server-Timing` (/v1/step), the OIP response parameters and openpi's
`server_timing`. A deadline that passes before the request starts is a failure (504
`deadline_missed`, `error_map.py`); everything here belongs to requests that succeed.
"""

from __future__ import annotations

import math
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


def timing_fields(timing: dict, deadline_s: float | None) -> dict[str, Any]:
    """A request's `EngineFuture.timing()` for a reply, its deadline as the client gave it."""
    out = dict(timing)
    out["deadline_ms"] = None if deadline_s is None else round(deadline_s * 1e3, 3)
    return out
