"""Where tokenize reads and writes when that is not a local folder: one filesystem layer.

Every ``vqserve tokenize`` input and ``--out``, and every reader of an output folder
(``verify``, ``detokenize``, ``TokenShards``), takes a URL wherever it takes a path:
``s3://``, ``gs://``, ``hf://`` (read) and ``file://``. They all go through fsspec
(:mod:`.fs`: which filesystem, its options, one per process so DataLoader and decode
workers each open their own), a path-like view of a remote folder (:mod:`.paths`), and
the object-store writes that hold without a rename (:mod:`.objects`: whole uploads
checked after the fact, the exclusive put that lets only one run commit a manifest).
Credentials come from the standard chains (``AWS_*`` with ``AWS_ENDPOINT_URL``, profiles,
workload identity) or ``--storage-options``; :func:`.fs.redact` keeps them out of messages.
"""

from vqserve.offline.storage.fs import StorageError, is_url, redact, set_options
from vqserve.offline.storage.paths import RemotePath, as_path, readable

__all__ = ["RemotePath", "StorageError", "as_path", "is_url", "readable", "redact", "set_options"]
