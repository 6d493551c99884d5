"""Write the orpheus-tiny preset's weights to disk so the peer baselines load the SAME weights.

`<out>/lm`: HF-format LlamaForCausalLM (config.json + safetensors; vLLM and transformers read it).
`<out>/snac`: SNAC config.json + pytorch_model.bin (the preset's seeded init, weight norm intact).
Usage: python -m loadtest.baselines.export_weights --out build/loadtest-weights
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from snac import SNAC

from core.config import ModelConfig
from detok_stage.codecs.snac_codec import TINY_SNAC
from llm_stage.models.orpheus import OrpheusAdapter


def export_lm(model_config: ModelConfig, out_dir: Path) -> Path:
    adapter = OrpheusAdapter.build(model_config)
    adapter.backbone.hf_model.save_pretrained(str(out_dir))
    return out_dir


def export_snac(seed: int, out_dir: Path) -> Path:
    """The same init as `load_snac(None, seed)` (seed, then construct), saved before weight-norm folding."""
    torch.manual_seed(seed)
    model = SNAC(**TINY_SNAC)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(TINY_SNAC, indent=1) + "\n")
    torch.save(model.state_dict(), out_dir / "pytorch_model.bin")
    return out_dir


def export_all(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """Idempotent: skips a part whose files already exist."""
    lm_dir, snac_dir = out / "lm", out / "snac"
    if not (lm_dir / "config.json").exists():
        export_lm(ModelConfig(name="orpheus-tiny", seed=seed), lm_dir)
    if not (snac_dir / "pytorch_model.bin").exists():
        export_snac(seed, snac_dir)
    return lm_dir, snac_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("build/loadtest-weights"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lm_dir, snac_dir = export_all(args.out, args.seed)
    print(f"LM: {lm_dir}  SNAC: {snac_dir}")


if __name__ == "__main__":
    main()
