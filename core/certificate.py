"""The batch-invariance certificate: what a runtime's start-up check found, as a plain record.

The check itself runs the model (``vqserve.export.runtimes.determinism``); its result travels
further than the model does: into an artifact's manifest, GetModelInfo, the server's logs and
metrics, and from the device executor to every front-end process, which must read it without
loading torch. So the record lives here, on the ground floor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Certificate:
    """What was checked and what held. ``batch_invariant``: every image's tokens were the
    same alone, in every batch size and position tried, and with 1 or several workers."""

    batch_invariant: bool
    decode_batch_invariant: bool
    images: int
    image_size: list[int]
    source: str
    batch_sizes: list[int]
    compositions: int                 # shuffled batchings tried per batch size
    workers: list[int]
    plan: dict
    token_mismatch_fraction: float = 0.0
    pixel_mismatch_fraction: float = 0.0
    device: str = ""
    backend: str = ""
    dtype: str = ""
    notes: list[str] = field(default_factory=list)
    # the share of these images' tokens whose fp32 decision margin is below 1e-4 / 1e-5
    # (vqserve.model.ties): tokens another correct fp32 machine may round otherwise; {} when
    # not measured (no fp32 eager model at hand)
    margins: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def invariant(self) -> bool:
        """Tokens and decoded pixels both held: what the server, the planner and export require."""
        return self.batch_invariant and self.decode_batch_invariant

    def summary(self) -> str:
        """One line for logs and GetModelInfo."""
        what = (f"{self.images} images {self.image_size[0]}x{self.image_size[1]} ({self.source}), "
                f"batch sizes {self.batch_sizes} x {self.compositions} shuffles, workers {self.workers}")
        if self.invariant:
            return f"batch-invariant: tokens and decoded pixels identical across {what}" + self._margin_note()
        parts = []
        if not self.batch_invariant:
            parts.append(f"tokens changed with the batch ({self.token_mismatch_fraction:.4%} of positions)")
        if not self.decode_batch_invariant:
            parts.append(f"decoded pixels changed with the batch ({self.pixel_mismatch_fraction:.4%})")
        return "NOT batch-invariant: " + "; ".join(parts) + f" across {what}" + self._margin_note()

    def _margin_note(self) -> str:
        if not self.margins:
            return ""
        m = self.margins
        below = m["below"].get("0.0001", 0)
        return (f"; {below} of {m['tokens']} tokens ({m['share_below'].get('0.0001', 0.0):.1e}) lie within "
                "1e-4 of a rounding boundary (fp32 ties another machine may round otherwise)")
