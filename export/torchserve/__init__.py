"""TorchServe integration: a vqserve model as TorchServe archives (``archives``), the handler that
runs a vqserve runtime inside TorchServe's worker (``handler``), and a real TorchServe on
loopback for tests and benchmarks (``server``)."""
