"""``python -m vqserve.bench.gpu``: the same as ``vqserve bench gpu``."""

from vqserve.bench.gpu.run import main

if __name__ == "__main__":
    raise SystemExit(main())
