"""Count host <-> device transfers while a block runs: the places where a GPU decode round waits.

`TransferCounter` is a `TorchFunctionMode` (plus a patched `torch.from_numpy`, which modes do not
see).  Device -> host: `item`, `tolist`, `bool` / `int` / `float` / `index` of a tensor, `numpy`,
`__array__`, `cpu` and `.to(cpu)` of a device tensor.  Host -> device: `.to(<device>)` / `cuda`
of a host tensor, a host tensor of more than one element meeting a device tensor in one op (an
implicit copy, e.g. indexing a device tensor with host indices), and `torch.tensor` /
`as_tensor` / `new_tensor` of Python data on the device.  Separately, `host_built` counts the
tensors built on the host from Python or NumPy data or by a factory called without a device.

Tests run on the CPU, where every tensor is a host tensor.  With `host_is_device=True` the
counter plays a GPU: a tensor is a host tensor when it was built on the host inside the block
(`torch.tensor`, `from_numpy`, `arange` and the other factories called without a device, `cpu`)
or computed from host tensors only; every other tensor (a model's outputs, the prompt, whatever
was built with `device=`) lives on "the device", and `.to(<a device>)` moves a tensor there.

Only calls made from `sources` (the runtime's folders by default) are counted in the totals; the
others (a model's forward inside transformers) are kept apart in `elsewhere`.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import specstop.decoder
import specstop.features

RUNTIME = tuple(str(Path(m.__file__).parent) for m in (specstop.decoder, specstop.features))
SKIPPED = (str(Path(torch.__file__).parent) + "/", __file__)  # frames that are not the caller's
TO_HOST = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy",
           "__array__"}
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye,
             torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace}
FROM_DATA = {torch.tensor, torch.as_tensor}


class TransferCounter(TorchFunctionMode):
    """Counts, per call site (`file:line`), the host <-> device transfers made while active."""

    def __init__(self, host_is_device: bool = False, sources: tuple[str, ...] = RUNTIME) -> None:
        super().__init__()
        self.host_is_device = host_is_device
        self.sources = sources
        self.to_host: Counter[str] = Counter()
        self.to_device: Counter[str] = Counter()
        self.host_built: Counter[str] = Counter()
        self.elsewhere: Counter[str] = Counter()  # transfers made outside `sources`
        self._host = WeakIdKeyDictionary()  # host_is_device: the tensors built on the host
        self._from_numpy: Callable[..., torch.Tensor] | None = None

    def totals(self) -> dict[str, int]:
        return {"to_host": self.to_host.total(), "to_device": self.to_device.total(),
                "host_built": self.host_built.total()}

    def __enter__(self) -> TransferCounter:
        self._from_numpy = torch.from_numpy
        torch.from_numpy = self._counted_from_numpy
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.from_numpy = self._from_numpy
        super().__exit__(*exc)

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        return self._classify(func, args, kwargs, out)

    def _counted_from_numpy(self, array: Any) -> torch.Tensor:
        out = self._from_numpy(array)
        self._record(self.host_built, "from_numpy")
        self._host[out] = True
        return out

    def _classify(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
        """Count what `func(*args, **kwargs)` -> `out` transferred; returns `out` (a new alias
        when a move returned its source tensor itself: its copy must not retag the source)."""
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and name in ("to", "cpu", "cuda"):
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0] if name == "to" else \
                torch.device(name)
            if out is source and device is not None and self.host_is_device:
                out = out.view_as(out)
            self._moved(name, source, out, device)
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in TO_HOST and source is not None:
            if not self.on_host(source):
                self._record(self.to_host, name)
        elif func in FROM_DATA or name == "new_tensor":
            self._built(name, results, kwargs, source, from_data=True)
        elif func in FACTORIES or name.startswith("new_"):
            self._built(name, results, kwargs, source, from_data=False)
        else:
            self._computed(name, tensors, results)
        return out

    def _moved(self, name: str, source: torch.Tensor, out: torch.Tensor,
               device: torch.device | None) -> None:
        """`to` / `cpu` / `cuda`: a copy when the tensor changes side (`to(<a device>)` goes to
        the device when `host_is_device`)."""
        if device is None:  # a dtype change only: stays where it is
            self._mark([out], host=self.on_host(source))
            return
        to_host = name == "cpu" or device.type == "cpu" and not self.host_is_device
        if to_host and not self.on_host(source):
            self._record(self.to_host, name)
        elif not to_host and self.on_host(source):
            self._record(self.to_device, name)
        self._mark([out], host=to_host)

    def _built(self, name: str, results: list[torch.Tensor], kwargs: dict,
               source: torch.Tensor | None, from_data: bool) -> None:
        """A factory: on the host unless given a device (or, `new_*`, made from a device
        tensor); Python data sent to the device is a copy."""
        if source is not None and from_data and name == "as_tensor":
            return  # as_tensor of a tensor: the tensor itself
        host = kwargs.get("device") is None and (source is None or self.on_host(source))
        if host:
            self._record(self.host_built, name)
        elif from_data:
            self._record(self.to_device, name)
        self._mark(results, host=host)

    def _computed(self, name: str, tensors: list[torch.Tensor],
                  results: list[torch.Tensor]) -> None:
        """Any other op: on the device if an input is; a host input meeting it is copied."""
        on_device = [t for t in tensors if not self.on_host(t)]
        if not tensors or on_device:
            if any(self.on_host(t) and t.dim() > 0 for t in tensors) and on_device:
                self._record(self.to_device, f"{name} (implicit)")
            self._mark(results, host=False)
        else:
            self._mark(results, host=True)

    def on_host(self, tensor: torch.Tensor) -> bool:
        if self.host_is_device:
            return tensor in self._host
        return tensor.device.type == "cpu"

    def _mark(self, tensors: list[torch.Tensor], host: bool) -> None:
        if not self.host_is_device:
            return
        for t in tensors:
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

    def _record(self, counter: Counter[str], what: str) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(SKIPPED):
            frame = frame.f_back
        file = frame.f_code.co_filename if frame is not None else "?"
        site = f"{Path(file).parent.name}/{Path(file).name}:{frame.f_lineno if frame else 0} " \
               f"{what}"
        if file.startswith(self.sources):
            counter[site] += 1
        else:
            self.elsewhere[site] += 1

    def report(self) -> str:
        """Every counted site, most frequent first."""
        lines = []
        for title, counter in [("device -> host", self.to_host),
                               ("host -> device", self.to_device),
                               ("built on the host", self.host_built)]:
            lines.append(f"{title}: {counter.total()}")
            lines += [f"  {n:5d}  {site}" for site, n in counter.most_common()]
        return "\n".join(lines)
