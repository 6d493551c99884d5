"""The `voxray` command line: synthesize in-process, serve the cluster, talk to it, list models, plan a fleet.

Sub-commands build their config from flags or `--config FILE` and hand off to the engines,
the app builder or the gRPC client; bad input exits with the offending field named.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from core.checkpoints import cached_snapshot, download_command
from core.config import AdmissionConfig, DetokConfig, EngineConfig, ServeConfig, load_engine_config, load_serve_config
from core.errors import InvalidArgumentError
from llm_stage.models.base import ModelFamily
from llm_stage.registry import check_engine_config, families, model_config_for


def _synthesize(args: argparse.Namespace) -> int:
    from cluster.pipeline import InProcessPipeline
    from router.audio_format import write_wav

    if args.config:
        config = load_engine_config(args.config)
    else:
        model = model_config_for(args.model, args.codec)
        config = EngineConfig(model=model, detok=DetokConfig(schedule=args.schedule))
    pipeline = InProcessPipeline(config)
    sampling = {"seed": args.seed, "max_tokens": args.max_tokens} if args.max_tokens else {"seed": args.seed}
    start = time.perf_counter()
    pcm = pipeline.synthesize(args.text, args.voice, sampling)
    elapsed = time.perf_counter() - start
    rate = pipeline.detok.codec.sample_rate_hz
    write_wav(args.output, pcm, rate)
    audio_s = len(pcm) / 2 / rate
    print(f"wrote {args.output}: {audio_s:.2f} s of audio in {elapsed:.2f} s ({audio_s / elapsed:.2f}x real time)")
    return 0


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig `voxray serve` deploys: `--config` (or the default), its model replaced by
    `--model` / `--codec`; model references are resolved here, so a missing model fails before Ray starts."""
    config = load_serve_config(args.config) if args.config else ServeConfig()
    if args.model is not None and config.models:
        raise InvalidArgumentError("--model", f"{args.config} lists its models (models:); edit them there")
    if args.model is not None:
        kept = config.engine.model.model_dump(exclude={"name", "checkpoint_dir", "codec_dir"})
        engine = config.engine.model_copy(update={"model": model_config_for(args.model, args.codec, **kept)})
        config = ServeConfig.model_validate({**config.model_dump(), "engine": engine.model_dump()})
    from deployments.voices import check_default_clip, check_voice_encoders  # (imports Ray: only where needed)

    for served in config.served_models():
        view = config.for_model(served)
        check_engine_config(view.engine)
        no_voices = check_voice_encoders(view)  # raises for a wrong voices.encoder_dir
        if no_voices is not None:
            print(f"note: {view.engine.model.name} serves without zero-shot voices: {no_voices}", file=sys.stderr)
    check_default_clip(config, read_clip=True)  # (its encoding: at each detok replica's start)
    return config


def _serve(args: argparse.Namespace) -> int:
    from cluster.server import deploy

    config = serve_config(args)
    stop = _StopSignal()
    if not args.no_block:
        stop.listen()  # from now on: a SIGTERM while deploying drains as soon as the app is up
    endpoints = deploy(config, address=args.address)
    names = ", ".join(served.engine.model.name for served in config.served_models())
    print(f"VoxRay serving {names} (app {endpoints.app_name!r})")
    tls = " over TLS" if config.tls.enabled else ""
    print(f"  gRPC: {endpoints.grpc_target}{tls}  (app {endpoints.app_name}; metadata application= optional)")
    print(f"  HTTP: {endpoints.http_url}/v1/audio/speech   health: {endpoints.http_url}/healthz")
    print("Ctrl-C or SIGTERM to stop (streams playing get up to drain.grace_s to finish).", flush=True)
    if args.no_block:
        return 0
    stop.wait()
    return _stop(config, joined=args.address is not None)


class _StopSignal:
    """SIGTERM (what Kubernetes and most supervisors send) or SIGINT, noted from `listen` on."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def listen(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda signum, frame: self.requested.set())

    def wait(self) -> None:
        """Block until a stop signal has come; later ones are ignored (they must not cut the drain short)."""
        while not self.requested.wait(0.2):
            pass
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)


def _stop(config: ServeConfig, joined: bool) -> int:
    """Drain the app, then remove it (a joined cluster) or stop Serve and the embedded Ray."""
    from ray import serve

    from cluster.drain import drain
    from cluster.server import shutdown

    print(f"stopping: draining streams (up to {config.drain.grace_s:.0f} s)", flush=True)
    report = drain(config.app_name, config.drain.grace_s)
    print(f"drained in {report.drained_s:.1f} s ({report.open_streams_left} still open at the end)", flush=True)
    if joined:
        serve.delete(config.app_name)
    else:
        shutdown(reap=True)
    return 0


def _drain(args: argparse.Namespace) -> int:
    """`voxray drain`: drain an app on a running cluster and wait (the head pod's preStop hook), or with
    --move-out-node hand this node's LLM streams, KV included, to the other replicas (a worker pod's)."""
    import ray

    from cluster.drain import drain, move_out_node

    ray.init(address=args.address, log_to_driver=False)
    if args.move_out_node:
        moved = move_out_node(args.app, args.grace_s)
        print(f"moved the streams of {len(moved.replicas)} LLM replicas in {moved.moved_s:.1f} s "
              f"({moved.streams_left} still there at the end)")  # fmt: skip
        return 0
    report = drain(args.app, args.grace_s)
    print(f"drained {args.app!r} in {report.drained_s:.1f} s ({report.open_streams_left} still open at the end)")
    return 0


def _say(args: argparse.Namespace) -> int:
    """`voxray say`: TEXT spoken to a WAV; with `--audio`, the model's answer to a clip (its text printed,
    its speech written unless `--text-only`), or the clip's transcript (`--transcribe`)."""
    if args.incremental:
        if args.audio is not None:
            raise InvalidArgumentError("--incremental", "types text in: it takes no --audio")
        return _say_incremental(args)
    import grpc

    _check_say_args(args)
    try:
        ca = args.tls_ca.read_bytes() if args.tls_ca else None
        return _transcribe(args, ca) if args.transcribe else _speak(args, ca)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1


def _check_say_args(args: argparse.Namespace) -> None:
    if (args.text_only or args.transcribe) and args.audio is None:
        flag = "--text-only" if args.text_only else "--transcribe"
        raise InvalidArgumentError(flag, "needs --audio FILE: it answers a clip")
    if args.audio is None and not args.text:
        raise InvalidArgumentError("text", "required (or --audio FILE for a clip to answer)")
    if args.audio is not None and not args.audio.is_file():
        raise InvalidArgumentError("--audio", f"{args.audio} is not a file")


def _speak(args: argparse.Namespace, ca: bytes | None) -> int:
    from cluster.client import make_request, result_wav, synthesize, wav_input

    sampling = {"seed": args.seed, **({"max_tokens": args.max_tokens} if args.max_tokens else {})}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    speech_in = {"input_audio": wav_input(args.audio), "text_only": args.text_only} if args.audio else {}
    request = make_request(args.text, model=args.model, voice=args.voice or "", format=0,  # PCM16: WAV built here
                           sampling=sampling, **speech_in)  # fmt: skip
    result = synthesize(args.target, args.app, request, ca)
    if result.text:
        print(result.text)
    if args.text_only:
        return 0
    Path(args.output).write_bytes(result_wav(result))
    audio_s = len(result.pcm16) / 2 / max(1, result.sample_rate_hz)
    ttfa = result.ttfa_s
    print(f"wrote {args.output}: {audio_s:.2f} s of audio; TTFA {ttfa * 1000:.0f} ms" if ttfa else "no audio")
    return 0


def _transcribe(args: argparse.Namespace, ca: bytes | None) -> int:
    from cluster.client import transcribe, wav_input
    from protos import voxray_pb2

    request = voxray_pb2.TranscribeRequest(audio=wav_input(args.audio), model=args.model, language=args.language,
                                           prompt=args.text, temperature=args.temperature or 0.0)  # fmt: skip
    response = transcribe(args.target, args.app, request, ca)
    print(response.text)
    print(f"({response.duration_s:.2f} s of audio, language {response.language})", file=sys.stderr)
    return 0


def _say_incremental(args: argparse.Namespace) -> int:
    """Type the text into the WebSocket word by word; print each piece's time to its first audio."""
    from cluster.incremental_client import type_text
    from router.audio_format import wav_bytes

    sampling = {"seed": args.seed, **({"max_tokens": args.max_tokens} if args.max_tokens else {})}
    config = {"voice": args.voice or "", "sampling": sampling}
    result = type_text(args.url, args.text, config, args.pace)
    for piece, sent_s, wait_s in zip(result.pieces, result.piece_sent_s, result.piece_latencies_s(), strict=True):
        waited = f"first audio +{wait_s * 1000:.0f} ms" if wait_s is not None else "no audio"
        print(f"{sent_s * 1000:7.0f} ms  {piece.strip()!r:24} {waited}")
    if result.error is not None:
        print(f"error: {result.error.get('code')}: {result.error.get('message')}", file=sys.stderr)
        return 1
    rate_hz = result.sample_rate_hz
    Path(args.output).write_bytes(wav_bytes(result.pcm16, rate_hz))
    first = result.first_audio_s
    summary = f"first piece -> first audio {first * 1000:.0f} ms" if first is not None else "no audio"
    print(f"wrote {args.output}: {len(result.pcm16) / 2 / rate_hz:.2f} s of audio; {summary}")
    return 0


def _batch(args: argparse.Namespace) -> int:
    from cluster.batch import read_items, run_batch

    if args.config:
        config = load_engine_config(args.config)
    else:
        config = EngineConfig(model=model_config_for(args.model, args.codec))
    items = read_items(args.prompts)
    sampling = {"max_tokens": args.max_tokens} if args.max_tokens else None
    report = run_batch(config, items, args.out, sampling)
    summary = f"{report.num_items} files, {report.audio_s:.1f} s of audio in {report.wall_s:.1f} s"
    print(f"{summary}: {report.x_real_time:.2f}x real time")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`voxray plan`: replicas per stage and GPUs for N streams at a p90 TTFA, from measured stage costs."""
    from cluster.planner.command import (
        DEFAULT_DRAW_S,
        SWEEP_STREAMS,
        PlanRequest,
        describe_calibration,
        plan_report,
        scenario_for,
    )

    request = PlanRequest(
        model=args.model, gpu=args.gpu, streams=args.streams, ttfa_p90_s=args.ttfa_p90_s,
        min_viable_pct=args.min_viable_pct, sweep=tuple(args.sweep_streams or SWEEP_STREAMS) if args.sweep else (),
        llm_replicas=args.llm_replicas, detok_replicas=args.detok_replicas, text_chars=tuple(args.text_chars),
        step_scale=args.step_scale, seed=args.seed, seeds=args.seeds,
        draw_s=DEFAULT_DRAW_S if args.draw_s is None else args.draw_s,
        calibration=args.calibration, max_starting=args.max_starting,
    )  # fmt: skip
    def progress(plan) -> None:  # a sweep takes minutes: each load on stderr as it is sized
        print(f"voxray plan: {plan.streams} streams: {plan.llm_replicas} LLM + {plan.detok_replicas} detok replicas "
              f"({time.monotonic() - start_s:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip

    start_s = time.monotonic()
    print("\n".join(plan_report(request, progress)))
    if args.sources:
        print("sources:\n" + "\n".join(describe_calibration(scenario_for(request).calib)))
    return 0


def _models(args: argparse.Namespace) -> int:
    """Every family the registry knows; with --config, what that config serves and on which deployments;
    with --target, what a running server lists (gRPC ListModels)."""
    if args.target is not None:
        from cluster.client import list_models

        for info in list_models(args.target, args.app):
            print(f"{info.name}  ({info.sample_rate_hz} Hz): {info.description}")
        return 0
    if args.config is not None:
        from deployments.model_plan import describe_plan

        print("\n".join(describe_plan(load_serve_config(args.config, check_files=False))))
        return 0
    for family in families():
        print("\n".join(describe_family(family)))
    return 0


def describe_family(family: ModelFamily) -> list[str]:
    """`voxray models`: what a family loads and from where, voices, rates, and whether its published
    repos are in the local Hugging Face cache."""
    lm = family.lm
    voices = ", ".join(lm.voices) if lm.voices else lm.no_voices_note
    lines = [
        f"{family.name}  (and {family.name}-tiny: {family.preset_description})",
        f"  loads:  {family.description}",
        f"  voices: {voices}",
        f"  audio:  {family.sample_rate_hz} Hz; {family.frame_rate_hz:.2f} codec frames/s; "
        f"{family.tokens_per_s:.1f} LM steps/s of audio ({lm.steps_per_frame:g} per frame)",
    ]
    repos = [("model", family.repo_id), ("codec", family.codec_repo_id)]
    repos.append(("speech tokenizer", family.speech_tokenizer_repo_id))  # (families reading audio as tokens)
    for role, repo in repos:
        if repo is not None:
            snapshot = cached_snapshot(repo)
            where = f"in the local cache: {snapshot}" if snapshot else f"not cached; `{download_command(repo)}`"
            lines.append(f"  {role}:  {repo}  ({where})")
    if family.repo_id is None:
        lines.append("  model:  our own layout, no published checkpoint; give --model DIR")
    return lines


MODEL_HELP = (
    "a model name (orpheus-tiny, see `voxray models`), a Hugging Face repo id in the local cache "
    "(canopylabs/orpheus-3b-0.1-ft, sesame/csm-1b, nari-labs/Dia-1.6B-0626) or a checkpoint directory"
)
CODEC_HELP = "codec repo id or directory (default: the family's published codec, e.g. hubertsiuzdak/snac_24khz)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxray", description="Serve speech language models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    synth = sub.add_parser("synthesize", help="synthesize one text in-process (no Ray)")
    synth.add_argument("--model", default="orpheus-tiny", help=MODEL_HELP)
    synth.add_argument("--codec", default=None, help=CODEC_HELP)
    synth.add_argument("--config", type=Path, help="EngineConfig YAML (overrides --model/--schedule)")
    synth.add_argument("--text", required=True)
    synth.add_argument("--voice", default=None)
    synth.add_argument("--schedule", choices=["auto", "reference", "wide"], default="auto")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--max-tokens", type=int, default=None)
    synth.add_argument("-o", "--output", type=Path, default=Path("out.wav"))
    synth.set_defaults(func=_synthesize)

    serve_cmd = sub.add_parser("serve", help="start the cluster (embedded local Ray unless --address)")
    serve_cmd.add_argument("--config", type=Path, help="ServeConfig YAML (default: embedded orpheus-tiny on CPU)")
    serve_cmd.add_argument("--address", default=None, help="existing Ray cluster address, e.g. auto or ray://...")
    serve_cmd.add_argument("--model", default=None, help=MODEL_HELP + " (replaces the config's model)")
    serve_cmd.add_argument("--codec", default=None, help=CODEC_HELP)
    serve_cmd.add_argument("--no-block", action="store_true", help="return after deploying")
    serve_cmd.set_defaults(func=_serve)

    drain_cmd = sub.add_parser("drain", help="drain an app on a running cluster: its streams finish or end")
    drain_cmd.add_argument("--address", default="auto", help="Ray cluster address (default: auto, the local node's)")
    drain_cmd.add_argument("--app", default="voxray", help="Serve app name")
    drain_cmd.add_argument("--grace-s", type=float, default=25.0, help="seconds streams get to finish (or move)")
    drain_cmd.add_argument(
        "--move-out-node", action="store_true",
        help="instead: move the streams of this node's LLM replicas (with their KV) to the others (worker preStop)",
    )  # fmt: skip
    drain_cmd.set_defaults(func=_drain)

    say = sub.add_parser(
        "say", help="gRPC client: synthesize TEXT on a running server and write a WAV; or answer / transcribe --audio"
    )
    say.add_argument("text", nargs="?", default="", help="what to say (with --audio: an instruction beside the clip)")
    say.add_argument("--model", default="", help="a served model (default: the server's first)")
    say.add_argument("--audio", type=Path, default=None, help="speech in: a WAV clip the model answers (text printed)")
    say.add_argument("--text-only", action="store_true", help="--audio: answer in text alone (no WAV written)")
    say.add_argument("--transcribe", action="store_true", help="--audio: print the clip's transcript (gRPC Transcribe)")
    say.add_argument("--language", default="", help="--transcribe: ISO-639-1 code of the clip's language (en, zh)")
    say.add_argument("-o", "--output", type=Path, default=Path("say.wav"))
    say.add_argument("--voice", default=None)
    say.add_argument("--seed", type=int, default=0)
    say.add_argument("--max-tokens", type=int, default=None)
    say.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    say.add_argument("--target", default="127.0.0.1:9000")
    say.add_argument("--app", default="voxray")
    say.add_argument("--tls-ca", type=Path, default=None, help="PEM CA (or the server's certificate) for a TLS server")
    say.add_argument(
        "--incremental", action="store_true",
        help="type TEXT word by word into the WebSocket (--url) at --pace words/s; print each piece's time to audio",
    )  # fmt: skip
    say.add_argument("--pace", type=float, default=30.0, help="--incremental: words (~LLM tokens) per second")
    say.add_argument("--url", default="ws://127.0.0.1:8000/v1/audio/speech/stream", help="--incremental: endpoint")
    say.set_defaults(func=_say)

    batch = sub.add_parser("batch", help="synthesize a JSONL file of texts to WAVs (throughput mode, in-process)")
    batch.add_argument("prompts", type=Path, help='JSONL: {"text": ..., "voice": ..., "id": ...} per line')
    batch.add_argument("--out", type=Path, required=True, help="directory for <id>.wav")
    batch.add_argument("--model", default="orpheus-tiny", help=MODEL_HELP)
    batch.add_argument("--codec", default=None, help=CODEC_HELP)
    batch.add_argument("--config", type=Path, help="EngineConfig YAML")
    batch.add_argument("--max-tokens", type=int, default=None)
    batch.set_defaults(func=_batch)

    models = sub.add_parser("models", help="list model families: what they load, voices, rates, cache status")
    models.add_argument("--config", type=Path, help="list what this ServeConfig serves, and on which deployments")
    models.add_argument("--target", help="list what a running server serves (host:port of its gRPC)")
    models.add_argument("--app", default="voxray", help="its app name (with --target)")
    models.set_defaults(func=_models)
    add_plan_parser(sub)
    return parser


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="capacity planner: replicas per stage and GPUs for N streams at a p90 TTFA")
    plan.add_argument("--model", default="orpheus-3b", help="calibrated model (orpheus-3b, orpheus-tiny)")
    plan.add_argument("--gpu", default="h200", help="calibrated device (h200; cpu: this 2-core box's preset)")
    plan.add_argument("--streams", type=int, default=1000, help="concurrent streams on average")
    plan.add_argument("--ttfa-p90-s", type=float, default=0.5, help="SLO: p90 time to first audio, seconds")
    plan.add_argument("--min-viable-pct", type=float, default=99.0, help="SLO: %% of streams playing without a gap")
    plan.add_argument(
        "--sweep", action="store_true",
        help="size a cluster at each of 10 .. 10,000 streams (with --llm/--detok-replicas: that cluster at each)",
    )  # fmt: skip
    plan.add_argument("--sweep-streams", type=int, nargs="+", default=None, help="--sweep: these stream counts")
    plan.add_argument("--llm-replicas", type=int, default=None, help="predict this cluster (with --detok-replicas)")
    plan.add_argument("--detok-replicas", type=int, default=None)
    plan.add_argument("--text-chars", type=int, nargs="+", default=[110], help="request texts' lengths (~15 chars/s)")
    plan.add_argument("--step-scale", type=float, default=1.0, help="what-if: every LLM step x this")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--seeds", type=int, default=0,
                      help="sizing: Poisson draws per load (seed, seed + 1, ...); a load must meet the SLO in most "
                           "(0: as many as hold 2,000 arrivals together, at most 13: a few replicas' capacity "
                           "swings +-30%% over one draw's bursts)")  # fmt: skip
    plan.add_argument("--draw-s", type=float, default=None,
                      help="seconds of arrivals per draw (default 90) from an empty cluster, every one measured, as "
                           "the load test measures a rate (the shape checked against the cluster); 0: a steady "
                           "window (warm-up, 100 arrivals, a tail)")  # fmt: skip
    plan.add_argument(
        "--max-starting",
        type=int,
        default=AdmissionConfig().max_starting_per_replica,
        help="admission.max_starting_per_replica: streams a replica starts at once (0: no limit)",
    )
    plan.add_argument("--calibration", type=Path, default=None, help="a calibration JSON instead of --gpu/--model")
    plan.add_argument("--sources", action="store_true", help="also print where each calibration figure came from")
    plan.set_defaults(func=_plan)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
