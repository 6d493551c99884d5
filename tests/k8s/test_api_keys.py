"""API keys on k8s: the prod overlays require them (the keys Secret mounted where the config points, an init
container that stops the head with what to create when it is missing), and the dev overlay is open only by
its explicit `auth.allow_open`."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from core.config import load_serve_config
from tests.k8s.manifests import OVERLAY_CONFIGS, PROD_OVERLAYS, REPO_ROOT, find, pod_templates, ray_container, render

KEYS_SECRET = "voxray-api-keys"
RAY_USERS_GID = 100  # the Ray image's `ray` user is in group users


def _config(overlay: str):
    return load_serve_config(REPO_ROOT / OVERLAY_CONFIGS[overlay], check_files=False)


def _head(overlay: str) -> dict:
    return pod_templates(find(render(f"overlays/{overlay}"), "RayService"))["head"]


def _keys_check(overlay: str = "prod-gpu") -> dict:
    (check,) = _head(overlay)["spec"]["initContainers"]
    return check


def _run_keys_check(keys_file: Path) -> subprocess.CompletedProcess[str]:
    """The init container's script, run here with the keys file at `keys_file`."""
    check = _keys_check()
    assert check["command"] == ["sh", "-c"]
    script = check["args"][0].replace("keys=/etc/voxray/keys/api-keys", f"keys={keys_file}", 1)
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_prod_requires_keys_from_the_mounted_secret(overlay: str) -> None:
    auth = _config(overlay).auth
    assert auth.api_keys_file is not None and not auth.allow_open
    path = PurePosixPath(auth.api_keys_file)
    head = _head(overlay)
    volumes = {v["name"]: v for v in head["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in ray_container(head)["volumeMounts"]}
    mount = mounts[str(path.parent)]  # the directory, not a subPath: kubelet updates the file when the Secret changes
    assert mount["readOnly"] is True and "subPath" not in mount
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == KEYS_SECRET and path.name == "api-keys"
    # the init container checks the same volume at the same path, and the Ray user can read it
    check_mounts = {m["mountPath"]: m["name"] for m in _keys_check(overlay)["volumeMounts"]}
    assert check_mounts == {str(path.parent): mount["name"]}
    assert head["spec"]["securityContext"]["fsGroup"] == RAY_USERS_GID
    assert secret["defaultMode"] & 0o040, "group-readable: the Ray user reads it through fsGroup"


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_the_keys_check_runs_the_ray_image_and_shows_its_message(overlay: str) -> None:
    check = _keys_check(overlay)
    assert check["image"] == ray_container(_head(overlay))["image"]  # no other image to pull
    assert check["terminationMessagePolicy"] == "FallbackToLogsOnError"  # `kubectl describe pod` shows why


def test_a_missing_keys_secret_stops_the_head_saying_what_to_create(tmp_path: Path) -> None:
    result = _run_keys_check(tmp_path / "api-keys")
    assert result.returncode == 1
    assert f"kubectl -n voxray create secret generic {KEYS_SECRET} --from-file=api-keys" in result.stderr
    assert "auth.allow_open: true" in result.stderr  # how to run open on purpose


def test_a_keys_file_without_digests_stops_the_head(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text("# no keys yet\nnot-a-digest team-a\n")
    assert _run_keys_check(keys).returncode == 1


def test_a_keys_file_with_digests_lets_the_head_start(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    digest = hashlib.sha256(b"secret-key").hexdigest()
    keys.write_text(f"# keys\n{digest} team-a\n{digest.upper()}  # unnamed\n")
    result = _run_keys_check(keys)
    assert result.returncode == 0, result.stderr
    assert "2 sha256 digests" in result.stdout


def test_the_dev_overlay_is_open_by_its_explicit_setting() -> None:
    auth = _config("dev-cpu").auth
    assert auth.api_keys_file is None and auth.allow_open is True
    assert "initContainers" not in _head("dev-cpu")["spec"]
