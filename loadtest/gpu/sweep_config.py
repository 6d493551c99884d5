"""The Serve config the GPU load sweep serves and the in-process half runs: a config file (or `voxray serve`'s embedded
default) on the sweep's own loopback ports, written as YAML for `voxray serve --config`, and the engine config
`voxray serve --model M --codec C` builds from it (model replaced as `cluster.cli.serve_config` replaces it), so
both halves of loadtest/gpu/sweep_run.sh run one engine config. Usage:
    python -m loadtest.gpu.sweep_config --config deployments/configs/gpu-1.yaml --grpc-port 19500 --http-port 18500 \
        --out /tmp/sweep/serve.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from core.config import EngineConfig, ServeConfig, load_serve_config
from llm_stage.registry import model_config_for


def sweep_serve_config(path: Path | None, grpc_port: int, http_port: int) -> ServeConfig:
    """`path`'s config (None: the embedded default) with both proxies and Ray on loopback at the given ports."""
    base = load_serve_config(path) if path is not None else ServeConfig()
    loopback = {"http_host": "127.0.0.1", "grpc_host": "127.0.0.1", "ray_loopback_only": True}
    update = {"grpc_port": grpc_port, "http_port": http_port, **loopback}
    return ServeConfig.model_validate({**base.model_dump(), **update})


def served_engine_config(config: ServeConfig, model: str | Path | None, codec: str | Path | None) -> EngineConfig:
    """The engine `voxray serve --model model --codec codec` runs: the config's model section keeps its dtype,
    device, threads and seed, its name and checkpoints come from `model` / `codec` (None: as configured)."""
    if model is None:
        return config.engine
    kept = config.engine.model.model_dump(exclude={"name", "checkpoint_dir", "codec_dir"})
    replaced = model_config_for(str(model), None if codec is None else str(codec), **kept)
    return EngineConfig.model_validate({**config.engine.model_dump(), "model": replaced.model_dump()})


def write_yaml(config: ServeConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="", help="ServeConfig YAML; empty = the embedded default (CPU orpheus-tiny)")
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="the YAML written")
    args = p.parse_args(argv)
    config = sweep_serve_config(Path(args.config) if args.config else None, args.grpc_port, args.http_port)
    return write_yaml(config, args.out)


if __name__ == "__main__":
    main()
