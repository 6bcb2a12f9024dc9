"""The Show-o family: Show-o / MMaDA's MAGVIT-v2 (showlab/magvitv2, LFQ 13 bits), imported once.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads; ``networks``
the rebuilt encoder/decoder; ``importer`` the ``vqserve import showo`` converter.
"""
