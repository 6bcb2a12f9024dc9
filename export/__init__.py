"""vqserve.export: exported artifacts (TorchScript, ONNX, torch.export) and the runtimes that load them."""
