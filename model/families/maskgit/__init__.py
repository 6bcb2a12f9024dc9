"""The MaskGIT-VQGAN family: Google's MaskGIT tokenizer as open-muse ported it, imported once.

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads; ``networks``
the rebuilt encoder/decoder (TensorFlow "same" padding, the shortcut quirk); ``importer`` the
``vqserve import maskgit`` converter.
"""
