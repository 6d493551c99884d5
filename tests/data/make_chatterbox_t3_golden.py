"""Regenerate `tests/data/chatterbox_t3_golden.json`: greedy T3 tokens of the reference package
(`chatterbox-tts`, its own `T3.inference` loop: CFG, exaggeration, repetition penalty, double
start token) on the chatterbox-tiny preset's weights. Two steps, two Python environments:

    # 1. in the repo's venv: write the preset's weights, voice and cases
    python -m tests.data.make_chatterbox_t3_golden export /tmp/t3_tiny.pt
    # 2. in a scratch venv OUTSIDE the repo with torch, transformers==5.2.0, einops, tqdm and
    #    `pip install --no-deps chatterbox-tts==0.1.7` (only T3's modules are imported):
    /work/scratch-t3/venv/bin/python tests/data/make_chatterbox_t3_golden.py reference /tmp/t3_tiny.pt \
        tests/data/chatterbox_t3_golden.json

Greedy: the reference loop draws with `torch.multinomial`, replaced here by the argmax of the same
probabilities (after its penalty, temperature, min-p and top-p), so the tokens are deterministic.
"""

from __future__ import annotations

import json
import sys

import torch

SEED = 0
CASES = [  # text, exaggeration, cfg_weight, new tokens
    ("hello there", 0.5, 0.5, 16),
    ("hello there", 1.5, 0.5, 16),
    ("a second, longer sentence to say.", 0.3, 1.0, 16),
    ("yes", 0.9, 0.25, 12),
    ("hello there", 0.0, 0.5, 16),  # a zero emotion row: the tiny model's tokens change (a positive scale does not)
]


NORMALIZE_CASES = [
    "hello   there",
    "wait... what: now; ok \u2014 fine",
    "Yes!",
    "\u201cquoted\u201d it\u2019s",
    "end ,",
    "a \u2013 b - c\u2026",
    "  leading and trailing  ",
    "x",
]


def export(path: str) -> None:
    """The preset as the adapter builds it, the T3Config fields the reference needs, and the cases."""
    from dataclasses import asdict

    from core.config import ModelConfig
    from llm_stage.models.chatterbox import DEFAULT_VOICE, ChatterboxAdapter
    from llm_stage.models.chatterbox_t3 import tiny_llama_config

    adapter = ChatterboxAdapter.build(ModelConfig(name="chatterbox-tiny", seed=SEED))
    layout = adapter.layout
    config = tiny_llama_config().to_dict()
    rope = dict(config.pop("rope_parameters"))
    llama = {key: config[key] for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "max_position_embeddings", "rms_norm_eps", "vocab_size", "hidden_act", "tie_word_embeddings",
        "attention_bias", "mlp_bias",
    )}  # fmt: skip
    llama.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, attn_implementation="sdpa")
    built_in = adapter.voice_specs[DEFAULT_VOICE]
    voice = {"speaker_emb": built_in.speaker_emb, "prompt_speech": built_in.prompt_speech}
    cases = [
        {"text": text, "text_ids": adapter._text_ids(text), "exaggeration": ex, "cfg_weight": cfg, "num_tokens": n}
        for text, ex, cfg, n in CASES
    ]
    torch.save(
        {"state": adapter.model.state_dict(), "layout": asdict(layout), "llama": llama, "voice": voice, "cases": cases},
        path,
    )


def load_reference_t3():
    """chatterbox's T3 classes without running `chatterbox/__init__` (which imports the whole TTS stack)."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("chatterbox")
    package = types.ModuleType("chatterbox")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["chatterbox"] = package
    from chatterbox.models.t3 import llama_configs
    from chatterbox.models.t3.modules.cond_enc import T3Cond
    from chatterbox.models.t3.modules.t3_config import T3Config
    from chatterbox.models.t3.t3 import T3

    return T3, T3Config, T3Cond, llama_configs


def reference_punc_norm():
    """ChatterboxTTS' `punc_norm`, taken from the installed package's tts.py and run here as it is (importing
    tts.py would pull in its whole TTS stack)."""
    import ast
    from pathlib import Path

    source = (Path(sys.modules["chatterbox"].__path__[0]) / "tts.py").read_text()  # set by load_reference_t3
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "punc_norm")
    namespace: dict = {}
    exec(compile(ast.Module([node], type_ignores=[]), "tts.py", "exec"), namespace)  # noqa: S102
    return namespace["punc_norm"]


def reference(path: str, out_path: str) -> None:
    from importlib.metadata import version

    T3, T3Config, T3Cond, llama_configs = load_reference_t3()
    data = torch.load(path, weights_only=False)
    llama_configs.LLAMA_CONFIGS["Llama_tiny"] = data["llama"]
    hp = T3Config(text_tokens_dict_size=data["layout"]["text_vocab"])
    hp.llama_config_name = "Llama_tiny"
    hp.max_text_tokens, hp.max_speech_tokens = data["layout"]["max_text_tokens"], data["layout"]["max_speech_tokens"]
    model = T3(hp)
    model.load_state_dict(data["state"], strict=True)
    model.eval()
    torch.multinomial = lambda probs, num_samples, **_: probs.argmax(dim=-1, keepdim=True)
    voice = data["voice"]
    results = []
    for case in data["cases"]:
        cond = T3Cond(
            speaker_emb=voice["speaker_emb"].view(1, -1),
            cond_prompt_speech_tokens=voice["prompt_speech"].view(1, -1),
            emotion_adv=case["exaggeration"] * torch.ones(1, 1, 1),
        )
        text = torch.tensor([case["text_ids"]] * 2)  # two rows for CFG, as ChatterboxTTS.generate builds them
        tokens = model.inference(
            t3_cond=cond, text_tokens=text, max_new_tokens=case["num_tokens"], temperature=0.8,
            cfg_weight=case["cfg_weight"], repetition_penalty=1.2, min_p=0.05, top_p=1.0,
        )  # fmt: skip
        with torch.inference_mode():  # `inference` cached the prompt's embeddings on `cond` in inference mode
            cond_rows = model.prepare_conditioning(cond)[0]  # [34, C]: speaker, 32 perceiver rows, emotion
        results.append({
            **{k: case[k] for k in ("text", "exaggeration", "cfg_weight", "num_tokens")},
            "tokens": tokens[0].tolist(),
            "cond_row_sums": cond_rows.sum(dim=-1).tolist(),
            "cond_row_heads": cond_rows[:, :4].tolist(),
        })  # fmt: skip
    punc_norm = reference_punc_norm()
    golden = {"reference": f"chatterbox-tts {version('chatterbox-tts')}, transformers {version('transformers')}, "
              f"torch {torch.__version__}", "seed": SEED, "cases": results,
              "normalized": {text: punc_norm(text) for text in NORMALIZE_CASES}}  # fmt: skip
    with open(out_path, "w") as handle:
        json.dump(golden, handle, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2])
    else:
        reference(sys.argv[2], sys.argv[3])
