"""The MoVQGAN family: ai-forever's SBER-MoVQGAN 67M / 102M / 270M, imported once, served by vqserve.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads, ``networks``
its spatially-normalised decoder, ``importer`` the ``vqserve import movqgan`` converter and
``precision`` the bf16/fp16 flip measurement.
"""
