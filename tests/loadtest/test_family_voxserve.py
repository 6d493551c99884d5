"""loadtest/family_voxserve (CosyVoice 2 at VoxServe's setting): every request the sweep makes carries exactly
VoxServe's sampling and the one reference voice; the 100%-viable SLO rule rejects a rate with one non-viable
stream (where the family bench's 99% rule takes it); and where audio leaves under 15-token chunks is where the
real S3Gen codec lets it out."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from cluster.pipeline import InProcessPipeline
from core.messages import SamplingParams
from llm_stage.chunking import Chunker
from loadtest import family_gpu_bench, family_sections
from loadtest.family_sections import FAMILY_SLO, RatePoint, rates_at
from loadtest.family_shapes import entry_named
from loadtest.family_voxserve import (
    VOXSERVE_SAMPLING,
    VOXSERVE_SLO,
    FixedSetting,
    chunk_schedule,
    engine_config,
    reference_voice,
    register_voice,
    release_points,
)
from loadtest.gpu_bench_pipeline import RateRun, rate_summary
from loadtest.metrics import highest_rate_meeting
from router.playback import PlaybackTracker


def cosyvoice2_run(tmp_path) -> family_gpu_bench.FamilyRun:
    args = family_gpu_bench.parse_args(["--out", str(tmp_path), "--device", "cpu", "--small"])
    run = family_gpu_bench.FamilyRun(args, entry_named("cosyvoice2-0.5b"), {})
    family_gpu_bench.build_on_device(run)
    run.args = family_gpu_bench.family_args(args, run)
    return run


def test_every_request_carries_voxserves_sampling_and_the_one_voice(tmp_path):
    run = cosyvoice2_run(tmp_path)
    voice = register_voice(run)
    with family_gpu_bench.patched_all(family_gpu_bench.cached_builds(run)):
        pipe = InProcessPipeline(engine_config(run, 15))
    try:
        driven = FixedSetting(pipe, voice.voice_id, dict(VOXSERVE_SAMPLING))
        for i in range(3):  # as the sweep submits: its own max_tokens and seed, no voice
            driven.submit(f"r{i}", f"Request number {i}.", None, {"max_tokens": 20, "seed": i})
        engine = pipe.llm.engine
        for i in range(3):
            req = engine.requests[f"r{i}"]
            want = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1, "ras_window": 0,
                    "repetition_window": 0, "min_p": 0.0, "max_tokens": 20, "seed": i}  # fmt: skip
            assert {name: getattr(req.sampling, name) for name in want} == want
            assert not req.sampling.is_repetition_aware  # the plain draw, not cosyvoice2's default RAS
            assert req.sampling == SamplingParams.resolve({**VOXSERVE_SAMPLING, "max_tokens": 20, "seed": i},
                                                          run.adapter.default_sampling)  # fmt: skip
            speech = [t[0] for t in req.prompt_ids[-len(voice.prompt_tokens) :]]
            assert speech == list(voice.prompt_tokens)  # the voice's prompt speech ends every prompt
            assert pipe.llm.voice_handles[f"r{i}"] == voice.voice_id  # and conditions its flow
        assert run.codec.has_voice(voice.voice_id) and engine._histories is not None
        chunks = pipe.llm.schedule
        assert (chunks.first_chunk_frames, chunks.chunk_frames, chunks.right_context_frames) == (15, 15, 3)
    finally:
        pipe.close()


def streams(count: int, late: int | None) -> RateRun:
    """`count` finished streams of two 1 s chunks; stream `late`'s second chunk comes 0.4 s after its first ran out."""
    run = RateRun([0.1 * i for i in range(count)])
    for i in range(count):
        tracker = run.trackers[f"s{i}"] = PlaybackTracker(0.0)
        tracker.on_chunk(0.2, 1.0)
        tracker.on_chunk(1.6 if i == late else 0.5, 1.0)
        run.finished.add(f"s{i}")
    return run


def test_the_100_pct_rule_rejects_a_rate_with_one_non_viable_stream():
    clean = RatePoint(4.0, rate_summary(streams(200, None), 10.0, 15.0))
    one_late = RatePoint(8.0, rate_summary(streams(200, late=0), 10.0, 15.0))
    assert clean.figures["viable_pct"] == 100.0 and one_late.figures["viable_pct"] == 99.5
    assert one_late.figures["p90_ttfa_s"] == 0.2  # TTFA alone would pass
    assert VOXSERVE_SLO.met(clean) and not VOXSERVE_SLO.met(one_late)
    assert FAMILY_SLO.met(one_late)  # the family bench's 99% rule takes it
    assert highest_rate_meeting([clean, one_late], VOXSERVE_SLO.met) == 4.0
    assert highest_rate_meeting([clean, one_late], FAMILY_SLO.met) == 8.0


def test_rates_above_a_miss_are_skipped(monkeypatch):
    viable = {4.0: 100.0, 8.0: 97.9, 12.0: 100.0}
    played = []
    monkeypatch.setattr(family_sections, "play_rate", lambda pipe, rate, args, cap_s: (played.append(rate), rate))
    figures = {rate: {"p90_ttfa_s": 0.3, "viable_pct": pct} for rate, pct in viable.items()}
    monkeypatch.setattr(family_sections, "rate_summary", lambda _, rate, cap_s: figures[rate])
    run = SimpleNamespace(args=SimpleNamespace(rate_cap_s=15.0, arrival_s=4.0, stream_audio_s=5.0),
                          time_left_s=lambda: 60.0, say=lambda text: None,
                          entry=SimpleNamespace(key="cosyvoice2-0.5b"))  # fmt: skip
    out = rates_at(run, None, [4.0, 8.0, 12.0], VOXSERVE_SLO, stop_after_miss=True)
    assert played == [4.0, 8.0] and out["rates"]["12"] == {"skipped": "a lower rate missed the SLO"}
    assert out["capacity_at_slo_rps"] == 4.0


def test_a_rate_runs_only_with_the_time_its_streams_need_to_play_out(monkeypatch):
    """16 s left for three rates of 10 s each (4 s of arrivals, 5 s streams): the lowest gets its 10 s, not a
    third of what is left (its streams cut short would read as not viable), the others are skipped."""
    clock = {"left_s": 16.0}
    caps = []

    def fake_play(pipe, rate, args, cap_s):
        caps.append(cap_s)
        clock["left_s"] -= cap_s
        return rate, cap_s

    monkeypatch.setattr(family_sections, "play_rate", fake_play)
    monkeypatch.setattr(family_sections, "rate_summary", lambda rate, wall_s, cap_s: {"p90_ttfa_s": 0.2,
                                                                                      "viable_pct": 100.0})
    run = SimpleNamespace(args=SimpleNamespace(rate_cap_s=15.0, arrival_s=4.0, stream_audio_s=5.0),
                          time_left_s=lambda: clock["left_s"], say=lambda text: None,
                          entry=SimpleNamespace(key="csm-1b"))  # fmt: skip
    out = rates_at(run, None, [2.0, 4.0, 8.0], FAMILY_SLO)
    assert caps == [10.0] and out["capacity_at_slo_rps"] == 2.0
    assert out["rates"]["4"] == out["rates"]["8"] == {"skipped": "out of time: a rate needs 10 s, 6 s left"}


def test_audio_leaves_where_the_real_codec_lets_it_out():
    """15-token chunks through the tiny S3Gen codec (25-token flow chunks, as published) with the reference
    voice: the chunks that carry audio, and how much, are `release_points`'."""
    from core.config import ModelConfig
    from detok_stage.flow.hift import F0_RADIUS
    from llm_stage.registry import get_entry

    codec = get_entry("cosyvoice2-tiny").build_codec(ModelConfig(name="cosyvoice2-tiny"), "cpu")
    prompt, conditioning = reference_voice(codec, "cosyvoice2-tiny")
    codec.add_voice(conditioning)
    schedule, total = chunk_schedule(15), 100
    chunker = Chunker("r", schedule)
    tokens = torch.randint(0, 6561, (total,), generator=torch.Generator().manual_seed(1)).tolist()
    audio_s, seen = 0.0, []
    for n, token in enumerate(tokens, start=1):
        for chunk in chunker.push([[token]]):
            wave = codec.decode_stream([dataclasses.replace(chunk, voice_handle=prompt.voice_id)])[0]
            if wave.numel():
                audio_s += wave.numel() / codec.sample_rate_hz
                seen.append({"cut_at_tokens": n, "audio_s": round(audio_s, 3)})
    hift, config = codec.model.mel2wav, codec.config
    held = hift.decode_radius + F0_RADIUS
    want = release_points(schedule, len(prompt.prompt_tokens), config.chunk_tokens, config.pre_lookahead_len,
                          config.token_mel_ratio, held, config.hift.sampling_rate / hift.hop, total - 3)  # fmt: skip
    assert seen == want and want  # audio leaves only with the chunks that complete a 25-token flow chunk
    assert config.chunk_tokens == 25 and all(p["cut_at_tokens"] % 15 == 3 for p in want)
