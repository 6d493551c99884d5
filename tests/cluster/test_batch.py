"""`voxray batch`: JSONL in, one WAV per line out, x-real-time reported; bad lines name line and field."""

from __future__ import annotations

import wave

import pytest

from cluster.batch import read_items
from cluster.cli import main
from core.errors import InvalidArgumentError


def test_batch_writes_one_wav_per_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "one", "id": "first"}\n\n{"text": "two words", "voice": "mia"}\n')
    assert main(["batch", str(prompts), "--out", str(tmp_path / "out"), "--max-tokens", "28"]) == 0
    for name in ("first.wav", "3.wav"):
        with wave.open(str(tmp_path / "out" / name)) as wav:
            assert wav.getnframes() == 4 * 2048
    assert "x real time" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "field_suffix"),
    [
        ('{"text": "ok"}\n{bad json\n', ":2"),
        ('{"voice": "tara"}\n', ":1.text"),
        ('{"text": "x", "id": "../up"}\n', ":1.id"),
        ("\n", ""),
    ],
)
def test_bad_lines_are_named(tmp_path, content, field_suffix):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError) as err:
        read_items(path)
    assert err.value.field == f"{path}{field_suffix}"


def test_bad_voice_fails_before_any_work(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "x", "voice": "nobody"}\n')
    assert main(["batch", str(path), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
