"""Mistral's sliding window is checked against the length `hf_causal_lm` actually serves.

Run: .venv/bin/pytest tests/test_hf_window.py -q

Before, a checkpoint with a 4,096-token window and 32k positions (Mistral-7B) was refused with the
default max_model_len, which is min(max_position_embeddings, 4096) and fits the window.
"""

from __future__ import annotations

import json

import pytest

from phyai_ray.models.hf_causal_lm import CheckpointError
from phyai_ray.models.hf_causal_lm.entry import HFCausalLMEntry

pytest.importorskip("transformers")


def test_the_window_is_checked_against_the_served_length(tmp_path) -> None:
    from tests.hf_checkpoints import write_checkpoint

    folder = write_checkpoint(tmp_path / "mistral", "mistral")
    config = json.loads((folder / "config.json").read_text())
    config.update(sliding_window=4096, max_position_embeddings=32768, use_sliding_window=True)
    (folder / "config.json").write_text(json.dumps(config))
    entry = HFCausalLMEntry({"model": str(folder)})  # default length 4096: the window covers it
    assert entry.max_sequence_tokens() == 4096
    with pytest.raises(CheckpointError, match="sliding_window=4096 is shorter than max_model_len=8192"):
        HFCausalLMEntry({"model": str(folder), "max_model_len": 8192})
