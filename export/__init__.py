"""vqserve.export: exported artifacts and the runtimes that run a model, one subpackage a job.

* ``formats/``: what an artifact directory holds, written and read per format: the
  self-contained encode/decode ``wrappers`` every format holds, ``torchscript``, ``onnx``,
  ``pt2``, the ``manifest``, and ``inspect_graph`` (proof the fp32 island is in the graph);
* ``runtimes/``: what serves and tokenizes: ``loader`` (``load_runtime``, ``EagerRuntime``),
  ``artifacts`` (TorchScript / ONNX Runtime / pt2), ``cuda_graphs``, ``synthetic``,
  ``execution`` (batch-invariant calls), ``determinism`` and ``checks``;
* ``plan/``: the execution plan (candidates, measurement, choice, the plan file);
* ``exporter`` and ``parity``: the ``vqserve export`` pipeline, checked against fp32 eager;
* ``torchserve/``: TorchServe archives, the handler inside them and a TorchServe on loopback.
"""
