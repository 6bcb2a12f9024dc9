"""The taming family: taming-transformers VQGANs (and Meta's Chameleon VQGAN), imported once from .ckpt + yaml.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads (the
:class:`~vqserve.model.families.base.Family` it registers); ``layout`` maps taming's tensor
names onto vqserve's rebuild (IBQ and MoVQGAN use the same names), ``importer`` is the
``vqserve import taming`` converter and ``precision`` the bf16/fp16 flip measurement.
"""
