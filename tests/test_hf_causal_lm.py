"""`hf_causal_lm` against transformers itself, on tiny random checkpoints transformers writes here.

Run: .venv/bin/pytest tests/test_hf_causal_lm.py -q

For each architecture (Llama, Qwen2 with a tied head, Qwen3, Mistral) greedy tokens equal
transformers' `generate(do_sample=False)` token for token and log-probs equal its logits'
log_softmax to 1e-4 (fp32), one prompt alone and many continuously batched (TP=2 on Ray:
tests/test_hf_causal_lm_ray.py). Tokenization, chat rendering and decoding equal transformers'
tokenizer; streamed text equals the whole text. A weight update by transformers' own parameter
names is followed token for token, and a trainer's recomputed log-probs equal the rollout's. Every
bad checkpoint fails before a rank starts, naming the file, field or tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from phyai_ray import Engine, EngineArgs, EngineConfig, WeightSender
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.errors import RequestRejectedError, WeightUpdateRefusedError
from phyai_ray.models.hf_causal_lm import CheckpointError
from phyai_ray.models.hf_causal_lm.request import MaxModelLenError
from phyai_ray.llm.tokenizer import TextCodec, TextStream
from tests.hf_checkpoints import FAMILIES, load_reference, write_checkpoint
from tests.tolerances import against

pytest.importorskip("transformers")

PROMPTS = [[1, 50, 60, 70, 80], [1, 9], [1, 200, 201, 17, 33, 90, 91, 92, 5, 6, 7]]
TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: write_checkpoint(root / f, f, tied=(f == "qwen2")) for f in FAMILIES}


def engine(folder: Path) -> Engine:
    return Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                             config=EngineConfig(device=DeviceConfig(target="cpu"))))


def reference(model, prompt: list[int], max_tokens: int = TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy generation (stopping at generation_config's EOS ids) and its tokens' log-probs."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]


def assert_matches(out, want: tuple[list[int], list[float]]) -> None:
    tokens, log_probs = want
    assert out.token_ids == tokens
    torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(log_probs), **against("transformers", "log_probs"))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_alone_and_continuously_batched(checkpoints, family) -> None:
    model = load_reference(checkpoints[family])
    want = [reference(model, p) for p in PROMPTS]
    with engine(checkpoints[family]) as eng:
        for prompt, expected in zip(PROMPTS, want):  # alone
            [out] = eng.step({"prompts": [prompt], "max_tokens": TOKENS})
            assert_matches(out, expected)
        futures = [eng.submit({"prompts": [p], "max_tokens": TOKENS}) for p in PROMPTS * 4]  # batched per iteration
        for future, expected in zip(futures, want * 4):
            [out] = future.result(timeout=120)
            assert_matches(out, expected)
        outs = eng.step({"prompts": PROMPTS, "max_tokens": TOKENS})  # one request, several sequences
        for out, expected in zip(outs, want):
            assert_matches(out, expected)
            assert out.stop_reason == ("completed" if len(expected[0]) < TOKENS else "length")


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32, "rope_theta": 500000.0},
])
def test_scaled_rotary_embeddings_equal_transformers(tmp_path, rope) -> None:
    from phyai_ray.models.hf_causal_lm import Architecture

    folder = write_checkpoint(tmp_path / rope["rope_type"], "llama", rope_parameters=rope)
    assert Architecture.read(folder).rope.kind == rope["rope_type"]
    model = load_reference(folder)
    assert model.config.rope_parameters["rope_type"] == rope["rope_type"]
    long_prompt = [1] + [(13 * i) % 300 + 5 for i in range(60)]  # past original_max_position_embeddings
    with engine(folder) as eng:
        for prompt in (PROMPTS[0], long_prompt):
            assert_matches(eng.step({"prompts": [prompt], "max_tokens": TOKENS})[0], reference(model, prompt))


def test_text_is_tokenized_and_decoded_as_transformers_does(checkpoints) -> None:
    from transformers import AutoTokenizer

    folder = checkpoints["llama"]
    tok, model = AutoTokenizer.from_pretrained(str(folder)), load_reference(folder)
    texts = ["The quick brown fox", "Le café — voilà 日本"]
    with engine(folder) as eng:
        outs = eng.step({"text": texts, "max_tokens": TOKENS})
    for text, out in zip(texts, outs):
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id  # the tokenizer's own BOS rule
        assert_matches(out, reference(model, ids))
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_chat_template_renders_as_apply_chat_template(checkpoints) -> None:
    from transformers import AutoTokenizer

    folder = checkpoints["qwen3"]
    tok, codec = AutoTokenizer.from_pretrained(str(folder)), TextCodec.open(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi — ça va?"},
                {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "日本語"}]
    for add in (True, False):
        assert codec.render(messages, add) == tok.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=add)
        want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add, return_dict=True)
        assert codec.chat(messages, add) == want["input_ids"]
    for bad, why in [([], "non-empty"), ([{"role": "user"}], "no content"), ([{"role": "robot", "content": "x"}],
                                                                             "is not one of")]:
        with pytest.raises(ValueError, match=why):
            codec.chat(bad)


def test_streamed_text_equals_the_whole_text_and_never_splits_a_character(checkpoints) -> None:
    codec = TextCodec.open(checkpoints["llama"])
    text = "€ voilà — 日本語 “quotes” fox"
    ids = codec.encode(text, special=False)
    pieces, stream = [], TextStream(codec)
    for i, t in enumerate(ids):
        pieces.append(stream.push([t], final=i == len(ids) - 1))
        assert "\ufffd" not in pieces[-1]
    assert "".join(pieces) == codec.decode(ids) == text
    assert sum(1 for p in pieces if p == "") > 0  # multi-byte characters were held back, then completed


def perturbed(model, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and separate heads
def test_an_update_by_transformers_names_is_followed_and_log_probs_match_a_trainer_forward(checkpoints, family) -> None:
    model = load_reference(checkpoints[family])
    with engine(checkpoints[family]) as eng:
        before = eng.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS})[0]
        params = perturbed(model)
        assert ("lm_head.weight" in params) == (family != "qwen2")  # tied: named_parameters() lists it once
        sender = WeightSender("gloo")
        sender.init_transfer(eng)
        sender.update(eng, model.named_parameters(), version=3)
        [after] = eng.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS, "ignore_eos": True})
    assert after.weight_version == 3 and after.token_ids != before.token_ids
    tokens = reference(model, PROMPTS[0], TOKENS)[0]
    assert after.token_ids[: len(tokens)] == tokens
    with torch.no_grad():  # the trainer's recompute: one forward of prompt + completion
        ids = torch.tensor([PROMPTS[0] + after.token_ids])
        logits = model(ids).logits[0, len(PROMPTS[0]) - 1: -1].float()
        recomputed = logits.log_softmax(-1).gather(1, torch.tensor(after.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(after.log_probs), recomputed, **against("transformers", "log_probs"))


def test_a_misnamed_or_misshapen_update_is_refused_and_the_old_weights_keep_serving(checkpoints) -> None:
    folder = checkpoints["llama"]
    with engine(folder) as eng:
        before = eng.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS})[0]
        sender = WeightSender("gloo")
        sender.init_transfer(eng)
        bad = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3)),
               ("model.layers.9.mlp.x", torch.zeros(2))]
        with pytest.raises(WeightUpdateRefusedError, match=r"q_proj.weight'. shape \[3, 3\].*model.layers.9.mlp.x"):
            sender.update(eng, bad, version=5)
        again = eng.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS})[0]
    assert again.token_ids == before.token_ids and again.weight_version == before.weight_version


def broken(tmp_path: Path, source: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(source, folder)
    return folder


def edit_config(folder: Path, **fields) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def test_bad_checkpoints_fail_before_any_rank_starts_naming_what_is_wrong(checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    good = checkpoints["llama"]
    with pytest.raises(CheckpointError, match=r"'/no/such/folder' is not a folder.*never downloads"):
        engine(Path("/no/such/folder"))
    unknown = broken(tmp_path, good, "unknown")
    edit_config(unknown, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported.*LlamaForCausalLM"):
        engine(unknown)
    rope = broken(tmp_path, good, "rope")
    edit_config(rope, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match=r"rope type 'longrope'.*supported: \['default', 'linear', 'llama3'\]"):
        engine(rope)
    window = broken(tmp_path, checkpoints["mistral"], "window")
    edit_config(window, sliding_window=64)
    with pytest.raises(CheckpointError, match=r"sliding_window=64 is shorter than max_model_len=256"):
        engine(window)
    for name, change in [("missing", lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
                         ("misshapen", lambda w: w.__setitem__("model.norm.weight", torch.ones(5)))]:
        folder = broken(tmp_path, good, name)
        weights = load_file(str(folder / "model.safetensors"))
        change(weights)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        match = (r"tensor 'model.layers.1.mlp.up_proj.weight' is missing" if name == "missing" else
                 r"tensor 'model.norm.weight' in model.safetensors has shape \[5\]; config.json implies \[64\]")
        with pytest.raises(CheckpointError, match=match):
            engine(folder)


def test_sharded_checkpoints_with_an_index_load_the_same_model(checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = broken(tmp_path, checkpoints["qwen3"], "sharded")
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_reference(folder)
    with engine(folder) as eng:
        assert_matches(eng.step({"prompts": [PROMPTS[2]], "max_tokens": TOKENS})[0], reference(model, PROMPTS[2]))


def test_bad_requests_are_refused_in_the_dispatcher(checkpoints) -> None:
    with engine(checkpoints["llama"]) as eng:
        for request, why in [({"prompts": [[1, 99999]]}, r"out-of-range ids \[99999\]"),
                             ({"prompts": [[1] * 250], "max_tokens": 10},
                              r"max_model_len=256 tokens; the request asks for 260 .*plugin_args 'max_model_len'"),
                             ({"prompts": [[1]], "text": ["x"]}, "exactly one of"),
                             ({"text": ["x"], "temperature": -1}, "temperature")]:
            with pytest.raises(ValueError, match=why):
                eng.submit(request)
        with pytest.raises(RequestRejectedError) as refused:
            eng.submit({"prompts": [[1] * 200], "max_tokens": 57})
        assert refused.value.field == "max_tokens" and isinstance(refused.value.__cause__, MaxModelLenError)
        assert eng.step({"prompts": [[1, 2]], "max_tokens": 2})[0].token_ids  # nothing else disturbed


def test_older_configs_with_rope_theta_and_rope_scaling_read_the_same(checkpoints, tmp_path) -> None:
    from phyai_ray.models.hf_causal_lm import Architecture

    folder = broken(tmp_path, checkpoints["llama"], "legacy")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    (folder / "config.json").write_text(json.dumps(config))
    rope = Architecture.read(folder).rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position) == ("llama3", 500000.0, 8.0, 32)
