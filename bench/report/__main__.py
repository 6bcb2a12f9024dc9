"""``python -m vqserve.bench.report``: the same as ``vqserve bench all``."""

from vqserve.bench.report.run import main

if __name__ == "__main__":
    raise SystemExit(main())
