"""The IBQ family: TencentARC's Index Backpropagation Quantization tokenizers, imported once, served by vqserve.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads (the
:class:`~vqserve.model.families.base.Family` it registers); the other modules, where present,
are its networks, ``vqserve import`` converter and bf16/fp16 flip measurement.
"""
