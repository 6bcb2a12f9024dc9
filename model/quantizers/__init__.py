"""Quantizers: every fp32 island of the project, one per file.

vqserve's own FSQ, LFQ, VQ and residual FSQ, and the index rules of the imported families,
each reproducing its family's convention exactly: ``cdist`` (diffusers, ``torch.cdist`` +
argmin), ``l2_nearest`` (LlamaGen), ``softmax_max`` (IBQ), ``squared_distance``
(transformers' Janus / Emu3 / Chameleon). The tie and precision tools find them all here.

All take channel-last ``z[..., d]`` and return ``(codes, indices)`` (plus a dict of aux
losses with ``return_aux=True``). Codes come back in ``z``'s dtype, indices as int64.
"""

from vqserve.model.quantizers.fsq import FSQ
from vqserve.model.quantizers.lfq import LFQ
from vqserve.model.quantizers.residual import ResidualFSQ
from vqserve.model.quantizers.vq import VQ

__all__ = ["FSQ", "LFQ", "VQ", "ResidualFSQ"]
