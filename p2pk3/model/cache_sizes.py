"""The byte sizes of a stage's caches, defined once: `StageCache` (p2pk3/model/cache.py) allocates with them
and the memory estimators (p2pk3/topology/sizing.py, p2pk3/plan/) charge them. Torch-free: a dtype is
anything with an `itemsize` (a torch.dtype, or `DTypeSize` for the estimators)."""

from __future__ import annotations

from typing import NamedTuple


class DTypeSize(NamedTuple):
    """A dtype by name and bytes per value, for estimates without torch."""

    name: str
    itemsize: int


BF16 = DTypeSize("bfloat16", 2)
KDA_STATE_DTYPE_NAME = "float32"  # recurrent state and short-conv history (fp32 whatever the activation dtype)
KDA_STATE_ITEMSIZE = 4
DEFAULT_BLOCK_SIZE = 64  # MLA cache tokens per block


def kda_session_bytes(kda_heads: int, kda_head_dim: int, conv_channels: int, conv_size: int) -> int:
    """One session's KDA state in one layer: the recurrent state [H, K, K] and the last conv_size - 1
    pre-conv inputs of q, k, v [3C, conv_size - 1], both in the KDA state dtype."""
    item = KDA_STATE_ITEMSIZE
    return kda_heads * kda_head_dim * kda_head_dim * item + conv_channels * (conv_size - 1) * item


def mla_blocks(max_tokens: int, max_sessions: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """MLA cache blocks of one layer's pool: `max_tokens` over all sessions plus one partly filled block per
    session."""
    return -(-max_tokens // block_size) + max_sessions


def mla_pool_bytes(
    max_tokens: int, max_sessions: int, mla_width: int, dtype, block_size: int = DEFAULT_BLOCK_SIZE
) -> int:
    """One MLA layer's paged latent cache: `mla_blocks` blocks of block_size x mla_width in `dtype` (the
    stage's activation dtype; anything with `itemsize`)."""
    return mla_blocks(max_tokens, max_sessions, block_size) * block_size * mla_width * dtype.itemsize
