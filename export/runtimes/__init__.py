"""Runtimes: one small ``Runtime`` interface (``vqserve.core.runtime_info``), implemented once
per backend: eager (``loader``), exported artifacts (``artifacts``), CUDA graphs and the
synthetic stand-in; how they are called so tokens never depend on the batch (``execution``),
and how that is measured on the device at hand (``determinism``)."""
