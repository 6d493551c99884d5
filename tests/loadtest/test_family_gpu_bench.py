"""loadtest/family_gpu_bench: the published sizes it patches in, and its smoke run on CPU (every section of a
guided and an unguided family end to end on the tiny presets, then CosyVoice 2's voxserve_setting; no timing
asserted: figures come from a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

import llm_stage.models.chatterbox_t3 as chatterbox_t3
import llm_stage.models.csm as csm
import llm_stage.models.qwen3_tts as qwen3_tts
from detok_stage.codecs import s3gen_codec
from llm_stage.models.qwen3_tts_talker import TalkerSpec
from loadtest import family_gpu_bench
from loadtest.family_sections import never_stopping
from loadtest.family_shapes import ENTRIES, entry_named, published_shapes
from loadtest.family_voxserve import VOXSERVE_SAMPLING

SMOKE_RUN = [
    "--device", "cpu", "--small", "--budget-s", "600", "--entries", "dia-1.6b", "parallel-heads-1.7b",
    "--rows", "2", "--eager-rows", "2", "--detok-batches", "1", "2", "--detok-window-s", "0.2",
    "--rates", "1", "--arrival-s", "1", "--rate-cap-s", "8", "--stream-audio-s", "0.3",
    "--throughput-requests", "1", "--cfg-streams", "2", "--cfg-tokens", "12", "--c1-repeats", "2",
]  # fmt: skip
VOXSERVE_RUN = [
    "--device", "cpu", "--small", "--entries", "cosyvoice2-0.5b", "--skip",
    *(name for name, *_ in family_gpu_bench.SECTIONS), "--stream-audio-s", "1.6", "--arrival-s", "1",
    "--rate-cap-s", "8", "--voxserve-rates", "1", "--voxserve-s", "30",
]  # fmt: skip


def test_every_section_of_a_guided_and_a_plain_family_runs_on_cpu(tmp_path, capsys):
    family_gpu_bench.main([*SMOKE_RUN, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "family_gpu_bench.json").read_text())
    assert set(report["families"]) == {"dia-1.6b", "parallel-heads-1.7b"}
    for key, family in report["families"].items():
        assert "error" not in family, family.get("trace")
        for name, *_ in family_gpu_bench.SECTIONS:
            assert family[name]["ok"] is True, (key, name, family[name].get("error"))
        assert family["gpu_check"]["skipped"].startswith("n/a (cpu")
        steps = {(r["mode"], r["rows"]): r for r in family["step_ms"]["results"]}
        assert set(steps) == {("graphs", 2), ("eager", 2)}
        assert all(r["step_ms"] > 0 and r["rows_per_step"] == 2 for r in steps.values())
        assert set(family["detok_cost"]["by_batch"]) == {"1", "2"}
        assert all(b["ms_per_audio_s"] > 0 for b in family["detok_cost"]["by_batch"].values())
        streaming = family["streaming"]
        assert len(streaming["c1_ttfa_s"]) == 2 and streaming["one_stream"]["audio_s"] > 0
        assert streaming["rates"]["1"]["sent"] >= 1 and "capacity_at_slo_rps" in streaming
        assert family["throughput"]["requests"] == 1
    guided = report["families"]["dia-1.6b"]["cfg_retention"]["by_streams"]["2"]
    assert guided["retention"] > 0 and guided["cfg"]["tokens_per_s"] > 0
    assert report["families"]["parallel-heads-1.7b"]["cfg_retention"]["skipped"] == "no CFG in this family"
    assert "voxserve_setting" not in report["families"]["dia-1.6b"]  # CosyVoice 2's section only
    assert "=== family_gpu_bench ===" in capsys.readouterr().out
    # CosyVoice 2 at VoxServe's setting, its section alone (40-token streams: two 15-token chunks, then the last)
    family_gpu_bench.main([*VOXSERVE_RUN, "--out", str(tmp_path / "vxs")])
    family = json.loads((tmp_path / "vxs" / "family_gpu_bench.json").read_text())["families"]["cosyvoice2-0.5b"]
    section = family["voxserve_setting"]
    assert section["ok"] is True, section.get("trace")
    assert all(family[name]["skipped"] == "--skip" for name, *_ in family_gpu_bench.SECTIONS)
    assert section["setting"]["sampling"] == VOXSERVE_SAMPLING and section["slo"]["viable_pct"] == 100.0
    assert section["chunk"]["chunk_tokens_sent"] == 15 and section["chunk"]["flow_attention_chunk"] == 25
    assert section["rates"]["1"]["sent"] >= 1 and section["rates"]["1"]["finished"] >= 1
    assert "capacity_at_slo_rps" in section and len(section["c1_ttfa_s"]) == 2
    assert "at VoxServe's setting" in capsys.readouterr().out


def test_published_shapes_are_the_published_sizes_and_are_undone():
    with published_shapes(entry_named("csm-1b")):
        config = csm.tiny_csm_config()
    assert (config.num_hidden_layers, config.hidden_size, config.num_codebooks) == (16, 2048, 32)
    assert config.depth_decoder_config.num_hidden_layers == 4 and config.codec_config.num_quantizers == 32
    assert csm.tiny_csm_config().hidden_size == 64  # the preset again outside the block
    for key, hidden in (("qwen3-tts-0.6b", 1024), ("qwen3-tts-1.7b", 2048)):
        with published_shapes(entry_named(key)):
            spec = TalkerSpec.from_config(qwen3_tts.tiny_qwen3_tts_config())
        assert (spec.talker["hidden_size"], spec.talker["num_hidden_layers"], spec.num_codebooks) == (hidden, 28, 16)
        assert spec.predictor["num_hidden_layers"] == 5 and spec.talker["codec_eos_token_id"] > 2048
    with published_shapes(entry_named("chatterbox")):
        body, s3gen = chatterbox_t3.tiny_llama_config(), s3gen_codec.served_tiny_s3gen_config()
    assert (body.num_hidden_layers, body.hidden_size, s3gen.encoder.num_blocks, s3gen.chunk_tokens) == (30, 1024, 6, 25)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.key)
def test_every_patch_names_an_existing_attribute(entry):
    for module, name, _value in entry.patches():
        assert hasattr(module, name), f"{module.__name__}.{name} is gone: {entry.key} would build the tiny preset"


def test_never_stopping_restores_the_adapters_own_stop_rule():
    from core.config import ModelConfig
    from llm_stage.registry import get_entry

    adapter = get_entry("parallel-heads-tiny").build_lm(ModelConfig(name="parallel-heads-tiny"))
    eos = (adapter.layout.eos_id,) * adapter.num_codebooks
    with never_stopping(adapter):
        assert adapter.is_stop(None, eos) is False
    assert "is_stop" not in vars(adapter)  # the class's rule again


def test_presets_made_on_a_device_go_through_every_preset_caller(monkeypatch):
    """On a GPU the presets are built under the device (`presets_on`): each caller's arguments pass through
    (`field=` included), so the same seeded preset comes out; here on the CPU, compared with a plain build."""
    from core.config import ModelConfig
    from llm_stage.registry import get_entry
    from loadtest import family_shapes

    built_on = []
    made_on = family_shapes.made_on
    monkeypatch.setattr(
        family_shapes, "made_on", lambda device, build: built_on.append(device) or made_on(device, build)
    )
    config = ModelConfig(name="dia-tiny")
    entry = get_entry("dia-tiny")
    with family_shapes.patched_all(family_shapes.presets_on("cpu")):
        made = entry.build_lm(config), entry.build_codec(config, "cpu")
    assert built_on == ["cpu", "cpu"]  # Dia's LM and its DAC
    plain = entry.build_lm(config), entry.build_codec(config, "cpu")
    for ours, theirs in zip((made[0].model, made[1].model), (plain[0].model, plain[1].model), strict=True):
        for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_a_stateless_codecs_window_graph_is_timed_beside_eager_and_compared(monkeypatch):
    """detok_cost on CUDA also replays the codec's window graph (what a detok replica serves): its ms and
    its largest difference from eager. On the CPU no graph is built; the figures come from a stand-in cache
    that runs the function it would capture."""
    from types import SimpleNamespace

    from detok_stage.codecs.dac_codec import DacCodec
    from loadtest import family_sections

    codec = DacCodec(DacCodec.preset())
    run = SimpleNamespace(codec=codec, args=SimpleNamespace(device="cpu", detok_repeats=1), synchronize=lambda: None)
    assert family_sections.window_graphs(run) is None  # CPU: eager only

    class StandIn:
        def __init__(self, fn, name):
            self.fn = fn

        def capture(self, inputs):
            return True

        def __call__(self, frames):
            return self.fn(frames)

    monkeypatch.setattr(family_sections, "graphs_available", lambda device: True)
    monkeypatch.setattr(family_sections, "GraphCache", StandIn)
    graphs = family_sections.window_graphs(run)
    codes = torch.randint(0, codec.codebook_size, (2, 5, codec.codes_per_frame))
    figures = family_sections.graph_figures(run, graphs, codes, audio_s=1.0)
    assert figures["graphs_max_abs_diff"] == 0.0 and figures["graphs_ms"] > 0


def test_a_codec_with_its_own_graphs_is_timed_streamed_eager_then_through_them(monkeypatch):
    """S3Gen's detok_cost also times streamed chunk rounds, eager and (on CUDA) through the flow's graphs,
    with their largest difference. On the CPU the graphs' padded forward stands in for the replay."""
    from types import SimpleNamespace

    from detok_stage.codecs.s3gen_codec import S3GenCodec
    from detok_stage.flow.config import tiny_s3gen_config
    from detok_stage.flow.model import S3Gen
    from loadtest import family_sections

    codec = S3GenCodec(S3Gen.seeded(tiny_s3gen_config(), 2))
    assert family_sections.has_own_graphs(codec) and not family_sections.has_own_graphs(s3gen_codec.CodecAdapter)
    run = SimpleNamespace(codec=codec, args=SimpleNamespace(device="cpu", detok_batches=[1, 3]),
                          time_left_s=lambda: 60.0)  # fmt: skip
    eager = family_sections.streamed_section(run)
    assert eager["graphs"] is False and eager["by_batch"]["3"]["eager_ms_per_audio_s"] > 0
    monkeypatch.setattr(family_sections, "graphs_available", lambda device: True)
    section = family_sections.streamed_section(run)
    row = section["by_batch"]["3"]
    assert section["graphs"] is True and row["graphs_ms_per_audio_s"] > 0 and row["graphs_max_abs_diff"] < 1e-4
    assert codec.model.flow.graphs.num_runs > 0  # the padded path ran
