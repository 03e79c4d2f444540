"""`tokenmill qat`: quantization-aware training. Start from a post-training quantization (RTN, AWQ
or GPTQ: `quantize.quantize_model`), then train with the quantizer in the forward pass against the
float teacher (`distill`'s temperature-scaled KL), and write the integers trained against as the
same AWQ/GPTQ checkpoint `tokenmill quantize` writes.

The quantizer is a parametrization of each decoder linear layer's weight (`FakeQuant`):

    w_hat = (clamp(round(w / s) + z, 0, 2^bits - 1) - z) * s      per group of inputs (g_idx)

- `w` is a latent float weight, initialised to the values the PTQ rounded (`latent_start`), so
  step 0 is exactly the PTQ model; rounding passes gradients straight through (STE, Bengio et
  al. 2013).
- `s` is learnable, as log s (a learning rate then means a relative change, whatever the layer's
  scale); through the STE its gradient is LSQ's (Esser et al. 2020): round(w/s) - w/s inside the
  range, the clamped level outside it. Adam normalises LSQ's gradient-scale factor away, so the
  separate `--scale-lr` stands in for it. The forward uses s rounded to float16 (straight through),
  the precision the checkpoint stores, so the exported integers and scales are exactly the ones
  trained against.
- `z` stays the PTQ start's integer zero point: the checkpoint layouts store integer zeros, and a
  continuous zero would round to a different grid at export.
Norms and biases train as float (the checkpoints keep them float); the embedding (and a tied
output head) stays frozen, as in `distill`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from tokenmill.compress import distill, qalgo
from tokenmill.compress.quantize import QuantizeConfig
from tokenmill.layers.linear import Linear
from tokenmill.models.llama import CausalLM

INITS = ("rtn", "awq", "gptq")
SCALE_PARAM = "log_scale"  # the name distill's optimizer groups key on


@dataclass(frozen=True)
class QATConfig:
    bits: int = 4
    group_size: int = 128              # 4 bits: inputs per scale; 8 bits: -1 (per output channel)
    init: str = "rtn"
    allow_partial_groups: bool = False
    act_order: bool | None = None      # GPTQ start: columns by decreasing activation energy (None: on)
    calib_samples: int = 128
    calib_seq_len: int = 512
    scale_lr: float = 1e-3             # Adam learning rate of log s (0: scales frozen, plain STE)

    def quantize_config(self) -> QuantizeConfig:
        """The post-training quantization QAT starts from (and whose checkpoint layout it writes)."""
        method = {"awq": "awq", "gptq": "gptq"}.get(self.init, "rtn-int8" if self.bits == 8 else "rtn-int4")
        return QuantizeConfig(method, self.group_size, self.calib_samples, self.calib_seq_len, self.act_order,
                              allow_partial_groups=self.allow_partial_groups)

    def validate(self, model: CausalLM) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"--bits must be 4 or 8, got {self.bits}.")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {list(INITS)}, got {self.init!r}.")
        if self.bits == 8 and (self.init != "rtn" or self.group_size != -1):
            raise ValueError("--bits 8 is per-channel symmetric int8 (what the int8 kernels run): it takes "
                             "--group-size -1 and --init rtn.")
        if self.bits == 4 and self.group_size == -1:
            raise ValueError("--bits 4 needs a --group-size (32, 64, 128 or 256).")
        if not 0 <= self.scale_lr < 1:
            raise ValueError(f"--scale-lr must lie in [0, 1), got {self.scale_lr}.")
        self.quantize_config().validate(model)

    def quantization_config(self) -> dict:
        """The checkpoint's quantization_config: the layout of the PTQ start, marked as QAT."""
        cfg = self.quantize_config().hf_quantization_config()
        if cfg["quant_method"] == "gptq":
            cfg["quantizer"] = [f"tokenmill:qat-{self.init}"]
        return cfg


class _StraightThrough(torch.autograd.Function):
    """Rounding forward (to integers, or to float16 values), identity backward. Unlike
    x + (r(x) - x).detach(), the value is exactly r(x): the integers and scales the forward uses
    are bit for bit the ones `quantized` writes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, to_half: bool) -> torch.Tensor:
        return x.half().float() if to_half else x.round()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FakeQuant(nn.Module):
    """The weight parametrization: latent float weight -> its quantized value (see module doc)."""

    def __init__(self, qw: qalgo.QuantizedWeight) -> None:
        super().__init__()
        self.bits = qw.bits
        self.log_scale = nn.Parameter(qw.scales.float().log(), requires_grad=False)
        self.register_buffer("zeros", qw.zeros.float())
        self.register_buffer("g_idx", qw.g_idx.long())
        self.step_weight: torch.Tensor | None = None  # see `step_weights`

    def stored_scales(self) -> torch.Tensor:
        """Scales as the checkpoint stores them (float16 values), differentiable straight through."""
        return _StraightThrough.apply(self.log_scale.exp(), True)

    def levels(self, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """Integer levels 0..2^bits-1 (as float), gradients straight through the rounding; scales
        and zeros already expanded to one column per input."""
        return (_StraightThrough.apply(w / scales, False) + zeros).clamp(0, 2 ** self.bits - 1)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.step_weight is not None:
            return self.step_weight
        s, z = self.stored_scales()[:, self.g_idx], self.zeros[:, self.g_idx]
        return (self.levels(w, s, z) - z) * s

    @torch.no_grad()
    def quantized(self, w: torch.Tensor) -> qalgo.QuantizedWeight:
        """The integers this forward computes, in the form the checkpoint writers take."""
        s = self.stored_scales()
        q = self.levels(w, s[:, self.g_idx], self.zeros[:, self.g_idx])
        return qalgo.QuantizedWeight(q.long(), self.zeros.long(), s, self.g_idx, self.bits)


def latent_start(model: CausalLM, results: dict[str, qalgo.QuantizedWeight]) -> None:
    """After `quantize_model` (whose layers hold the dequantized values): put back the float values
    the PTQ rounded (`QuantizedWeight.source`: AWQ's scaled weights, GPTQ's error-compensated
    columns), so that step 0 reproduces the PTQ integers exactly while each latent weight keeps
    its distance to the rounding boundary; starting at the grid points instead would leave every
    weight half a step from its first flip."""
    modules = dict(model.named_modules())
    for name, qw in results.items():
        if qw.source is None:
            raise ValueError(f"{name}: the quantization result does not record the values it rounded.")
        modules[name].weight.data.copy_(qw.source)
        qw.source = None


def attach(model: CausalLM, results: dict[str, qalgo.QuantizedWeight]) -> None:
    """Put a FakeQuant on every quantized layer; the layer's current float weight (see
    `latent_start`) becomes its latent weight."""
    modules = dict(model.named_modules())
    for name, qw in results.items():
        m = modules[name]
        if not isinstance(m, Linear) or m.weight is None:
            raise ValueError(f"{name} is not a float linear layer; QAT starts from float weights.")
        parametrize.register_parametrization(m, "weight", FakeQuant(qw))


@contextlib.contextmanager
def step_weights(model: CausalLM) -> Iterator[None]:
    """One training step's quantized weights, computed once: inside, every layer serves a detached
    copy (a leaf that collects the gradients of all the step's sequences, each backpropagated and
    freed in turn); on leaving, those gradients flow once through the quantizer to the latent
    weights and log scales. Recomputing the quantizer per sequence would cost as much again as
    the sequence's own backward; one graph for the whole step would hold every sequence's
    activations at once."""
    fakes = [(m.parametrizations.weight[0], m.parametrizations.weight.original) for m in model.modules()
             if isinstance(m, Linear) and parametrize.is_parametrized(m, "weight")]
    values = []
    for fq, latent in fakes:
        value = fq(latent)
        fq.step_weight = value.detach().requires_grad_()
        values.append(value)
    try:
        yield
        grads = [(v, fq.step_weight.grad) for v, (fq, _) in zip(values, fakes) if fq.step_weight.grad is not None]
        if grads:
            torch.autograd.backward([v for v, _ in grads], [g for _, g in grads])
    finally:
        for fq, _ in fakes:
            fq.step_weight = None


def finish(model: CausalLM) -> dict[str, qalgo.QuantizedWeight]:
    """Fold each parametrization away (the layer keeps its quantized value as a float weight) and
    return the integer forms by module name, ready for `quantize.checkpoint_tensors`."""
    out: dict[str, qalgo.QuantizedWeight] = {}
    for name, m in list(model.named_modules()):
        if isinstance(m, Linear) and parametrize.is_parametrized(m, "weight"):
            fq = m.parametrizations.weight[0]
            out[name] = fq.quantized(m.parametrizations.weight.original)
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
            m.weight.requires_grad_(False)
    return out


def train(teacher: CausalLM, student: CausalLM, train_ids: list[int], eval_ids: list[int] | None,
          cfg: distill.DistillConfig, scale_lr: float, work_dir: str, progress: bool = True) -> list[dict]:
    """`distill.distill` on a student with fake quantizers attached: the log scales at their own
    learning rate, each step's quantized weights computed once (`step_weights`)."""
    return distill.distill(teacher, student, train_ids, eval_ids, cfg, work_dir, progress=progress,
                           lrs={SCALE_PARAM: scale_lr}, desc="qat", step_context=lambda: step_weights(student))


def save_start(work_dir: str, cfg: QATConfig, model: CausalLM, results: dict[str, qalgo.QuantizedWeight]) -> None:
    """The PTQ start (model weights after folding and rounding, and the integer grid), so a resumed
    run skips the calibration and is bit-identical to one that never stopped."""
    os.makedirs(work_dir, exist_ok=True)
    tmp = os.path.join(work_dir, "start.pt.tmp")
    torch.save({"qat": asdict(cfg), "model": model.state_dict(),
                "grid": {n: {"zeros": q.zeros, "scales": q.scales, "g_idx": q.g_idx, "bits": q.bits}
                         for n, q in results.items()}}, tmp)
    os.replace(tmp, os.path.join(work_dir, "start.pt"))


def load_start(work_dir: str, cfg: QATConfig, model: CausalLM) -> dict[str, qalgo.QuantizedWeight] | None:
    """Restore a saved PTQ start into `model`; None when `work_dir` has none."""
    path = os.path.join(work_dir, "start.pt")
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=True)
    if state["qat"] != asdict(cfg):
        raise ValueError(f"{work_dir} holds a QAT run with other settings ({state['qat']}); rerun with the same "
                         "flags to resume, or delete that directory to start afresh.")
    model.load_state_dict(state["model"])
    return {n: qalgo.QuantizedWeight(torch.empty(0), g["zeros"], g["scales"], g["g_idx"], g["bits"])
            for n, g in state["grid"].items()}
