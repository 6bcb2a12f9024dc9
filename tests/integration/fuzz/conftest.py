"""The fuzzed server and the reference runtime, one of each per layout for the whole package,
and the report of the counts at its end (``make fuzz``)."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import numpy as np
import pytest

from tests.integration.fuzz.common import (
    COUNTS,
    EXAMPLES,
    LAYOUTS,
    LIMIT,
    MAX_BATCH,
    MEMORY,
    OK,
    RAN,
    V1,
    Served,
    _tensor,
    never_by_service,
)
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.serve._proto import tokenizer_pb2 as pb


@pytest.fixture(autouse=True)
def _record_the_module_ran(request):
    RAN.add(str(request.path.resolve()))


@pytest.fixture(scope="package", params=LAYOUTS, ids=lambda n: f"frontends{n}")
def served(tiny_checkpoint, request):
    from vqserve.bench.servers import start_server

    log: list[str] = []
    args = argparse.Namespace(backend="eager", dtype=None, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # tiny convolutions; the box has 2 shared cores
        proc, port = start_server(tiny_checkpoint, args, MAX_BATCH, 2.0, log=log,
                                  extra=["--max-message-mb", str(LIMIT >> 20), "--max-queue", "256",
                                         "--frontends", str(request.param)])
    srv = Served(proc, port, log)
    try:
        warm = pb.EncodeRequest(images=_tensor(np.zeros((MAX_BATCH, 32, 32, 3), np.uint8)))
        for _ in range(3):  # warm the allocator and the model before the memory baseline
            assert srv.unary(V1 + "Encode", warm.SerializeToString())[0] == OK
        srv.peaks0 = srv.peaks()
        yield srv
    finally:
        srv.channel.close()
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="package")
def runtime(tiny_checkpoint):
    return EagerRuntime(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="package", autouse=True)
def report():
    """Print the counts by RPC and status code at the end, and write them to $FUZZ_REPORT."""
    COUNTS.clear()
    yield COUNTS
    by_code = Counter()
    by_rpc: dict[str, dict[str, int]] = {}
    for (rpc, code), n in sorted(COUNTS.items()):
        by_code[code] += n
        by_rpc.setdefault(rpc, {})[code] = n
    summary = {"examples_per_test": EXAMPLES, "calls": sum(by_code.values()),
               "by_code": dict(by_code.most_common()), "by_rpc": by_rpc,
               "never_by_service": never_by_service(), "server_rss_mb": MEMORY}
    print("\nfuzz: " + json.dumps({k: summary[k] for k in ("calls", "by_code", "server_rss_mb")}))
    for rpc, codes in by_rpc.items():
        print(f"  {rpc:<26} " + ", ".join(f"{c} {n}" for c, n in codes.items()))
    print("UNKNOWN / INTERNAL by service (each must be 0):")
    for service, counts in summary["never_by_service"].items():
        print(f"  {service:<42} " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    if path := os.environ.get("FUZZ_REPORT"):
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """The reference runtime's tiny convolutions on one thread, in every module."""
    yield
