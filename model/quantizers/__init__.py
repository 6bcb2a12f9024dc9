"""Quantizers: FSQ, LFQ, VQ and residual FSQ, each an fp32 island.

All take channel-last ``z[..., d]`` and return ``(codes, indices)`` (plus a dict of aux
losses with ``return_aux=True``). Codes come back in ``z``'s dtype, indices as int64.
"""

from vqserve.model.quantizers.fsq import FSQ
from vqserve.model.quantizers.lfq import LFQ
from vqserve.model.quantizers.residual import ResidualFSQ
from vqserve.model.quantizers.vq import VQ

__all__ = ["FSQ", "LFQ", "VQ", "ResidualFSQ"]
