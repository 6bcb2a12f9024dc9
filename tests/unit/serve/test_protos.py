"""The committed stubs under serve/_proto are what scripts/gen_protos.py makes from protos/,
and our OIP v2 proto matches the public protocol (as tritonclient ships it) field by field."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT, load_script

STUBS = ROOT / "serve" / "_proto"
# Lines that only record the generator's version (a newer grpcio-tools is not "stale").
VERSION_LINES = re.compile(r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s+\d+,\s*)$", re.M)


def _load_generator():
    return load_script("gen_protos")


def test_committed_stubs_are_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    gen = _load_generator()
    gen.generate(tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in STUBS.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub files differ: run `python scripts/gen_protos.py`"
    for name, text in fresh.items():
        assert VERSION_LINES.sub("", text) == VERSION_LINES.sub("", committed[name]), (
            f"serve/_proto/{name} is stale: run `python scripts/gen_protos.py` (make protos)")


def test_oip_messages_match_the_public_protocol():
    """Every message and RPC we define has the names, numbers and types tritonclient uses."""
    tc = pytest.importorskip("tritonclient.grpc.service_pb2")
    from vqserve.serve._proto import grpc_predict_v2_pb2 as ours

    def fields(desc):
        out = {f.name: (f.number, f.type, f.label if hasattr(f, "label") else None,
                        f.message_type.full_name if f.message_type else None) for f in desc.fields}
        for nested in desc.nested_types:
            out[nested.name] = fields(nested)
        return out

    for name, desc in ours.DESCRIPTOR.message_types_by_name.items():
        assert fields(desc) == fields(tc.DESCRIPTOR.message_types_by_name[name]), name
    theirs = tc.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name, other.output_type.full_name)
