"""The TiTok family: ByteDance's 1-D tokenizer (bytedance/1d-tokenizer VQ models; sequence tokens).

One folder per family: ``declare`` is what the family table (``table.py``) reads;
``family`` is what ``load_tokenizer`` detects and loads (the released
folder as it is, or an import); ``networks`` the ViT encoder and decoder (MaskGIT-VQGAN's pixel
decoder reused from the ``maskgit`` family); ``importer`` the ``vqserve import titok`` converter.
The quantizer is ``vqserve.model.quantizers.l2_nearest``.
"""
