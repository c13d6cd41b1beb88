"""CPU kernels for decoding: linear layers through oneDNN with their weights prepacked once.

On CPUs, aten's fp32 `linear` (MKL) over a few rows costs far more than over one: a target pass
over 2-8 tokens took 1.6-2.0 one-token steps on an AVX2 machine (`data/costs/verify.json`),
although the pass is bound by reading the weights, which it reads once whatever the row count.
oneDNN's matmul with the weight reordered once into its blocked layout
(`mkldnn::_reorder_linear_weight`, the op Inductor's CPU freezing uses) reads it once: a pass
over up to about 5 tokens costs about one step, and each row's result does not depend on how
many rows share the pass (the greedy-identity tests rely on that).  bf16 weights, where the CPU
has native bf16: aten's bf16 linear also runs on oneDNN but sets it up again at every call; the
packed one gives bitwise the same result in 0.4-0.8 of the time (the embedded target's output
layer over one row: 1.4 ms against 3.3).

`pack_linears` swaps every `nn.Linear` of a model for a `PackedLinear` in place; the model is
then for inference on the CPU only.  Its state dict still holds plain weights (a truncated draft
is built from the target's), unpacked on demand.
"""

from __future__ import annotations

import torch
from torch import nn

from .load import cpu_has_bf16

KERNELS = ("onednn", "aten")


class PackedLinear(nn.Module):
    """`nn.Linear` for CPU inference, its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._register_state_dict_hook(_dense_weight)

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a copy, unpacked on demand)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def _dense_weight(module: PackedLinear, state: dict, prefix: str, _meta: object) -> None:
    state[prefix + "weight"] = module.weight
    if module.bias is not None:
        state[prefix + "bias"] = module.bias


def packs(model: nn.Module, kernel: str) -> bool:
    """Whether `kernel` packs this model's linear layers: oneDNN on a CPU, for fp32 weights, and
    for bf16 ones where the CPU has native bf16."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU kernel '{kernel}' (choose {' or '.join(KERNELS)})")
    weight = next(model.parameters())
    dtype_packed = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                     and cpu_has_bf16())
    return (kernel == "onednn" and weight.device.type == "cpu" and dtype_packed
            and torch.backends.mkldnn.is_available())


def kernel_of(model: nn.Module) -> str:
    """The kernel `model`'s linear layers run on: 'onednn' once packed, else 'aten'."""
    return "onednn" if any(isinstance(m, PackedLinear) for m in model.modules()) else "aten"


@torch.no_grad()
def pack_linears(model: nn.Module, kernel: str = "onednn") -> nn.Module:
    """Swap every `nn.Linear` of `model` for a `PackedLinear` in place where `kernel` packs it
    (`packs`); returns the model."""
    if not packs(model, kernel):
        return model
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, PackedLinear(child))
    return model
