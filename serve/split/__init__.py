"""The GPU-node layout: request handling in several front-end processes on one port, one device
executor that owns the model, pixels between them through shared memory.

``frontend`` is a front-end process (gRPC, parsing, image decoding, replies, no model; its
``RemoteBatcher`` shares the local batcher's interface), ``executor`` the device executor and
the pool of front-ends it starts, ``listeners`` several gRPC servers on one port in one
process, ``wire`` the front-end <-> executor messages. Front-ends load no torch.
"""
