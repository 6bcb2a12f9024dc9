"""The tests' S3 endpoint: moto in server mode behind the logging, fault-injecting proxy
(``vqserve.bench.s3_endpoint``, shared with ``vqserve bench tokenize --s3``)."""

from vqserve.bench.s3_endpoint import ACCESS_KEY, SECRET_KEY, Fault, ObjectStore, Request

__all__ = ["ACCESS_KEY", "SECRET_KEY", "Fault", "ObjectStore", "Request"]
