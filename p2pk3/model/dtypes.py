"""The activation / wire dtypes by name: the one map used by the in-process engine (`--dtype`), the
daemon's stage runner (tensor bytes on the wire) and anything else that turns a dtype name into torch."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """ "bfloat16" -> torch.bfloat16 (a torch.dtype of the map passes through). Anything else is a
    ValueError that names the allowed dtypes."""
    if isinstance(name, torch.dtype):
        if name in TORCH_DTYPES.values():
            return name
        raise ValueError(f"dtype {name} is not supported: use one of {', '.join(TORCH_DTYPES)}")
    try:
        return TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {name!r} is not supported: use one of {', '.join(TORCH_DTYPES)}") from None
