"""vqserve.export: exported artifacts (TorchScript, ONNX, torch.export) and the runtimes that load them.

One job per module:

* ``wrappers``: the self-contained encode/decode modules every format holds (uint8 NHWC in,
  indices out and back; networks in the export dtype, the quantizer an fp32 island);
* ``torchscript`` / ``onnx_export`` / ``pt2``: writing each format;
* ``inspect_graph``: proving the fp32 island is real inside each saved graph;
* ``parity``: validation photographs and agreement / utilization / PSNR vs fp32 eager;
* ``manifest``: ``manifest.json`` (formats, dtypes, sha256, parity) read / write / verify;
* ``exporter``: ``export_model``, the checked, atomic export behind ``vqserve export``;
* ``checks``: numpy input validation shared by the runtimes;
* ``runtime``: the Runtime interface, ``EagerRuntime`` and ``load_runtime``;
* ``runtimes``: TorchScript, ONNX Runtime and torch.export runtimes;
* ``bench``: ``vqserve bench runtimes``;
* ``torchserve`` / ``torchserve_handler``: TorchServe ``.mar`` archives and the handler
  that runs a vqserve runtime inside TorchServe's worker.
"""
