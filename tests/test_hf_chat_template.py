"""Chat templates of `hf_causal_lm`: refusals are ValueErrors naming the problem, kwargs reach the
template, and a template that does not compile fails when the engine is configured.

Run: .venv/bin/pytest tests/test_hf_chat_template.py -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from phyai_ray.llm.tokenizer import TextCodec
from phyai_ray.models.hf_causal_lm import CheckpointError
from phyai_ray.models.hf_causal_lm.entry import HFCausalLMEntry

pytest.importorskip("transformers")
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
               "{% if thinking is defined and thinking %}<think>{% endif %}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from tests.hf_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama")


def with_template(source: Path, target: Path, template: str) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return target


def test_a_refusing_template_is_a_value_error_and_kwargs_reach_the_template(llama, tmp_path) -> None:
    codec = TextCodec.open(with_template(llama, tmp_path / "alt", ALTERNATING))
    with pytest.raises(ValueError, match="refused the messages: Conversation roles must alternate"):
        codec.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    ok = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert codec.render(ok) == "[user] a\nb\n"
    assert codec.render(ok, thinking=True).endswith("<think>")


def test_a_template_that_does_not_compile_fails_at_configure(llama, tmp_path) -> None:
    folder = with_template(llama, tmp_path / "bad", "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(CheckpointError, match="does not compile"):
        HFCausalLMEntry({"model": str(folder)})
    HFCausalLMEntry({"model": str(llama)})  # the good one configures
