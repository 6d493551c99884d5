"""README's "Serving a real model" commands, end to end on tiny stand-ins in the published layouts
placed in a Hugging Face cache built here (hub offline): `voxray synthesize --model <repo id>` for
Orpheus 3B (+ SNAC), CSM 1B, Dia 1.6B (+ DAC), Qwen3-TTS 0.6B and GLM-4-Voice 9B (+ its speech tokenizer and
decoder), `voxray serve --model` config resolution
(also CosyVoice 2 and Chatterbox, whose stand-ins hold their LM files: the full-size S3Gen is not written here),
`voxray models` cache status, and the missing-model errors."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import wave
from pathlib import Path

import pytest
from huggingface_hub import constants

from cluster.cli import build_parser, main, serve_config
from core.errors import InvalidArgumentError
from detok_stage.flow.glm_config import tiny_glm4_decoder_config
from detok_stage.flow.glm_model import GLM4Decoder
from llm_stage.models.chatterbox_t3 import random_voice, tiny_t3
from tests.glm4_voice_decoder_layout import write_glm4_voice_decoder
from tests.glm4_voice_layout import REPO_ID as GLM4_VOICE_REPO
from tests.glm4_voice_layout import glm4_voice_state, write_glm4_voice
from tests.glm4_voice_tokenizer_layout import REPO_ID as GLM4_VOICE_TOKENIZER_REPO
from tests.glm4_voice_tokenizer_layout import write_glm4_voice_tokenizer
from tests.published_layouts import (
    CHATTERBOX_REPO,
    COSYVOICE2_REPO,
    CSM_REPO,
    DAC_REPO,
    DIA_REPO,
    ORPHEUS_REPO,
    QWEN3_TTS_REPO,
    SNAC_REPO,
    cosyvoice2_lm,
    csm_model,
    dac_model,
    dia_model,
    orpheus_llama,
    put_in_hf_cache,
    qwen3_tts_model,
    qwen3_tts_tokenizer_model,
    snac_model,
    write_chatterbox_lm,
    write_cosyvoice2_lm,
    write_csm,
    write_dac,
    write_dia,
    write_orpheus,
    write_qwen3_tts,
    write_snac,
)
from tests.step_audio2_layout import REPO_ID as STEP_AUDIO2_REPO
from tests.step_audio2_layout import step_audio2_model, token2wav_model, write_step_audio2

ROOT = Path(__file__).resolve().parents[2]
GLM4_VOICE_DECODER_REPO = "THUDM/glm-4-voice-decoder"


@pytest.fixture(scope="module")
def full_cache(tmp_path_factory) -> Path:
    """An HF cache holding the published repos (as tiny stand-ins)."""
    work, cache = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("hub")
    writers = {
        ORPHEUS_REPO: lambda d: write_orpheus(d, orpheus_llama()),
        SNAC_REPO: lambda d: write_snac(d, snac_model()),
        CSM_REPO: lambda d: write_csm(d, csm_model()),
        DIA_REPO: lambda d: write_dia(d, dia_model()),
        DAC_REPO: lambda d: write_dac(d, dac_model()),
        QWEN3_TTS_REPO: lambda d: write_qwen3_tts(d, qwen3_tts_model(), qwen3_tts_tokenizer_model()),
        COSYVOICE2_REPO: lambda d: write_cosyvoice2_lm(d, cosyvoice2_lm()),
        CHATTERBOX_REPO: lambda d: write_chatterbox_lm(d, t3 := tiny_t3(), random_voice(t3.layout)),
        GLM4_VOICE_REPO: lambda d: write_glm4_voice(d, glm4_voice_state()),
        GLM4_VOICE_TOKENIZER_REPO: write_glm4_voice_tokenizer,
        GLM4_VOICE_DECODER_REPO: lambda d: write_glm4_voice_decoder(
            d, GLM4Decoder.seeded(tiny_glm4_decoder_config(), 0)
        ),
        STEP_AUDIO2_REPO: lambda d: write_step_audio2(d, step_audio2_model(), token2wav_model()),
    }
    for repo, write in writers.items():
        put_in_hf_cache(cache, repo, write(work / repo.replace("/", "--")))
    return cache


def use_cache(monkeypatch, cache: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


@pytest.mark.parametrize(
    ("repo", "voice", "text", "rate"),
    [
        (ORPHEUS_REPO, "tara", "Hello from a cached Orpheus.", 24000),
        (CSM_REPO, "0", "Hello from a cached CSM.", 24000),
        (DIA_REPO, None, "[S1] Hello from a cached Dia.", 44100),
        (QWEN3_TTS_REPO, "aiden", "Hello from a cached Qwen3-TTS.", 24000),
        (GLM4_VOICE_REPO, None, "Hello from a cached GLM-4-Voice.", 22050),  # + its speech tokenizer and decoder
    ],
)
def test_synthesize_with_a_repo_id_from_the_cache(tmp_path, monkeypatch, full_cache, repo, voice, text, rate):
    use_cache(monkeypatch, full_cache)
    out = tmp_path / "out.wav"
    argv = ["synthesize", "--model", repo, "--text", text, "--max-tokens", "28", "-o", str(out)]
    assert main(argv + (["--voice", voice] if voice else [])) == 0
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == rate and wav.getnframes() > 0


def test_serve_model_flag_resolves_repo_ids_before_deploying(monkeypatch, full_cache):
    use_cache(monkeypatch, full_cache)
    config = serve_config(build_parser().parse_args(["serve", "--model", ORPHEUS_REPO]))
    model = config.engine.model
    assert (model.name, model.checkpoint_dir, model.codec_dir) == ("orpheus", ORPHEUS_REPO, None)
    assert model.torch_threads == 1  # the rest of the config's model section is kept
    config = serve_config(build_parser().parse_args(["serve", "--model", DIA_REPO, "--codec", DAC_REPO]))
    assert (config.engine.model.name, config.engine.model.codec_dir) == ("dia", DAC_REPO)


def test_missing_model_and_missing_codec_name_the_download_command(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "hub"
    cache.mkdir()
    use_cache(monkeypatch, cache)
    assert main(["synthesize", "--model", ORPHEUS_REPO, "--text", "x"]) == 2
    assert f"hf download {ORPHEUS_REPO}" in capsys.readouterr().err
    put_in_hf_cache(cache, ORPHEUS_REPO, write_orpheus(tmp_path / "orpheus", orpheus_llama()))
    assert main(["synthesize", "--model", ORPHEUS_REPO, "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert "model.codec_dir" in err and f"hf download {SNAC_REPO}" in err
    with pytest.raises(InvalidArgumentError, match=f"hf download {CSM_REPO}"):  # serve fails before Ray starts
        serve_config(build_parser().parse_args(["serve", "--model", CSM_REPO]))


def test_models_lists_families_and_their_cache_status_from_the_environment(full_cache):
    env = {**os.environ, "HF_HUB_CACHE": str(full_cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "models"], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    for family in ("orpheus", "csm", "dia", "parallel-heads", "qwen3-tts", "glm4-voice"):
        assert f"\n{family}  (and {family}-tiny" in f"\n{out}"
    assert f"speech tokenizer:  {GLM4_VOICE_TOKENIZER_REPO}  (in the local cache" in out
    assert f"{ORPHEUS_REPO}  (in the local cache: {full_cache}" in out
    assert f"{SNAC_REPO}  (in the local cache" in out and f"{DAC_REPO}  (in the local cache" in out
    assert "voices: tara, leah, jess, leo, dan, mia, zac, zoe" in out and "24000 Hz; 11.72 codec frames/s" in out
    assert "our own layout" in out


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Serving a real model")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_readme_real_model_commands_run_on_the_stand_ins(tmp_path, monkeypatch, full_cache):
    """Every repo README tells to download is one a family declares, and every serve / synthesize
    line in the section resolves (serve) or runs (synthesize) against the cache of stand-ins."""
    from llm_stage.registry import families

    use_cache(monkeypatch, full_cache)
    section = readme_section()
    downloads = set(re.findall(r"hf download (\S+)\n", section))
    declared = {repo for f in families() for repo in (f.repo_id, f.codec_repo_id, f.speech_tokenizer_repo_id) if repo}
    assert downloads == declared == {ORPHEUS_REPO, SNAC_REPO, CSM_REPO, DIA_REPO, DAC_REPO, QWEN3_TTS_REPO,
                                     COSYVOICE2_REPO, CHATTERBOX_REPO, GLM4_VOICE_REPO, GLM4_VOICE_TOKENIZER_REPO,
                                     GLM4_VOICE_DECODER_REPO, STEP_AUDIO2_REPO}  # fmt: skip
    serves = re.findall(r"voxray serve (.+)\n", section)
    assert {shlex.split(line)[1] for line in serves} == {ORPHEUS_REPO, CSM_REPO, DIA_REPO, QWEN3_TTS_REPO,
                                                         COSYVOICE2_REPO, CHATTERBOX_REPO, GLM4_VOICE_REPO,
                                                         STEP_AUDIO2_REPO}  # fmt: skip
    for line in serves:
        serve_config(build_parser().parse_args(["serve", *shlex.split(line)]))
    (synth,) = re.findall(r"voxray (synthesize .+)\n", section)
    argv = [arg if arg != "hello.wav" else str(tmp_path / "hello.wav") for arg in shlex.split(synth)]
    assert main([*argv, "--max-tokens", "14"]) == 0 and (tmp_path / "hello.wav").is_file()


def test_a_config_file_takes_repo_ids_and_fills_in_the_published_codec(tmp_path, monkeypatch, full_cache):
    from core.config import load_serve_config
    from llm_stage.registry import check_model_config

    use_cache(monkeypatch, full_cache)
    path = tmp_path / "serve.yaml"
    path.write_text(f"engine:\n  model:\n    name: orpheus\n    checkpoint_dir: {ORPHEUS_REPO}\n")
    model = load_serve_config(path).engine.model
    entry = check_model_config(model)
    assert entry.with_defaults(model).codec_dir == SNAC_REPO
    codec = entry.build_codec(model, "cpu")
    assert codec.noise_keys is not None  # the published SNAC config's noise blocks, keyed per frame


def test_model_flag_takes_a_directory_and_rejects_one_of_no_known_family(monkeypatch, full_cache):
    from core.checkpoints import resolve_model_ref
    from llm_stage.registry import model_config_for

    use_cache(monkeypatch, full_cache)
    directory = resolve_model_ref(CSM_REPO)
    model = model_config_for(str(directory))
    assert (model.name, model.checkpoint_dir) == ("csm", str(directory))
    with pytest.raises(InvalidArgumentError, match="no checkpoint of a known family") as err:
        model_config_for(str(resolve_model_ref(SNAC_REPO)))  # a codec is no model
    assert err.value.field == "model"
