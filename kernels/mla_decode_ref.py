"""Weight-absorbed MLA decode over a paged latent cache, torch reference (spec 3.2).

Every query head attends to one shared cache row per token: [c (R = kv_lora_rank, post-norm) ; k_pe (P)].
score = (q_lat . c + q_pe . k_pe) * scale; softmax over the sequence; z = sum p * c (output in the
latent width R; the caller applies W_UV, the gate and o_proj). No positional encoding (NoPE).
"""
from __future__ import annotations

import torch


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_lat [B, H, R]; q_pe [B, H, P]; kv_cache [num_blocks, block_size, R + P];
    block_table [B, max_blocks] int (block ids of each sequence in order); seq_lens [B] (tokens to attend,
    the current one included). Returns z [B, H, R] fp32."""
    B, H, R = q_lat.shape
    bs = kv_cache.shape[1]
    out = torch.empty(B, H, R, dtype=torch.float32, device=q_lat.device)
    for i in range(B):
        L = int(seq_lens[i])
        nb = (L + bs - 1) // bs
        kv = kv_cache[block_table[i, :nb].long()].reshape(nb * bs, kv_cache.shape[-1])[:L].float()  # [L, R+P]
        s = (q_lat[i].float() @ kv[:, :R].T + q_pe[i].float() @ kv[:, R:].T) * scale  # [H, L]
        out[i] = torch.softmax(s, -1) @ kv[:, :R]
    return out
