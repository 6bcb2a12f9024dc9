"""``vqserve bench all`` (``make bench``): every benchmark of the project in one run, written
as docs/BENCHMARKS.md with PNG plots and a JSON of the raw rows.

``run`` measures (the runtime table, then the serving modes of ``vqserve.bench.serving``,
interleaved), ``machine`` records where and under what load, ``targets`` computes the
headline ratios and their verdicts, and ``document`` writes the file and its plots from
the result alone.
"""
