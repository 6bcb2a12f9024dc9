"""Run after every other fuzz test (the file names keep the order): the server still answers
exactly, within its memory budget, and no service ever answered UNKNOWN or INTERNAL."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.integration.fuzz.common import (
    MEMORY,
    OK,
    RAN,
    RSS_BUDGET_MB,
    TIMEOUT,
    V1,
    _tensor,
    never_by_service,
)
from vqserve.bench.processes import tree_memory
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.api import codec

pytestmark = TIMEOUT


# ---- afterwards --------------------------------------------------------------------------------
def test_still_exact_and_memory_bounded_after_fuzzing(served, runtime, photos):
    """Run last: the server survived everything above, answers exactly what the in-process
    runtime answers, never logged an internal error, and its peak memory stayed in budget."""
    request = pb.EncodeRequest(images=_tensor(photos)).SerializeToString()
    code, details, reply = served.unary(V1 + "Encode", request)
    assert code == OK, details
    got = pb.EncodeResponse.FromString(reply).indices
    np.testing.assert_array_equal(codec.array_from_bytes(got.shape, got.dtype, got.data, "r"),
                                  runtime.encode(photos))
    indices = runtime.encode(photos)
    code, details, reply = served.unary(V1 + "Decode", pb.DecodeRequest(
        indices=_tensor(indices)).SerializeToString())
    assert code == OK, details
    images = pb.DecodeResponse.FromString(reply).images
    want = runtime.decode(indices)
    got_images = codec.array_from_bytes(images.shape, images.dtype, images.data, "r")
    assert np.abs(got_images.astype(np.int16) - want).max() <= 1
    assert served.proc.poll() is None, "the server exited"
    errors = [line for line in served.log if '"level": "error"' in line]
    assert not errors, errors[:3]
    growth = served.peak_growth()
    MEMORY.update(baseline_peak=round(sum(served.peaks0.values())), peak_growth=round(growth),
                  now=round(tree_memory(served.proc.pid)["rss_mb"]))
    assert growth <= RSS_BUDGET_MB, f"a server process's peak RSS grew by {growth:.0f} MB while fuzzed"


def test_no_unknown_or_internal_on_any_service(request):
    """The summary's UNKNOWN and INTERNAL counts are 0 for every service (each call was
    checked as it came; this is the per-service account of issue round 2, item 2), and, once
    every other fuzz module of the run has run before it in this process, every service was
    called (in another order, or a -k selection, only what ran is judged)."""
    counts = never_by_service()
    bad = {service: c for service, c in counts.items() if c["UNKNOWN"] or c["INTERNAL"]}
    assert not bad, f"UNKNOWN or INTERNAL answers: {bad}"
    here = Path(__file__).resolve()
    others = {str(item.path.resolve()) for item in request.session.items
              if item.path.resolve().parent == here.parent and item.path.resolve() != here}
    if others and others <= RAN:
        assert all(c["calls"] for c in counts.values()), f"a service was never called: {counts}"
