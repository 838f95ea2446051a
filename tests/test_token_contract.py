"""The token-plugin contract (`phyai_ray.plugins.tokens`): what the OpenAI routes read of a plugin,
and the clear error when a plugin does not keep it. Pure: no engine, no Ray.

Run: .venv/bin/pytest tests/test_token_contract.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI

from phyai_ray.llm.tokenizer import TextCodec
from phyai_ray.outputs import TokenOutput
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.tokens import (GenerationRequest, TokenPlugin, TokenResult, Tokenizer, has_codec, token_plugin,
                                      tokenizer)
from phyai_ray.serve.protocols.openai.api import add_openai_routes
from phyai_ray.serve.protocols.openai.text import text_codec


class Tokens(Entry):
    name = "tokens"
    generates_tokens = True


class Pictures(Entry):
    name = "pictures"


class BadCodec(Tokens):
    name = "bad_codec"

    @property
    def codec(self):
        return SimpleNamespace(encode=lambda text: [1], decode=lambda ids: "x")  # no chat


def test_an_entry_that_generates_tokens_keeps_the_contract():
    entry = Tokens()
    assert token_plugin(entry) is entry and isinstance(entry, TokenPlugin)
    assert not has_codec(entry) and has_codec(BadCodec())


def test_a_plugin_without_generates_tokens_gets_no_openai_routes():
    runner = SimpleNamespace(entry=Pictures())
    with pytest.raises(TypeError, match="plugin pictures does not set generates_tokens = True"):
        add_openai_routes(FastAPI(), runner)


def test_an_entry_missing_a_method_is_named():
    fake = SimpleNamespace(generates_tokens=True, served_name=lambda: "m", validate_request=lambda r: None)
    with pytest.raises(TypeError, match=r"lacks \['max_sequence_tokens'\]"):
        token_plugin(fake)


def test_a_codec_that_is_no_tokenizer_is_named():
    with pytest.raises(TypeError, match=r"codec of plugin bad_codec \(SimpleNamespace\) lacks \['chat'\]"):
        text_codec(BadCodec())
    codec = SimpleNamespace(encode=lambda t: [], decode=lambda i: "", chat=lambda m, **k: [])
    assert tokenizer(codec, Tokens()) is codec and isinstance(codec, Tokenizer)
    assert all(callable(getattr(TextCodec, m)) for m in ("encode", "decode", "chat"))


def test_the_generation_request_travels_as_the_plugins_dict():
    request = GenerationRequest(prompts=((1, 2), (3,)), n=2, max_tokens=4, temperature=0.0, top_p=1.0, seed=7)
    plain = request.as_dict()
    assert plain == {"prompts": [[1, 2], [1, 2], [3], [3]], "max_tokens": 4, "temperature": 0.0, "top_p": 1.0,
                     "stop_token_ids": [], "seed": 7}
    assert plain["prompts"][0] is plain["prompts"][1]  # n references to one copy, not n copies
    full = GenerationRequest(prompts=((1,),), n=1, max_tokens=1, temperature=1.0, top_p=0.9, seed=0,
                             stop_token_ids=(2,), stop=("\n",), top_logprobs=3).as_dict()
    assert (full["stop"], full["top_logprobs"], full["stop_token_ids"]) == (["\n"], 3, [2])


def test_token_output_is_a_token_result():
    out = TokenOutput([5, 6], [-0.1, -0.2], stop_reason="completed")
    assert all(hasattr(out, f) for f in TokenResult.__annotations__)
    assert (out.token_ids, out.log_probs, out.top_logprobs, out.stop_reason) == ([5, 6], [-0.1, -0.2], [],
                                                                                  "completed")
