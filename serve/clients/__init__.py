"""Python clients of a running ``vqserve serve``: ``TokenizerClient`` (``sync``) and
``AsyncTokenizerClient`` (``aio``), what both send and hold (``channel``: the channel, arrays as
messages, ``ServerError``, ``check_health``), and how they cut work into calls (``batches``).
No torch: a client machine needs only numpy, Pillow and gRPC.

The names below are the clients' public face (and what the old module name
``vqserve.serve.client`` gives for one release).
"""

from vqserve.serve.clients.aio import AsyncTokenizerClient
from vqserve.serve.clients.batches import FileError
from vqserve.serve.clients.channel import ServerError, check_health, tensor_array, tensor_msg
from vqserve.serve.clients.sync import TokenizerClient

__all__ = ["AsyncTokenizerClient", "FileError", "ServerError", "TokenizerClient", "check_health",
           "tensor_array", "tensor_msg"]
