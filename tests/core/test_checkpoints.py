"""Model references: a local directory, or a repo id resolved offline from a Hugging Face cache built
in the test; a missing model is an error naming the field and the download command."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import constants

from core.checkpoints import load_or_preset, load_prefixed_state, resolve_model_ref, shared
from core.errors import InvalidArgumentError
from tests.published_layouts import put_in_hf_cache


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache as the process default, with the hub offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_repo_id_resolves_to_its_snapshot_in_the_cache(tmp_path, hf_cache):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "sub" / "x.txt").write_text("x")
    snapshot = put_in_hf_cache(hf_cache, "someone/some-model", source)
    resolved = resolve_model_ref("someone/some-model")
    assert resolved == snapshot
    assert (resolved / "config.json").read_text() == '{"model_type": "llama"}' and (resolved / "sub/x.txt").is_file()
    assert resolve_model_ref(tmp_path / "src") == source  # a local directory is taken as it is
    assert resolve_model_ref("someone/some-model", cache_dir=hf_cache) == snapshot


def test_missing_repo_names_the_field_and_the_download_command(hf_cache):
    with pytest.raises(InvalidArgumentError) as err:
        resolve_model_ref("canopylabs/orpheus-3b-0.1-ft", field="model.checkpoint_dir")
    assert err.value.field == "model.checkpoint_dir"
    assert "`hf download canopylabs/orpheus-3b-0.1-ft`" in err.value.message
    assert "huggingface-cli download canopylabs/orpheus-3b-0.1-ft" in err.value.message
    assert str(hf_cache) in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        load_or_preset("hubertsiuzdak/snac_24khz", load=str, preset=str, seed=0, field="model.codec_dir")
    assert err.value.field == "model.codec_dir" and "hf download hubertsiuzdak/snac_24khz" in err.value.message


def test_a_path_that_is_no_directory_nor_repo_id_is_rejected(tmp_path):
    with pytest.raises(InvalidArgumentError, match="not a directory, nor a Hugging Face repo id"):
        resolve_model_ref(tmp_path / "a" / "b" / "c")


def test_prefixed_state_reads_only_the_shards_that_hold_it(tmp_path):
    from transformers import MimiConfig, MimiModel

    from detok_stage.codecs.mimi_codec import tiny_mimi_config

    mimi = MimiModel(MimiConfig(**tiny_mimi_config(4)))
    wrapper = torch.nn.Module()
    wrapper.codec_model, wrapper.other = mimi, torch.nn.Linear(300, 300)
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in wrapper.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    got = load_prefixed_state(tmp_path, "codec_model.")
    assert got.keys() == mimi.state_dict().keys()


def test_shared_builds_once_while_held():
    calls = []

    def build():
        calls.append(1)
        return torch.nn.Linear(1, 1)

    first = shared(("test-shared",), build)
    assert shared(("test-shared",), build) is first and len(calls) == 1
