"""`phyai-ray serve reference_lm` on localhost, driven by the real `openai` client.

A real server in a subprocess (its own local Ray, one inline group): a completion with logprobs,
a streamed completion, an error in OpenAI's shape, and the API key enforced.

Run: .venv/bin/pytest tests/test_serve_openai.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phyai_ray.models.reference_lm import ReferenceLMConfig, full_weights, score
from phyai_ray.serve.runtime.options import API_KEY_ENV
from tests.helpers import REPO, console_script, free_port, kill_leftovers, stop_and_check, wait_ready

openai = pytest.importorskip("openai")
KEY = "openai-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), API_KEY_ENV: KEY, "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    with log.open("w") as out:
        proc = subprocess.Popen([console_script("phyai-ray"), "serve", "reference_lm", "--plugin-args", '{"seed": 0}',
                                 "--device", "cpu", "--port", str(port)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    started: set[int] = set()
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", 150, log)
        yield f"http://127.0.0.1:{port}/v1"
        stop_and_check(proc, started)
    finally:
        kill_leftovers(proc, started)
        sys.stdout.write(Path(log).read_text()[-5000:])


@pytest.mark.ray  # `phyai-ray serve` starts a Ray instance of its own
def test_completion_stream_errors_and_key_over_http(server):
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["reference_lm"]
    out = client.completions.create(model="reference_lm", prompt=[1, 2, 3], max_tokens=6, temperature=0, logprobs=1)
    choice = out.choices[0]
    assert len(choice.token_ids) == 6 and choice.finish_reason == "length"
    want = score(full_weights(ReferenceLMConfig(seed=0)), [1, 2, 3], choice.token_ids)
    assert (torch.tensor(choice.logprobs.token_logprobs) - want).abs().max() <= 1e-5

    events = list(client.completions.create(model="reference_lm", prompt=[1, 2, 3], max_tokens=6, temperature=0,
                                            stream=True))
    assert [t for e in events for c in e.choices for t in c.token_ids] == choice.token_ids

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="reference_lm", prompt="text needs a tokenizer", max_tokens=4)
    assert "no tokenizer" in info.value.body["message"] and info.value.status_code == 400
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="wrong", max_retries=0).completions.create(
            model="reference_lm", prompt=[1], max_tokens=2)
