"""loadtest.gpu.wheelhouse without downloading: its lists agree with this venv (every package named is installed
here, and every package voxray's runtime needs is listed once), Ray's trimmed paths exist and one-node Serve
never imports them, a trimmed wheel stays installable with a consistent RECORD, and the size check fails
clearly over the budget."""

from __future__ import annotations

import base64
import hashlib
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import ray

from loadtest.gpu import wheelhouse as wh

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
REPO_ROOT = Path(__file__).resolve().parents[2]
LISTS = {"GPU_MACHINE_HAS": set(wh.GPU_MACHINE_HAS), "BENCH_WHEELS": set(wh.BENCH_WHEELS),
         "CLUSTER_WHEELS": set(wh.CLUSTER_WHEELS), "SKIPPED": set(wh.SKIPPED)}  # fmt: skip


def _runtime_closure() -> set[str]:
    """voxray's runtime requirements (pyproject, ray[serve] included) and all they require, for the GPU's Python."""
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return wh.requirement_closure(dependencies)


def test_every_listed_package_is_installed_here() -> None:
    for name, names in LISTS.items():
        assert wh.pinned(sorted(names)), name  # raises LookupError naming what is missing


def test_the_lists_do_not_overlap() -> None:
    names = list(LISTS)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert not LISTS[first] & LISTS[second], (first, second, LISTS[first] & LISTS[second])


def test_every_runtime_package_is_on_the_machine_brought_or_skipped_on_purpose() -> None:
    closure = _runtime_closure()
    listed = set().union(*LISTS.values())
    assert closure - listed == set(), "classify these in loadtest/gpu/wheelhouse.py"
    brought_or_skipped = LISTS["BENCH_WHEELS"] | LISTS["CLUSTER_WHEELS"] | LISTS["SKIPPED"]
    assert brought_or_skipped - closure == set(), "listed but no longer required: drop them"


def test_cluster_group_is_bench_plus_cluster_and_names_its_reason() -> None:
    assert list(wh.GROUPS["cluster"]) == [*wh.BENCH_WHEELS, *wh.CLUSTER_WHEELS]
    assert all(reason.strip() for reason in (*wh.BENCH_WHEELS.values(), *wh.CLUSTER_WHEELS.values()))
    assert all(reason.strip() for reason in wh.SKIPPED.values())


def test_the_trimmed_ray_paths_exist_and_one_node_serve_never_imports_them() -> None:
    assert {"ray/jars/", "ray/dashboard/client/build/"} <= set(wh.RAY_TRIMMED)  # the two
    site = Path(ray.__file__).parent.parent
    for prefix in wh.RAY_TRIMMED:
        assert (site / prefix).is_dir(), f"{prefix} is not in Ray {ray.__version__}'s package: stale"
    code = (
        "import sys, cluster.server, deployments.app, router.ingress, ray.dashboard.agent\n"
        "import ray.serve._private.controller, ray.serve._private.proxy, ray.serve._private.replica\n"
        "print('\\n'.join(m.__file__ or '' for m in list(sys.modules.values()) if getattr(m, '__file__', None)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = [str(Path(path).relative_to(site)) for path in result.stdout.split() if path.startswith(str(site))]
    assert [path for path in loaded if wh.is_trimmed(path, wh.RAY_TRIMMED)] == []


def _fake_wheel(path: Path) -> dict[str, bytes]:
    files = {
        "ray/__init__.py": b"VERSION = 1\n",
        "ray/jars/ray_dist.jar": b"java" * 100,
        "ray/core/src/ray/raylet/raylet": b"#!/bin/sh\n",
        "ray/dashboard/client/build/index.html": b"<html/>",
        "ray-2.60.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 2.60.0\n",
        "ray-2.60.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    record = "".join(f"{wh.record_line(name, data)}\n" for name, data in files.items())
    record += "ray-2.60.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | (0o755 if name.endswith("raylet") else 0o644)) << 16
            wheel.writestr(info, data)
        wheel.writestr("ray-2.60.0.dist-info/RECORD", record)
    return files


def test_trimmed_wheel_keeps_a_consistent_record_and_modes(tmp_path: Path) -> None:
    source, dest = tmp_path / "src" / "ray-2.60.0-py3-none-any.whl", tmp_path / "ray-2.60.0-py3-none-any.whl"
    source.parent.mkdir()
    files = _fake_wheel(source)
    assert wh.trim_wheel(source, dest, wh.RAY_TRIMMED, strip=False) == 2
    with zipfile.ZipFile(dest) as wheel:
        names = wheel.namelist()
        assert names[-1] == "ray-2.60.0.dist-info/RECORD"
        rows = {row.split(",")[0]: row for row in wheel.read(names[-1]).decode().splitlines()}
        assert set(rows) == set(names) and not any(wh.is_trimmed(name, wh.RAY_TRIMMED) for name in names)
        for name in names[:-1]:
            data = wheel.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert rows[name] == f"{name},sha256={digest},{len(data)}" and data == files[name]
        assert wheel.getinfo("ray/core/src/ray/raylet/raylet").external_attr >> 16 == stat.S_IFREG | 0o755


def test_trimmed_wheel_installs_the_way_the_gpu_machine_installs_it(tmp_path: Path) -> None:
    source, dest = tmp_path / "src" / "ray-2.60.0-py3-none-any.whl", tmp_path / "ray-2.60.0-py3-none-any.whl"
    source.parent.mkdir()
    _fake_wheel(source)
    wh.trim_wheel(source, dest, wh.RAY_TRIMMED, strip=False)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(target), str(dest)], check=True, timeout=120)  # fmt: skip
    assert (target / "ray/__init__.py").read_text() == "VERSION = 1\n" and not (target / "ray/jars").exists()
    assert (target / "ray/core/src/ray/raylet/raylet").stat().st_mode & 0o111


def test_strip_leaves_files_that_are_not_elf_alone() -> None:
    assert wh.strip_symbols(b"#!/bin/sh\necho hi\n") == b"#!/bin/sh\necho hi\n"


def test_size_check_fails_over_the_budget_naming_the_largest(tmp_path: Path) -> None:
    (tmp_path / "big-1.0-py3-none-any.whl").write_bytes(b"x" * 300_000)
    (tmp_path / "small-1.0-py3-none-any.whl").write_bytes(b"x" * 1_000)
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "left.bin").write_bytes(b"x" * 200_000)  # everything under the folder travels
    assert wh.check_size(tmp_path, max_mib=1.0) == pytest.approx(501_000 / wh.MIB)
    with pytest.raises(wh.WheelhouseTooLarge, match=r"0\.5 MiB, over the 0 MiB budget.*big-1\.0-py3-none-any\.whl"):
        wh.check_size(tmp_path, max_mib=0.4)
    assert wh.main(["--check", "--out", str(tmp_path), "--max-mib", "0.4"]) == 1
    assert wh.main(["--check", "--out", str(tmp_path), "--max-mib", "1"]) == 0


def test_default_budget_leaves_room_for_the_checkout() -> None:
    assert wh.MAX_WHEELHOUSE_MIB <= 56  # the device carries 64 MiB in all; the tree is ~6-7 MiB


def test_make_targets_and_runner_use_the_module_and_install_offline() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "-m loadtest.gpu.wheelhouse --group cluster --out .whl" in makefile  # gpu-wheelhouse
    assert "-m loadtest.gpu.wheelhouse --group bench --out .whl" in makefile  # gpu-wheels
    runner = REPO_ROOT / "loadtest/gpu/cluster_run.sh"
    subprocess.run(["bash", "-n", str(runner)], check=True, timeout=30)
    assert "--no-index --no-deps" in runner.read_text() and '--target "$SITE"' in runner.read_text()


def test_the_runners_default_serve_command_resolves_without_weights() -> None:
    """cluster_run.sh's `voxray serve --config deployments/configs/gpu-1.yaml --model orpheus-tiny`: the GPU
    machine has no checkpoints, so the preset keeps gpu-1's dtype, device and sizes."""
    from cluster.cli import build_parser, serve_config

    runner = (REPO_ROOT / "loadtest/gpu/cluster_run.sh").read_text()
    assert 'CONFIG="${CONFIG-deployments/configs/gpu-1.yaml}"' in runner and 'MODEL="${MODEL-orpheus-tiny}"' in runner
    args = ["serve", "--config", str(REPO_ROOT / "deployments/configs/gpu-1.yaml"), "--model", "orpheus-tiny"]
    config = serve_config(build_parser().parse_args(args))
    model = config.engine.model
    assert (model.name, model.device, model.dtype) == ("orpheus-tiny", "cuda", "bfloat16")
    assert (config.llm.num_gpus, config.detok.num_gpus) == (0.5, 0.5)
