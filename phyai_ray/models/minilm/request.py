"""`MiniLMRequest`: one embedding request, `{"sentences": ["A robot arm picks up a cup.", ...]}`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

MAX_SENTENCES = 256
MAX_CHARS = 20_000
EXAMPLE = {"sentences": ["A robot arm picks up a cup.", "The gripper closes."]}

Sentence = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CHARS)]


class MiniLMRequest(BaseModel):
    """Sentences to embed; the result is a float32 tensor [len(sentences), 384]."""

    model_config = ConfigDict(extra="forbid", frozen=True,
                              json_schema_extra={"examples": [EXAMPLE]})

    sentences: list[Sentence] = Field(
        min_length=1, max_length=MAX_SENTENCES,
        description=f"1 to {MAX_SENTENCES} non-empty strings of at most {MAX_CHARS} characters; "
                    "each is truncated to the model's 256 tokens.")

    @classmethod
    def parse(cls, request: Any) -> "MiniLMRequest":
        """Validate a request dict (or a `MiniLMRequest`); a `ValueError` shows what is wrong and an example."""
        if isinstance(request, cls):
            return request
        try:
            return cls.model_validate(request)
        except ValidationError as exc:
            raise ValueError(f"invalid minilm request: {exc}\nexpected e.g. {EXAMPLE}") from exc
