"""On-disk formats of an exported artifact: the graphs each format holds, how each is written,
the ``manifest.json`` beside them, and the proof that the quantizer is an fp32 island inside."""
