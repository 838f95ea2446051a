"""`phyai-ray serve hf_causal_lm` on localhost, one group of TP=2 rank actors, driven by the real `openai` client.

A real server in a subprocess (its own local Ray) serving a tiny Llama checkpoint that transformers
writes here: `/v1/models` names the folder, a text completion, a chat, a streamed chat and a bad
chat, each checked against transformers' tokenizer and greedy generation.

Run: .venv/bin/pytest tests/test_serve_hf.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phyai_ray.serve.runtime.options import API_KEY_ENV
from tests.helpers import REPO, console_script, free_port, kill_leftovers, stop_and_check, wait_ready

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
KEY = "hf-serve-key"
CHAT = [{"role": "user", "content": "Robots fold laundry?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.hf_checkpoints import load_reference, write_checkpoint

    root = tmp_path_factory.mktemp("serve-hf")
    folder = write_checkpoint(root / "tiny-llama", "llama")
    port, log = free_port(), root / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), API_KEY_ENV: KEY, "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        proc = subprocess.Popen([console_script("phyai-ray"), "serve", "hf_causal_lm", "--plugin-args",
                                 json.dumps({"model": str(folder)}), "--device", "cpu", "--dense-tp-size", "2",
                                 "--attention-tp-size", "2", "--cpus-per-rank", "0.5", "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started: set[int] = set()
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", 180, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        yield client, AutoTokenizer.from_pretrained(str(folder)), load_reference(folder)
        stop_and_check(proc, started)
    finally:
        kill_leftovers(proc, started)
        sys.stdout.write(Path(log).read_text()[-5000:])


@pytest.mark.ray  # `phyai-ray serve` starts a Ray instance of its own
def test_text_chat_and_streamed_chat_through_serve(served):
    from tests.test_hf_causal_lm import reference

    client, tok, model = served
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    out = client.completions.create(model="tiny-llama", prompt="The quick brown", max_tokens=8, temperature=0)
    tokens, _ = reference(model, tok("The quick brown").input_ids, 8)
    assert out.choices[0].token_ids == tokens and out.choices[0].text == tok.decode(tokens, skip_special_tokens=True)

    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    tokens, _ = reference(model, ids, 12)
    chat = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="is not one of"):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "robot", "content": "x"}], max_tokens=2)
