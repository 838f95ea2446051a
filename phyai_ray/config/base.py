"""`ConfigModel`: the base of every config model (frozen, unknown fields rejected).

pydantic wraps a ValueError raised inside a validator into its own `ValidationError`, which would
hide `ParallelConfigError` / `DeploymentConfigError` from callers that catch them. When every
error of a failed validation is one of ours, the first one is raised as is; ours are ValueErrors
too, so `except ValueError` keeps working. Mixed failures stay pydantic's `ValidationError`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from phyai_ray.errors import PhyAIError


class ConfigModel(BaseModel):
    """Frozen, `extra="forbid"`, and re-raises phyai-ray's own validation errors unwrapped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _own_error(exc) or exc from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise _own_error(exc) or exc from None


def _own_error(exc: ValidationError) -> PhyAIError | None:
    """The first phyai-ray error inside `exc`, when all of its errors are ours."""
    ours = [e.get("ctx", {}).get("error") for e in exc.errors()]
    if ours and all(isinstance(e, PhyAIError) for e in ours):
        return ours[0]
    return None
