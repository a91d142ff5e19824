"""Tensors given as metrics: recognised without importing torch, read in batches."""

from __future__ import annotations

import sys
from typing import Any


def is_tensor(value: object) -> bool:
    """True for a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def read_if_cpu_float(value: Any) -> float | None:
    """A one-element floating-point tensor on the CPU as a float, else None.

    Reading it is a read of memory (no device synchronisation, 0.1-0.2 us), far cheaper
    than holding it for the interval's stacked read; other tensors are held as before.
    """
    try:
        if value.is_cpu and value.is_floating_point() and value.numel() == 1:
            number = value.item()
            return number if type(number) is float else None
    except Exception:  # noqa: BLE001 - a tensor that cannot be read here is held
        pass
    return None


def detach(value: Any) -> Any:
    """The tensor without its autograd graph, so that holding it keeps no activations."""
    try:
        return value.detach()
    except Exception:  # noqa: BLE001
        return value


def resolve_tensors(values: list[Any], *, cpu_only: bool = False) -> list[Any]:
    """Python numbers for one-element tensors: one stacked copy per device and dtype.

    Tensors of other shapes become nested lists. With ``cpu_only``, tensors on
    an accelerator are not read (a hung device would hang the reader) and
    become ``"<unresolved tensor>"``.
    """
    out: list[Any] = [None] * len(values)
    groups: dict[tuple[str, str], list[int]] = {}
    for index, value in enumerate(values):
        try:
            device = str(value.device)
            if cpu_only and not device.startswith("cpu"):
                out[index] = "<unresolved tensor>"
            elif value.numel() == 1:
                groups.setdefault((device, str(value.dtype)), []).append(index)
            else:
                out[index] = value.detach().cpu().tolist()
        except Exception:  # noqa: BLE001
            out[index] = f"<unconvertible {type(value).__name__}>"
    torch = sys.modules.get("torch")
    for indices in groups.values():
        try:
            assert torch is not None
            stacked = torch.stack([values[i].detach().reshape(()) for i in indices])
            numbers = stacked.tolist()
        except Exception:  # noqa: BLE001 - fall back to one read per tensor
            numbers = []
            for i in indices:
                try:
                    numbers.append(values[i].item())
                except Exception:  # noqa: BLE001
                    numbers.append(f"<unconvertible {type(values[i]).__name__}>")
        for i, number in zip(indices, numbers, strict=False):
            out[i] = number
    return out
