"""Weight sync of `hf_causal_lm` as trainers send it: `state_dict()` of a tied model, other dtypes.

Run: .venv/bin/pytest tests/test_hf_weight_sync.py -q

Before, a tied model's `state_dict()` was refused (`lm_head.weight` unknown), as were persistent
buffers such as an older transformers' `rotary_emb.inv_freq`, and a bfloat16 update of a float32
model was refused instead of cast. Now both are skipped, the dtype is cast, and the update's report
(`ControlReport.notes`) names each; wrong names and shapes are still refused before any change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phyai_ray import Engine, EngineArgs, EngineConfig, WeightSender
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.errors import WeightUpdateRefusedError

pytest.importorskip("transformers")

PROMPT = [1, 50, 60, 70, 80]
TOKENS = 10


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    from tests.hf_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", tied=True)


def engine(folder: Path) -> Engine:
    return Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                             config=EngineConfig(device=DeviceConfig(target="cpu"))))


def greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def trained(folder: Path):
    """transformers' model of the folder, changed as a trainer would, with bfloat16-exact weights."""
    from tests.hf_checkpoints import load_reference

    model = load_reference(folder)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
            p.copy_(p.to(torch.bfloat16).float())
    return model


def test_a_tied_state_dict_in_bfloat16_is_loaded_and_the_report_names_what_was_skipped_and_cast(qwen2) -> None:
    model = trained(qwen2)
    state = {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}
    assert "lm_head.weight" in state  # tied: state_dict() lists the head, named_parameters() does not
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # an older persistent buffer
    with engine(qwen2) as eng:
        sender = WeightSender("gloo")
        sender.init_transfer(eng)
        [report] = sender.update(eng, list(state.items()), version=2)
        [out] = eng.step({"prompts": [PROMPT], "max_tokens": TOKENS, "ignore_eos": True})
    notes = " | ".join(report.notes)
    assert "skipped (tied" in notes and "lm_head.weight" in notes
    assert "skipped (a rotary buffer" in notes and "rotary_emb.inv_freq" in notes
    assert "cast from bfloat16 to float32 on receive: model.embed_tokens.weight" in notes
    assert out.weight_version == 2
    want = greedy(model, PROMPT)
    assert out.token_ids[: len(want)] == want


def test_wrong_names_and_shapes_are_still_refused_beside_skippable_tensors(qwen2) -> None:
    with engine(qwen2) as eng:
        before = eng.step({"prompts": [PROMPT], "max_tokens": TOKENS})[0]
        sender = WeightSender("gloo")
        sender.init_transfer(eng)
        bad = [("lm_head.weight", torch.zeros(3, 3)), ("model.norm.weight", torch.zeros(5, dtype=torch.bfloat16)),
               ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)), ("model.nope", torch.zeros(2))]
        with pytest.raises(WeightUpdateRefusedError) as refused:
            sender.update(eng, bad, version=5)
        again = eng.step({"prompts": [PROMPT], "max_tokens": TOKENS})[0]
    listed = " ".join(refused.value.problems)
    assert "'lm_head.weight'" in listed and "'model.norm.weight': shape [5]" in listed and "'model.nope'" in listed
    assert "inv_freq" not in listed
    assert again.token_ids == before.token_ids and again.weight_version == before.weight_version
