"""vqserve: serve trained image tokenizers (FSQ / LFQ / VQ) with an fp32 quantizer island.

The distribution installs four packages: ``vqserve`` (this root: version and the CLI),
``vqserve.model`` (from ``model/``), ``vqserve.export`` (from ``export/``) and
``vqserve.serve`` (from ``serve/``). Data flows one way: model -> export -> serve.
"""

__version__ = "0.1.0"
