"""The protocol adapters: what a gRPC call becomes before it reaches the engine, and back.

``v1`` (vqserve.v1.Tokenizer) and ``oip`` (Open Inference Protocol v2) are thin adapters over
the one engine; ``rawrequest`` reads pixels in place, ``codec`` and ``decoding`` turn bytes
into arrays, ``errors`` maps failures to status codes, ``gates`` are the interceptors (auth,
stream limits) and ``discovery`` the health and reflection services. No torch.
"""
