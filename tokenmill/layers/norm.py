"""RMSNorm, computed in float32 as the reference implementations do (one op: tokenmill's CPU kernel
at inference, PyTorch's otherwise)."""
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset  # Gemma stores w and multiplies by (1 + w)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def factor(self) -> torch.Tensor:
        """What the normalised input is multiplied by: w, or Gemma's 1 + w."""
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable_for(x):
            return kernels.rms_norm(x, self.factor(), self.eps)
        if self.offset:
            y = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
            return (y * (self.offset + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
