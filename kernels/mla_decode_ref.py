"""Weight-absorbed MLA decode over a paged latent cache, torch reference (spec 3.2).

Every query head attends to one shared cache row per token: [c (R = kv_lora_rank, post-norm) ; k_pe (P)].
score = (q_lat . c + q_pe . k_pe) * scale; softmax over the sequence; z = sum p * c (output in the
latent width R; the caller applies W_UV, the gate and o_proj). No positional encoding (NoPE).
All sequences at once over the block table's width, the positions beyond each length masked (a fixed
handful of ops whatever the batch, no host sync).
"""

from __future__ import annotations

import torch


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_lat [B, H, R]; q_pe [B, H, P]; kv_cache [num_blocks, block_size, R + P];
    block_table [B, max_blocks] int (block ids of each sequence in order); seq_lens [B] (tokens to attend,
    the current one included). Returns z [B, H, R] fp32."""
    B, H, R = q_lat.shape
    nb, bs = block_table.shape[1], kv_cache.shape[1]
    kv = kv_cache[block_table.long()].reshape(B, nb * bs, kv_cache.shape[-1]).float()  # [B, T, R+P]
    s = (q_lat.float() @ kv[..., :R].transpose(1, 2) + q_pe.float() @ kv[..., R:].transpose(1, 2)) * scale  # [B, H, T]
    beyond = torch.arange(nb * bs, device=s.device) >= seq_lens.to(s.device).unsqueeze(-1)  # [B, T]
    beyond = beyond.unsqueeze(1)
    p = torch.softmax(s.masked_fill(beyond, -float("inf")), -1)  # exactly 0 beyond each length ...
    return p.masked_fill(beyond, 0.0) @ kv[..., :R]  # ... and z = 0 for a zero length (not NaN)
