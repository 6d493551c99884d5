"""The committed gRPC stubs match what protoc generates from `protos/voxray.proto`."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path: Path):
    for generated in generate(tmp_path):
        committed = ROOT / "protos" / generated.name
        drifted = f"{committed.name} drifted: run python -m protos.generate"
        assert committed.read_text() == generated.read_text(), drifted


def test_stubs_import_under_the_package_name():
    from protos import voxray_pb2, voxray_pb2_grpc

    assert voxray_pb2.SynthesizeRequest.DESCRIPTOR.full_name == "voxray.SynthesizeRequest"
    assert voxray_pb2.DESCRIPTOR.name == "protos/voxray.proto"  # module path protos.voxray_pb2: picklable by Ray
    assert hasattr(voxray_pb2_grpc, "add_SpeechServicer_to_server")
