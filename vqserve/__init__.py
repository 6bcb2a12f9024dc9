"""vqserve: serve trained image tokenizers (FSQ / LFQ / VQ) with an fp32 quantizer island.

The distribution installs, each from its own top-level folder: ``vqserve`` (this root:
version, the CLI, the training-data loader ``vqserve.data``), ``vqserve.model`` (``model/``),
``vqserve.export`` (``export/``), ``vqserve.serve`` (``serve/``, the online server),
``vqserve.offline`` (``offline/``, ``vqserve tokenize`` and its shards) and ``vqserve.bench``
(``bench/``, benchmark and soak drivers). Data flows one way: model -> export -> serve |
offline -> data -> bench -> CLI (docs/ARCHITECTURE.md).
"""

__version__ = "0.1.0"
