"""Python clients of a running ``vqserve serve``: ``TokenizerClient`` and ``AsyncTokenizerClient``
(``sync``), and how they cut work into calls (``batches``). No torch: a client machine needs
only numpy, Pillow and gRPC."""
