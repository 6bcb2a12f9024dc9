"""The ``diffusers`` VQModel family: aMUSEd's VQGAN, the LDM VQ-f4/f8 models, Kandinsky's MoVQ.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads (the
:class:`~vqserve.model.families.base.Family` it registers); the other modules, where present,
are its networks, ``vqserve import`` converter and bf16/fp16 flip measurement.
"""
