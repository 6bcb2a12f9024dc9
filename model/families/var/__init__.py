"""The VAR family: FoundationVision/VAR's multi-scale residual VQ-VAE (pyramid tokens), imported once, served by vqserve.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads (the
:class:`~vqserve.model.families.base.Family` it registers); ``networks`` its encoder and
decoder, ``importer`` the ``vqserve import var`` converter, ``precision`` its per-scale
bf16/fp16 agreement measurement. The quantizer is ``vqserve.model.quantizers.multiscale``.
"""
