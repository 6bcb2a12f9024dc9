"""vqserve.bench: benchmark and soak drivers (``vqserve bench``, ``make soak``).

They measure the layers below them side by side (the server against TorchServe, the
tokenize pipeline against its raw runtime, the loader against plain pyarrow), so they may
import :mod:`vqserve.serve` and :mod:`vqserve.offline`; nothing below imports them.
"""
