"""Regenerate `protos/voxray_pb2.py` / `protos/voxray_pb2_grpc.py` from `protos/voxray.proto`.

protoc runs from the repository root so the generated modules are named `protos.voxray_pb2`
(importable, and picklable by Ray, wherever the Serve proxies run). `generate(out_root)` writes
under `out_root/protos/`; the drift test generates into a temp dir and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("protos") / "voxray.proto"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--grpc_python_out={out_root}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return [out_root / "protos" / "voxray_pb2.py", out_root / "protos" / "voxray_pb2_grpc.py"]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(f"wrote {path}")
