"""vqserve.offline: batch tokenization of whole datasets (``vqserve tokenize``), the shard
format it writes, ``vqserve verify`` and the way back to images (``vqserve detokenize``).

It sits beside :mod:`vqserve.serve`, not inside it: both run a model through the same
:mod:`vqserve.export` runtimes and the same preprocessing (``core/images.py``), and
neither imports the other (an import-linter contract), so the batch pipeline never drags
in gRPC and the server never carries dataset code.
"""
