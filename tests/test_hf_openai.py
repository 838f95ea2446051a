"""OpenAI's own client against `hf_causal_lm`'s routes: text completions, chat, streamed chat, bad input.

Run: .venv/bin/pytest tests/test_hf_openai.py -q

The routes run on one inline engine of a tiny Qwen2-shaped checkpoint (transformers writes it
here) in a FastAPI app, reached through the `openai` package's client. Every text equals what
transformers' tokenizer decodes from the same tokens, and the tokens equal transformers' greedy
generation of the chat template's rendering.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from phyai_ray import Engine, EngineArgs
from phyai_ray.serve.protocols.openai.api import add_openai_routes
from tests.hf_checkpoints import load_reference, write_checkpoint
from tests.test_hf_causal_lm import reference
from tests.test_openai_api import InlineRunner

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Le café — voilà?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = write_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-qwen2", "qwen2")
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                           config={"device": {"target": "cpu"}})) as engine:
        api = FastAPI()
        add_openai_routes(api, InlineRunner(engine))
        with TestClient(api) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
            yield client, AutoTokenizer.from_pretrained(str(folder)), load_reference(folder)


def test_models_lists_the_folder_name_and_a_text_completion_decodes_its_tokens(served):
    client, tok, model = served
    assert [m.id for m in client.models.list().data] == ["tiny-qwen2"]
    out = client.completions.create(model="tiny-qwen2", prompt="The quick brown", max_tokens=10, temperature=0,
                                    logprobs=1)
    choice = out.choices[0]
    tokens, log_probs = reference(model, tok("The quick brown").input_ids, 10)
    assert choice.token_ids == tokens
    assert choice.text == tok.decode(tokens, skip_special_tokens=True)
    assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, log_probs)) <= 1e-4
    assert out.usage.prompt_tokens == len(tok("The quick brown").input_ids)


def test_chat_follows_the_template_and_streamed_chat_gives_the_same_text(served):
    client, tok, model = served
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = reference(model, ids, 16)
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=16, temperature=0,
                                         logprobs=True)
    text = out.choices[0].message.content
    assert text == tok.decode(tokens, skip_special_tokens=True) and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(tokens)
    assert len(out.choices[0].logprobs.content) == len(tokens)
    chunks = list(client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_stop_strings_end_a_choice_before_the_stop_and_n_gives_seeded_choices(served):
    client, tok, model = served
    whole = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=16, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[: text.find(stop)]
    sampled = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, temperature=1.0,
                                             seed=5, n=3)
    again = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=8, temperature=1.0,
                                           seed=5, n=3)
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in sampled.choices}) > 1


def test_a_stop_string_cuts_token_ids_logprobs_and_usage_at_the_token_that_completed_it(served):
    client, tok, model = served
    whole = client.completions.create(model="tiny-qwen2", prompt="The quick brown", max_tokens=16, temperature=0)
    ids, text = whole.choices[0].token_ids, whole.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    ends = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    cut = client.completions.create(model="tiny-qwen2", prompt="The quick brown", max_tokens=16, temperature=0,
                                    stop=[stop], logprobs=1)
    choice = cut.choices[0]
    assert choice.token_ids == ids[:ends] and len(choice.logprobs.token_logprobs) == ends < len(ids)
    assert cut.usage.completion_tokens == ends and choice.text == text[: text.find(stop)]
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("messages,why", [
    ([], "messages"), ([{"role": "user"}], "has no content"), ([{"role": "robot", "content": "x"}], "is not one of"),
    ([{"role": "user", "content": "x" * 2000}], "exceeds|shorten"),
])
def test_bad_chats_are_400_in_openais_shape_and_nothing_else_is_disturbed(served, messages, why):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match=why) as info:
        client.chat.completions.create(model="tiny-qwen2", messages=messages, max_tokens=4)
    assert info.value.body["type"] == "invalid_request_error"
    assert client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=2).choices[0].message


def test_bad_completions_are_400(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match=r"out-of-range ids \[99999\]"):
        client.completions.create(model="tiny-qwen2", prompt=[1, 99999], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="exceeds the model's 256 tokens"):
        client.completions.create(model="tiny-qwen2", prompt="fox " * 300, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs=true"):
        client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=4, top_logprobs=2)


def test_top_logprobs_are_the_models_most_likely_tokens(served):
    import torch

    client, tok, model = served
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = reference(model, ids, 6)
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1: -1].float().log_softmax(-1)
    for position, entry in enumerate(out.choices[0].logprobs.content):
        want = logits[position].topk(3)
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t in want.indices.tolist()]
        assert max(abs(a.logprob - b) for a, b in zip(entry.top_logprobs, want.values.tolist())) <= 1e-4
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the chosen token is the most likely
    streamed = list(client.completions.create(model="tiny-qwen2", prompt=ids, max_tokens=6, temperature=0,
                                              logprobs=2, stream=True))
    alternatives = [a for e in streamed for c in e.choices if c.logprobs for a in (c.logprobs.top_logprobs or [])]
    assert len(alternatives) == len(tokens) and all(len(a) == 2 for a in alternatives)


def test_text_parts_are_joined_into_the_string_content(served):
    client, tok, _ = served
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]},
             CHAT[1]]
    joined = [{"role": "system", "content": "You are\nterse."}, CHAT[1]]
    a = client.chat.completions.create(model="tiny-qwen2", messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="tiny-qwen2", messages=joined, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(
        tok.apply_chat_template(joined, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("extra,field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
])
def test_fields_that_change_generation_and_are_not_implemented_are_400_naming_the_field(served, extra, field):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match=f"{field} is not supported") as info:
        client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=2, **extra)
    assert info.value.body["param"] == field
    client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=2, presence_penalty=0.0)


def test_prompt_logprobs_on_completions_is_400_naming_it(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not supported") as info:
        client.completions.create(model="tiny-qwen2", prompt=[1, 2], max_tokens=2, extra_body={"prompt_logprobs": 2})
    assert info.value.body["param"] == "prompt_logprobs"


def test_logit_bias_and_penalties_change_the_reply_on_both_routes(served):
    client, _, _ = served
    chat = dict(model="tiny-qwen2", messages=CHAT, max_tokens=6, temperature=0)
    biased = client.chat.completions.create(**chat, logit_bias={"14": 100}, logprobs=True)
    assert [t.token for t in biased.choices[0].logprobs.content] == [biased.choices[0].logprobs.content[0].token] * 6
    prompt = dict(model="tiny-qwen2", prompt=[1, 17, 23, 17, 42], max_tokens=8, temperature=0)
    assert client.completions.create(**prompt, logit_bias={"14": 100}).choices[0].token_ids == [14] * 8
    plain = client.completions.create(**prompt).choices[0].token_ids
    penalized = client.completions.create(**prompt, frequency_penalty=2.0).choices[0].token_ids
    repeated = client.completions.create(**prompt, extra_body={"repetition_penalty": 1.5}).choices[0].token_ids
    assert penalized != plain and repeated != plain
    assert len(set(penalized)) == len(penalized)  # 2.0 per use outweighs this tiny model's margins
    with pytest.raises(openai.BadRequestError, match="logit_bias maps token ids") as info:
        client.completions.create(**prompt, logit_bias={"fourteen": 1})
    assert info.value.body["param"] == "logit_bias"


def test_chat_template_kwargs_and_the_character_bound(served):
    client, _, _ = served
    out = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=2,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message
    with pytest.raises(openai.BadRequestError, match="may not set"):
        client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    with pytest.raises(openai.BadRequestError, match="characters are tokenized"):
        client.chat.completions.create(model="tiny-qwen2", messages=[{"role": "user", "content": "x" * 9000}],
                                       max_tokens=2)
