"""Per-rank state of one linear-attention layer: the conv window and the delta-rule memory."""

from __future__ import annotations

import torch
from torch import nn


class RecurrentState(nn.Module):
    """What a Gated DeltaNet layer carries from one forward call to the next.

    Unlike a KV cache it does not grow with the context: `conv` holds the last
    kernel_size - 1 inputs of the causal conv, `ssm` the (key x value) memory of each of this
    rank's value heads, kept in float32 whatever the compute dtype (it accumulates).

    Args:
        batch: cache rows (one state per sequence).
        conv_channels: this rank's conv channels ([Q | K | V] local widths).
        conv_window: kernel_size - 1.
        num_heads, key_dim, value_dim: this rank's value heads and the per-head sizes.
    """

    def __init__(
        self,
        batch: int,
        conv_channels: int,
        conv_window: int,
        num_heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        conv = torch.zeros(batch, conv_channels, conv_window, dtype=dtype, device=device)
        ssm = torch.zeros(batch, num_heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.register_buffer("conv", conv, persistent=False)
        self.register_buffer("ssm", ssm, persistent=False)

    @torch.inference_mode()  # the buffers are inference tensors when built under load_model
    def reset(self, row: int | None = None) -> None:
        """Zero one row's state (a new sequence there), or every row's."""
        rows = slice(None) if row is None else slice(row, row + 1)
        self.conv[rows].zero_()
        self.ssm[rows].zero_()

    @torch.inference_mode()
    def copy_row(self, src: int, dst: int) -> None:
        """Give row `dst` row `src`'s state, bit for bit."""
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes
