#!/usr/bin/env python
"""Regenerate the gRPC/protobuf stubs under serve/_proto from protos/ (``make protos``).

    python scripts/gen_protos.py            # rewrite serve/_proto in place
    python scripts/gen_protos.py --out DIR  # write elsewhere (the staleness test does this)

protoc writes ``vqserve/v1/tokenizer_pb2.py`` and ``inference/grpc_predict_v2_pb2.py``
with top-level imports (``from vqserve.v1 import ...``) that would collide with the real
``vqserve`` package, so the stubs are flattened into the one package
``vqserve.serve._proto`` and their imports rewritten to match.

The Open Inference Protocol stubs are registered in a private descriptor pool instead of
the process-wide default one: tritonclient (and any other KServe client) registers the
same ``inference.*`` symbols from its own copy of the protocol, and two different files
defining one symbol in the default pool is an error. With a private pool, the server and
those clients can live in one process.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "serve" / "_proto"
PACKAGE = "vqserve.serve._proto"
# (proto file relative to protos/, python module stem)
PROTOS = [
    ("vqserve/v1/tokenizer.proto", "tokenizer"),
    ("inference/grpc_predict_v2.proto", "grpc_predict_v2"),
]
PRIVATE_POOL = {"grpc_predict_v2"}

INIT = '''"""Generated protobuf / gRPC stubs. Do not edit: run ``python scripts/gen_protos.py``.

- ``tokenizer_pb2`` / ``tokenizer_pb2_grpc``: vqserve.v1.Tokenizer (protos/vqserve/v1/tokenizer.proto)
- ``grpc_predict_v2_pb2`` / ``grpc_predict_v2_pb2_grpc``: the Open Inference Protocol v2
  (protos/inference/grpc_predict_v2.proto), in a private descriptor pool
"""
'''


def _rewrite(text: str, stem: str) -> str:
    for proto, other in PROTOS:
        pkg = str(Path(proto).parent).replace("/", ".")
        text = re.sub(rf"^from {re.escape(pkg)} import {other}_pb2 as ",
                      f"from {PACKAGE} import {other}_pb2 as ", text, flags=re.M)
    if stem in PRIVATE_POOL:
        old = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
        if old in text:
            text = text.replace(
                old,
                "# vqserve: a private pool, so tritonclient's copy of `inference.*` can coexist.\n"
                "_POOL = _descriptor_pool.DescriptorPool()\n"
                "DESCRIPTOR = _POOL.AddSerializedFile(",
            )
    return text


def generate(out_dir: str | Path = OUT_DIR) -> list[Path]:
    """Run protoc on every proto and write the flattened stubs into ``out_dir``."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [str(PROTO_ROOT / proto) for proto, _ in PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for proto, stem in PROTOS:
            src_dir = Path(tmp) / Path(proto).parent
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                src = src_dir / f"{stem}{suffix}"
                dst = out_dir / src.name
                dst.write_text(_rewrite(src.read_text(), stem))
                written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text(INIT)
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT_DIR), help=f"output directory (default {OUT_DIR})")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.resolve() == OUT_DIR.resolve() and out.exists():
        for stale in out.glob("*_pb2*.py*"):
            stale.unlink()
        shutil.rmtree(out / "__pycache__", ignore_errors=True)
    for path in generate(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
