"""The `voxray` command line: synthesize in-process, serve the cluster, talk to it, list models.

Sub-commands build their config from flags or `--config FILE` and hand off to the engines,
the app builder or the gRPC client; bad input exits with the offending field named.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from core.config import DetokConfig, EngineConfig, ModelConfig, load_engine_config
from core.errors import InvalidArgumentError
from llm_stage.registry import get_entry, model_names


def _synthesize(args: argparse.Namespace) -> int:
    from cluster.pipeline import InProcessPipeline
    from router.audio_format import write_wav

    if args.config:
        config = load_engine_config(args.config)
    else:
        config = EngineConfig(model=ModelConfig(name=args.model), detok=DetokConfig(schedule=args.schedule))
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


def _serve(args: argparse.Namespace) -> int:
    from cluster.server import deploy
    from core.config import ServeConfig, load_serve_config

    config = load_serve_config(args.config) if args.config else ServeConfig()
    endpoints = deploy(config, address=args.address)
    print(f"VoxRay serving {config.engine.model.name} (app {endpoints.app_name!r})")
    print(f"  gRPC: {endpoints.grpc_target}  (metadata application={endpoints.app_name})")
    print(f"  HTTP: {endpoints.http_url}/v1/audio/speech   health: {endpoints.http_url}/healthz")
    print("Ctrl-C to stop.", flush=True)
    if args.no_block:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def _say(args: argparse.Namespace) -> int:
    import grpc

    from cluster.client import make_request, result_wav, synthesize

    fmt = 0  # PCM16; the WAV is assembled here
    sampling = {"seed": args.seed, **({"max_tokens": args.max_tokens} if args.max_tokens else {})}
    request = make_request(args.text, voice=args.voice or "", format=fmt, sampling=sampling)
    try:
        result = synthesize(args.target, args.app, request)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    Path(args.output).write_bytes(result_wav(result))
    audio_s = len(result.pcm16) / 2 / max(1, result.sample_rate_hz)
    ttfa = result.ttfa_s
    print(f"wrote {args.output}: {audio_s:.2f} s of audio; TTFA {ttfa * 1000:.0f} ms" if ttfa else "no audio")
    return 0


def _batch(args: argparse.Namespace) -> int:
    from cluster.batch import read_items, run_batch

    config = load_engine_config(args.config) if args.config else EngineConfig(model=ModelConfig(name=args.model))
    items = read_items(args.prompts)
    sampling = {"max_tokens": args.max_tokens} if args.max_tokens else None
    report = run_batch(config, items, args.out, sampling)
    summary = f"{report.num_items} files, {report.audio_s:.1f} s of audio in {report.wall_s:.1f} s"
    print(f"{summary}: {report.x_real_time:.2f}x real time")
    return 0


def _models(_: argparse.Namespace) -> int:
    for name in model_names():
        print(f"{name:16s} {get_entry(name).description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxray", description="Serve speech language models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    synth = sub.add_parser("synthesize", help="synthesize one text in-process (no Ray)")
    synth.add_argument("--model", default="orpheus-tiny")
    synth.add_argument("--config", type=Path, help="EngineConfig YAML (overrides --model/--schedule)")
    synth.add_argument("--text", required=True)
    synth.add_argument("--voice", default=None)
    synth.add_argument("--schedule", choices=["reference", "wide"], default="wide")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--max-tokens", type=int, default=None)
    synth.add_argument("-o", "--output", type=Path, default=Path("out.wav"))
    synth.set_defaults(func=_synthesize)

    serve_cmd = sub.add_parser("serve", help="start the cluster (embedded local Ray unless --address)")
    serve_cmd.add_argument("--config", type=Path, help="ServeConfig YAML (default: embedded orpheus-tiny on CPU)")
    serve_cmd.add_argument("--address", default=None, help="existing Ray cluster address, e.g. auto or ray://...")
    serve_cmd.add_argument("--no-block", action="store_true", help="return after deploying")
    serve_cmd.set_defaults(func=_serve)

    say = sub.add_parser("say", help="gRPC client: synthesize TEXT on a running server and write a WAV")
    say.add_argument("text")
    say.add_argument("-o", "--output", type=Path, default=Path("say.wav"))
    say.add_argument("--voice", default=None)
    say.add_argument("--seed", type=int, default=0)
    say.add_argument("--max-tokens", type=int, default=None)
    say.add_argument("--target", default="127.0.0.1:9000")
    say.add_argument("--app", default="voxray")
    say.set_defaults(func=_say)

    batch = sub.add_parser("batch", help="synthesize a JSONL file of texts to WAVs (throughput mode, in-process)")
    batch.add_argument("prompts", type=Path, help='JSONL: {"text": ..., "voice": ..., "id": ...} per line')
    batch.add_argument("--out", type=Path, required=True, help="directory for <id>.wav")
    batch.add_argument("--model", default="orpheus-tiny")
    batch.add_argument("--config", type=Path, help="EngineConfig YAML")
    batch.add_argument("--max-tokens", type=int, default=None)
    batch.set_defaults(func=_batch)

    models = sub.add_parser("models", help="list registered models")
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
