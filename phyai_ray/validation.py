"""A request checked once: the plugin's validator runs at the first place that sees the request.

    checked = validate(engine.entry, {"tokens": [[1, 2]]})   # RequestRejectedError if the plugin refuses it
    engine.submit(checked)                                    # runs checked.request; no second validation

`Entry.validate_request(request)` returns None (the request is fine as it is) or the form to run
instead, its parsed form: `hf_causal_lm` returns its prompts tokenized, so text is tokenized once.
`Validated` carries that form from the edge (HTTP, OIP, openpi, OpenAI, a Serve handle) to the
engine, through a forwarding hop to another group too, and `Engine.submit(request)` validates
only what does not arrive as `Validated`. Whatever the validator returned is what `batch_key`,
`request_size`, `sequences`, `gather` and the ranks receive.

Any exception of the validator becomes `RequestRejectedError` (a ValueError) with the plugin's
message and the validator's exception as its cause: the request is at fault, and every edge
answers it with its protocol's bad-request status (`serve/protocols/error_map.py`). It is also an
instance of the validator's own exception class (as Ray's `RayTaskError.as_instanceof_cause()`
does), so a caller's `except MyPluginError` catches it:

    try:
        engine.step(bad)
    except BadPayload as exc:           # the plugin's own class ...
        assert isinstance(exc, RequestRejectedError) and isinstance(exc.__cause__, BadPayload)
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import ValidationError

from phyai_ray.errors import RequestRejectedError


@dataclass(frozen=True)
class Validated:
    """A request the plugin's validator accepted, in the form the plugin runs (see the module)."""

    request: Any


def validate(entry: Any, request: Any) -> Validated:
    """`request` checked by `entry.validate_request`, as it is to run; a `Validated` passes unchanged."""
    if isinstance(request, Validated):
        return request
    return Validated(checked(entry, request))


def checked(entry: Any, request: Any) -> Any:
    """The form of `request` to run: a `Validated`'s own, else the validator's (the request itself when
    it returned None). Raises `RequestRejectedError` when the validator raised."""
    if isinstance(request, Validated):
        return request.request
    try:
        parsed = entry.validate_request(request)
    except Exception as exc:  # the validator's contract: any exception refuses the request
        raise rejection(entry, exc) from exc
    return request if parsed is None else parsed


def rejection(entry: Any, exc: BaseException) -> RequestRejectedError:
    """The `RequestRejectedError` of the validator's exception `exc` (message kept, field when known)."""
    text = " ".join(str(exc).split())
    shown = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    name = entry.display_name()
    cls = RequestRejectedError if isinstance(exc, RequestRejectedError) else rejected_as(type(exc))
    return cls(f"plugin {name} rejected the request: {shown}", plugin=name, field=_field(exc))


@lru_cache(maxsize=256)
def rejected_as(cause: type) -> type[RequestRejectedError]:
    """A subclass of both `RequestRejectedError` and `cause` (one per cause class), so a refusal is
    caught as either. A class that cannot be mixed in (its instance layout is a builtin's other than
    Exception's, or it forbids subclasses) gives `RequestRejectedError` itself."""
    if not issubclass(cause, Exception) or issubclass(cause, RequestRejectedError):
        return RequestRejectedError
    try:
        cls = type(f"RequestRejected[{cause.__name__}]", (RequestRejectedError, cause), {
            "__new__": _new_rejected, "__init__": _init_rejected, "__str__": BaseException.__str__,
            "__reduce__": _reduce_rejected, "__module__": __name__,
            "__qualname__": f"RequestRejected[{cause.__qualname__}]", "cause_class": cause})
        cls("probe", plugin=None, field=None)  # a layout that only its own __new__ can build fails here
    except TypeError:
        return RequestRejectedError
    return cls


def _new_rejected(cls, message: str = "", **_: Any):
    return BaseException.__new__(cls, message)


def _init_rejected(self, message: str, *, plugin: str | None = None, field: str | None = None) -> None:
    """The cause class's own `__init__` may take other arguments: set the message as Exception does."""
    Exception.__init__(self, message)
    self.plugin, self.field = plugin, field


def _reduce_rejected(self):
    """Pickled by its cause class (by reference) when that class pickles, else as RequestRejectedError."""
    try:
        pickle.dumps(self.cause_class)
    except Exception:
        return (RequestRejectedError.__reduce__(self))
    return (_rebuild_rejected_as, (self.cause_class, str(self), self.plugin, self.field))


def _rebuild_rejected_as(cause: type, message: str, plugin: str | None, field: str | None) -> RequestRejectedError:
    return rejected_as(cause)(message, plugin=plugin, field=field)


def _field(exc: BaseException) -> str | None:
    """The request field `exc` names: its `field` attribute, or the location of a pydantic error."""
    field = getattr(exc, "field", None)
    if isinstance(field, str):
        return field
    if isinstance(exc, ValidationError) and exc.errors():
        return ".".join(str(part) for part in exc.errors()[0].get("loc", ())) or None
    return None
