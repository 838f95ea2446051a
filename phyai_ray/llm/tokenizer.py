"""The checkpoint's own tokenizer and chat template, without transformers (`tokenizers` + `jinja2`).

    codec = TextCodec.open(folder)          # tokenizer.json, tokenizer_config.json, chat_template.jinja
    codec.encode("Hello")                   # ids, with the tokenizer's own BOS rule (its post-processor)
    codec.chat([{"role": "user", "content": "Hi"}])   # the template rendered, add_generation_prompt=True
    text = TextStream(codec); text.push(ids)          # incremental text: never half a character,
                                                      # a few tokens decoded per push

`chat` renders the template as transformers' `apply_chat_template` does (a sandboxed jinja2
environment, trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII, the special tokens as variables) and tokenizes the result without adding special
tokens again (the template writes them). `pip install 'phyai-ray[hf]'` brings both libraries.

Content given as text parts ([{"type": "text", "text": ...}], what the OpenAI SDKs send) is joined
into one string with newlines before rendering (vLLM's "string" format), so every template sees
text. A template that refuses the chat (`raise_exception`, e.g. Mistral's role alternation) or fails
on it raises ValueError naming the problem; `check_template(folder)` compiles a checkpoint's
template when it is configured, so a template that does not compile fails before any rank starts.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from phyai_ray.llm.detok import Detokenizer


ROLES = ("system", "user", "assistant", "tool", "developer")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TextCodec:
    """Encode, decode and render chats with one checkpoint's tokenizer files."""

    def __init__(self, tokenizer: Any, config: dict[str, Any], template: str | None, folder: Path) -> None:
        self.tokenizer, self.config, self.template_text, self.folder = tokenizer, config, template, folder
        self.specials = {k: _token_text(config.get(k)) for k in SPECIAL_KEYS if config.get(k) is not None}
        self._template: Any = None

    @classmethod
    def open(cls, folder: str | Path) -> "TextCodec":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{path} does not exist: text prompts and chat need the checkpoint's tokenizer.json "
                             "(send token ids in `prompts` instead)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("text prompts need the `tokenizers` package: pip install 'phyai-ray[hf]'") from None
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(Tokenizer.from_file(str(path)), config, _template(folder, config), folder)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The chat template applied to `messages` (checked first: roles and contents; text parts joined).

        `extra` are more template variables (OpenAI's `chat_template_kwargs`, e.g. enable_thinking)."""
        check_messages(messages)
        if self.template_text is None:
            raise ValueError(f"the checkpoint {self.folder} has no chat template (tokenizer_config.json "
                             "chat_template or chat_template.jinja); send a completion prompt instead")
        if self._template is None:
            self._template = _compile(self.template_text, self.folder)
        import jinja2

        variables = {**self.specials, **extra, "messages": [_joined(m) for m in messages],
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"the chat template of {self.folder.name} refused the messages: {exc}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            raise ValueError(f"the chat template of {self.folder.name} cannot render these messages: "
                             f"{type(exc).__name__}: {exc}") from None

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt, **extra), special=False)


def check_messages(messages: Any) -> None:
    """A chat is a non-empty list of {"role": one of ROLES, "content": text or text parts}; else ValueError."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is not one of {list(ROLES)}")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}] ({role}) has no content")
        if content is not None and not isinstance(content, str):
            parts = isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
            if not parts:
                raise ValueError(f"messages[{i}].content must be text or a list of {{'type': 'text', 'text': ...}} "
                                 "parts; other part types are not supported")


class TextStream(Detokenizer):
    """Text of a growing token list, released only where it is final: a trailing U+FFFD (half of a
    multi-byte character) is held back until the next token completes it.

        stream.push([72]) -> "H";  stream.push([0xE2]) -> "" (half a character);  stream.push([0x82]) -> "€"

    The concatenated pushes equal `decode(all ids)`; each push decodes only a window of recent
    tokens (`phyai_ray.llm.detok.Detokenizer`: vLLM's prefix and read offsets), not the whole list.
    """

    def __init__(self, codec: TextCodec) -> None:
        super().__init__(codec.decode)
        self.codec = codec


def _joined(message: dict[str, Any]) -> dict[str, Any]:
    """The message with text-part content joined into one string (newline-separated)."""
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
    return message


def check_template(folder: str | Path) -> None:
    """Compile the checkpoint's chat template, if it has one (ValueError naming the file if it does not compile)."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
    except ValueError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    text = _template(folder, config)
    if text is not None:
        _compile(text, folder)


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _template(folder: Path, config: dict[str, Any]) -> str | None:
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _compile(text: str, folder: Path | None = None) -> Any:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need `jinja2`: pip install 'phyai-ray[hf]'") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template of {folder or 'the checkpoint'} does not compile (line {exc.lineno}: "
                         f"{exc.message}); fix chat_template.jinja or tokenizer_config.json chat_template") from None
