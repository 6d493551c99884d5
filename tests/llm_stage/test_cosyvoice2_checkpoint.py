"""The published CosyVoice2-0.5B LM files (cosyvoice2.yaml, llm.pt, CosyVoice-BlankEN/) load back:
same weights, CosyVoice 2's text ids, the yaml's sampling, greedy tokens equal the reference loop;
a directory or a repo id in the local HF cache; broken directories are refused naming the field."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoTokenizer

from core.config import ModelConfig
from core.errors import InvalidArgumentError
from core.messages import SamplingParams
from llm_stage.models.cosyvoice2 import CosyVoice2Adapter
from llm_stage.models.cosyvoice2_lm import TEXT_SPECIAL_TOKENS
from tests.factories import adapter_engine
from tests.llm_stage.test_cosyvoice2 import reference_greedy
from tests.published_layouts import COSYVOICE2_REPO, cosyvoice2_lm, put_in_hf_cache, write_cosyvoice2_lm


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    model = cosyvoice2_lm(seed=4)
    return model, write_cosyvoice2_lm(tmp_path_factory.mktemp("cosyvoice2") / "CosyVoice2-0.5B", model)


def load(directory) -> CosyVoice2Adapter:
    return CosyVoice2Adapter.build(ModelConfig(name="cosyvoice2", checkpoint_dir=directory))


def test_published_layout_loads_the_same_weights_by_their_published_names(published):
    model, directory = published
    state = torch.load(directory / "llm.pt", weights_only=True)
    prefixes = {key.split(".")[0] for key in state}
    assert prefixes == {"llm_embedding", "llm", "llm_decoder", "speech_embedding"}
    assert {"llm.model.model.layers.0.self_attn.q_proj.bias", "llm.model.lm_head.weight", "llm_decoder.bias"} <= set(
        state
    )
    loaded = load(directory)
    want, got = model.state_dict(), loaded.model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def test_text_ids_are_cosyvoice2s_tokenizer_and_greedy_tokens_equal_the_reference(published):
    model, directory = published
    loaded = load(directory)
    text = "hello world [breath] the<|endofprompt|>"
    reference = AutoTokenizer.from_pretrained(str(directory / "CosyVoice-BlankEN"))
    reference.add_special_tokens({"additional_special_tokens": list(TEXT_SPECIAL_TOKENS)})
    ids = reference([text]).input_ids[0]
    assert loaded.tokenizer.encode(text) == ids
    assert reference.convert_tokens_to_ids("[breath]") in ids  # a CosyVoice marker is one token
    engine = adapter_engine(loaded, num_slots=2)
    engine.add_prompt("r", loaded.voice_prompt(text), SamplingParams(temperature=0.0, max_tokens=30))
    assert engine.run_to_completion()["r"] == reference_greedy(model, ids, 30)


def test_sampling_defaults_come_from_the_yaml(tmp_path):
    directory = write_cosyvoice2_lm(tmp_path / "cv2", cosyvoice2_lm(), top_p=0.7)
    sampling = load(directory).default_sampling
    assert (sampling.top_p, sampling.top_k, sampling.ras_window, sampling.ras_tau) == (0.7, 25, 10, 0.1)
    assert CosyVoice2Adapter.default_sampling.top_p == 0.8  # the published yaml's, as the router's default


def test_a_repo_id_resolves_from_the_local_hf_cache(published, tmp_path, monkeypatch):
    model, directory = published
    cache = tmp_path / "hub"
    put_in_hf_cache(cache, COSYVOICE2_REPO, directory)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    loaded = load(COSYVOICE2_REPO)
    torch.testing.assert_close(loaded.model.llm_decoder.weight, model.llm_decoder.weight, rtol=0, atol=0)


def _drop_file(directory, name):
    (directory / name).unlink()


def _drop_key(directory, key):
    state = torch.load(directory / "llm.pt", weights_only=True)
    del state[key]
    torch.save(state, directory / "llm.pt")


def _rename_llm(directory, _):
    path = directory / "cosyvoice2.yaml"
    path.write_text(path.read_text().replace("llm.llm.Qwen2LM", "llm.llm.TransformerLM"))


@pytest.mark.parametrize(
    ("breakage", "arg", "says"),
    [
        (_drop_file, "llm.pt", "no llm.pt"),
        (_drop_file, "cosyvoice2.yaml", "no cosyvoice2.yaml"),
        (_drop_key, "speech_embedding.weight", "missing keys ['speech_embedding.weight']"),
        (_rename_llm, None, "not a Qwen2LM"),
    ],
)
def test_broken_directories_are_refused_naming_the_field(tmp_path, breakage, arg, says):
    directory = write_cosyvoice2_lm(tmp_path / "cv2", cosyvoice2_lm())
    breakage(directory, arg)
    with pytest.raises(InvalidArgumentError) as err:
        load(directory)
    assert err.value.field == "model.checkpoint_dir" and says in err.value.message
