"""vqserve: serve trained image tokenizers (FSQ / LFQ / VQ) with an fp32 quantizer island.

The distribution installs, each from its own top-level folder: ``vqserve`` (this root: the
version, the CLI and the Python face), ``vqserve.core`` (``core/``, the torch-free ground),
``vqserve.model`` (``model/``), ``vqserve.export`` (``export/``), ``vqserve.serve`` (``serve/``,
the online server), ``vqserve.offline`` (``offline/``, ``vqserve tokenize`` and its shards),
``vqserve.training`` (``training/``) and ``vqserve.bench`` (``bench/``, benchmark and soak
drivers). Data flows one way: core -> model -> export -> serve | offline -> training | bench
-> CLI (docs/ARCHITECTURE.md). Modules moved by the layout step keep their old import names
for one release (``vqserve._moved``).
"""

from vqserve import _moved

__version__ = "0.1.0"

_moved.install()
