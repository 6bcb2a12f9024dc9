"""Fuzz both protocols of a real ``vqserve serve`` process (issue 13; ``make fuzz``).

One test module per service (``test_<n>_<service>.py``, run in that order, the checks that
come after all of them last); ``common.py`` holds what they share, ``strategies.py`` the
requests and their rules, ``conftest.py`` the server and the report.

Hypothesis sends malformed requests to every RPC of every service the server exposes:
vqserve.v1.Tokenizer, the Open Inference Protocol, health (Check, List, Watch) and server
reflection (v1 and v1alpha). For the first two: bad shapes, dtypes and byte lengths, garbage and truncated PNG/JPEG
bytes, decompression bombs (headers claiming huge sizes), amplification (hundreds of tiny
PNGs that each decode to megabytes), out-of-range indices in every integer dtype, and
bytes that are not a protobuf message at all; for health and reflection: names served and
not, names longer than any proto name, garbage, truncated and bit-flipped messages. Each
call must get the status code the documented rules give (``expected_*`` below are written
from docs/SERVING.md, not from the server code), never UNKNOWN or INTERNAL: the summary
counts those two per service, and the last test asserts every count is 0; every OK answer must equal the in-process
runtime's. The server runs as its own process so that its memory can be watched: its
peak RSS may not grow by more than ``RSS_BUDGET_MB`` over the whole run (in each of its
processes, when split), and afterwards it must still serve exact answers.

Size: ``VQSERVE_FUZZ_EXAMPLES`` examples per test (default: the slice ``make test`` runs;
``make fuzz`` runs many more). ``VQSERVE_FUZZ_FRONTENDS=N`` fuzzes the server split into N
front-end processes before one executor (``serve --frontends N``; 0, one process); unset
(``make test``), the slice runs against both layouts, one process and 2 front-ends, since
a GPU node serves split and its errors cross the executor's wire. The counts by RPC and
status code are printed at the end and written to ``$FUZZ_REPORT`` (JSON) when it is set.
"""
