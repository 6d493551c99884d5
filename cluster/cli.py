"""The `voxray` command line: synthesize in-process, serve the cluster, talk to it, list models.

Sub-commands build their config from flags or `--config FILE` and hand off to the engines,
the app builder or the gRPC client; bad input exits with the offending field named.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cluster.config import DetokConfig, EngineConfig, ModelConfig, load_engine_config
from cluster.errors import InvalidArgumentError
from cluster.registry import REGISTRY


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


def _models(_: argparse.Namespace) -> int:
    for entry in REGISTRY.values():
        print(f"{entry.name:16s} {entry.description}")
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
