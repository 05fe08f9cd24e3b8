"""Kimi K3 (and Kimi Linear) text model, one readable file (over 500 lines on purpose: as in mlx-lm, the whole
model reads top to bottom in one place, in spec order); module and parameter names mirror the
checkpoint (`model.layers.N.self_attn.q_proj.weight`, ...), except each Attention-Residual pair, which is
one `AttnResMix` module (`...mlp_res.norm.weight` for the stored `...mlp_res_norm.weight`; the names are
mapped once, by `checkpoint_to_module`, which `p2pk3.model.stage.K3Stage.load_weights` applies). Math and
sources: shared/spec kimi-k3-architecture.md (section numbers in the comments).

Uncertain facts (the official modeling file could not be read; spec section 10) — each is pinned by
tests/test_model.py::test_uncertain_facts_are_pinned so that changing one is a deliberate act:
  * q_a_layernorm / kv_a_layernorm use eps 1e-6, every other norm rms_norm_eps ([V2], three ports);
  * A_log is stored padded (K3: [128] for 96 heads); only the first `heads` entries are used ([V2]);
  * the short conv runs in fp32 on the bf16 projections and its output is cast back (our choice; fla's
    ShortConvolution precision was not checked against K3);
  * the latent-MoE sum is cast to the activation dtype before routed_expert_norm (our reading);
  * SiTU follows the remote code / MLX port, not HF-native transformers' docstring ([V], spec 5.3).

The layers run over a packed batch of token spans from many sessions (`p2pk3.model.batch.Batch`). A
`DecoderLayer` runs whole or as one of its halves (attention, MLP), so that a contiguous run of layers,
possibly half a layer at each end, is a *stage* (`p2pk3.model.stage`: the plan, the embedding and head,
caches, weight loading). What flows between stages is a `Hop`: the running prefix sum, the AttnRes
snapshot bank and, inside a layer whose experts are split over several stages, the partial latent-MoE
sum (spec 4.3).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2pk3_kernels import ops
from p2pk3_kernels.mxfp4_moe_ref import glu_act

from .batch import Batch
from .cache import KdaCheckpoint, StageCache
from .config import K3Config


class ExpertNotHeld(RuntimeError):
    """A token was routed to an expert that no stage of this layer holds."""


# --------------------------------------------------------------------------------------------- basics
class RMSNorm(nn.Module):
    """fp32 statistics, cast back to the activation dtype, then times the weight (spec 1.4)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = h.to(x.dtype) * self.weight
        return out if out.dtype == x.dtype else out.to(x.dtype)  # (the weight is cast at load: no cast)


def linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


def glu(g: torch.Tensor, u: torch.Tensor, cfg: K3Config) -> torch.Tensor:
    """SiTU-GLU (K3, spec 5.3) or SiLU-GLU (Kimi Linear), fp32 math, activation dtype out."""
    return glu_act(g, u, cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta).to(g.dtype)


class MLP(nn.Module):
    """Dense layer-0 MLP and the (fused) shared experts: down(act(gate(x), up(x)))."""

    def __init__(self, cfg: K3Config, width: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = linear(cfg.hidden_size, width)
        self.up_proj = linear(cfg.hidden_size, width)
        self.down_proj = linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.cfg))


# ---------------------------------------------------------------------------------------- KDA (spec 2)
class ShortConv(nn.Module):
    """Causal depthwise conv (kernel 4, no bias, fp32 weight [C, 1, K]) + SiLU, with a cache of the last
    K-1 pre-conv inputs per session. Computed in fp32."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, size))
        self.size = size

    def forward(
        self, x: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, cu_seqlens: list[int] | None = None
    ) -> torch.Tensor:
        """x [N, C] pre-conv inputs -> SiLU(conv(x)) [N, C] fp32, continuing each sequence's history.

        state [S, C, K-1] fp32: the pool of per-session histories (a view is fine), advanced in place.
        rows [B]: the pool row of each sequence. cu_seqlens [B+1]: token offsets of the B sequences;
        None means one token per sequence (decode, N == B)."""
        w = self.weight[:, 0, :].float()  # [C, K]
        keep = w.shape[1] - 1
        xf = x.float()
        if cu_seqlens is None:
            win = torch.cat([state[rows], xf.unsqueeze(-1)], -1)  # [B, C, K]
            out = (win * w).sum(-1)
            state[rows] = win[..., 1:]
            return F.silu(out)
        out = torch.empty_like(xf)
        one = [i for i in range(len(cu_seqlens) - 1) if cu_seqlens[i + 1] - cu_seqlens[i] == 1]
        if len(one) > 1:  # the decode steps of a mixed batch: one vectorised window, as in decode
            ti = torch.tensor([cu_seqlens[i] for i in one], dtype=torch.long, device=xf.device)
            ri = rows[one]
            win = torch.cat([state[ri], xf[ti].unsqueeze(-1)], -1)  # [b, C, K]
            out[ti] = (win * w).sum(-1)
            state[ri] = win[..., 1:]
            one = set(one)
        else:
            one = ()
        for i in range(len(cu_seqlens) - 1):
            if i in one:
                continue
            s, e = cu_seqlens[i], cu_seqlens[i + 1]
            row = int(rows[i])
            win = torch.cat([state[row], xf[s:e].T], -1)  # [C, K-1+T]
            out[s:e] = F.conv1d(win.unsqueeze(0), w.unsqueeze(1), groups=w.shape[0])[0].T
            state[row] = win[:, win.shape[1] - keep :]
        return F.silu(out)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        self.H, self.K = H, K
        self.q_proj, self.k_proj, self.v_proj = linear(D, H * K), linear(D, H * K), linear(D, H * K)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(H * K, cfg.kda_conv_size) for _ in range(3))
        self.f_a_proj = linear(D, cfg.kda_gate_low_rank)
        self.f_b_proj = linear(cfg.kda_gate_low_rank, H * K)
        self.A_log = nn.Parameter(torch.zeros(cfg.kda_a_log_len))  # only the first H entries are real
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.b_proj = linear(D, H)
        if cfg.kda_full_rank_gate:
            self.g_proj = linear(D, H * K)
        else:  # Kimi Linear: low-rank output gate
            self.g_a_proj = linear(D, cfg.kda_gate_low_rank)
            self.g_b_proj = linear(cfg.kda_gate_low_rank, H * K)
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = linear(H * K, D)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        N = x.shape[0]
        H, K = self.H, self.K
        C = H * K
        hist = batch.cache.conv_state[self.layer_idx]  # [S, 3C, K-1]: q | k | v conv histories
        rows, seqs = batch.rows, (None if batch.decode else batch.cu_seqlens)
        state = batch.cache.kda_state[self.layer_idx]
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if batch.verify:  # speculative verify spans: the state before the pass, kept for a rollback
            before = {i: (state[int(rows[i])].clone(), hist[int(rows[i])].clone()) for i in batch.verify}
        if batch.decode:  # the three short convs as one window over the q | k | v histories (ShortConv's math)
            w = torch.cat([m.weight[:, 0, :] for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], 0).float()
            win = torch.cat([hist[rows], torch.cat([xq, xk, xv], -1).float().unsqueeze(-1)], -1)  # [B, 3C, K]
            hist[rows] = win[..., 1:]
            q, k, v = F.silu((win * w).sum(-1)).to(x.dtype).view(N, 3, H, K).unbind(1)
        else:
            q = self.q_conv1d(xq, hist[:, :C], rows, seqs)
            k = self.k_conv1d(xk, hist[:, C : 2 * C], rows, seqs)
            v = self.v_conv1d(xv, hist[:, 2 * C :], rows, seqs)
            q, k, v = (t.to(x.dtype).reshape(N, H, K) for t in (q, k, v))
        a = self.f_b_proj(self.f_a_proj(x)).view(N, H, K)
        b = self.b_proj(x).float()
        if batch.verify:
            cu = batch.cu_seqlens
            for i, (s0, c0) in before.items():
                s, e = cu[i], cu[i + 1]
                batch.cache.sessions[batch.spans[i].session].ckpt.kda[self.layer_idx] = KdaCheckpoint(
                    s0, c0, torch.cat([xq[s:e], xk[s:e], xv[s:e]], -1), tuple(t[s:e].clone() for t in (q, k, v, a, b))
                )
        A_log = self.A_log[:H]
        args = (A_log, self.dt_bias, state)
        scale, lb = K**-0.5, self.cfg.kda_gate_lower_bound
        if batch.decode:
            o = ops.kda_decode(q, k, v, a, b, *args, batch.rows, scale, lb)
        elif batch.parts is not None:  # mixed: decode steps through the decode kernel, the rest varlen
            one, multi = batch.parts
            ti, tm = batch.token_index(one), batch.token_index(multi)
            o = torch.empty_like(q)
            o[ti] = ops.kda_decode(q[ti], k[ti], v[ti], a[ti], b[ti], *args, batch.rows[one], scale, lb)
            sub = batch.sub(multi)
            cu = torch.tensor(sub.cu_seqlens, dtype=torch.int32, device=batch.device)
            o[tm] = ops.kda_prefill(q[tm], k[tm], v[tm], a[tm], b[tm], *args, cu, batch.rows[multi], scale, lb)
        else:
            cu = batch.memo("cu", lambda: torch.tensor(batch.cu_seqlens, dtype=torch.int32, device=batch.device))
            o = ops.kda_prefill(q, k, v, a, b, *args, cu, batch.rows, scale, lb)
        g = self.g_proj(x) if self.cfg.kda_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        # per-head RMSNorm (fp32 weight) times sigmoid(output gate), fp32, then o_proj (spec 2.3)
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight.float()
        h = h.reshape(N, H * K) * torch.sigmoid(g.float())
        return self.o_proj(h.to(x.dtype))

    def restore(self, cache: StageCache, row: int, ck: KdaCheckpoint, n: int) -> None:
        """Put row `row` where it would be had the verify pass been only its first `n` tokens: the state
        before the pass, then the pass's own inputs of those tokens replayed (the same kernels as a
        forward of an n-token span: the short-conv window, the chunked KDA recurrence)."""
        C = self.H * self.K
        hist, state = cache.conv_state[self.layer_idx], cache.kda_state[self.layer_idx]
        keep = hist.shape[-1]
        state[row] = ck.state
        if n == 0:
            hist[row] = ck.conv
            return
        win = torch.cat([ck.conv, ck.pre_conv[:n].float().T], -1)  # [3C, keep + n], as ShortConv builds it
        for part in range(3):
            w = win[part * C : (part + 1) * C]
            hist[row, part * C : (part + 1) * C] = w[:, w.shape[1] - keep :]
        q, k, v, a, b = (t[:n] for t in ck.inputs)
        rows = torch.tensor([row], dtype=torch.long, device=state.device)
        cu = torch.tensor([0, n], dtype=torch.int32, device=state.device)
        ops.kda_prefill(
            q,
            k,
            v,
            a,
            b,
            self.A_log[: self.H],
            self.dt_bias,
            state,
            cu,
            rows,
            self.K**-0.5,
            self.cfg.kda_gate_lower_bound,
        )


# ----------------------------------------------------------------------------------- gated MLA (spec 3)
MLA_MODES = ("auto", "naive", "absorbed")


def check_mla_mode(mode: str) -> str:
    if mode not in MLA_MODES:
        raise ValueError(
            f"MLA mode {mode!r}: expected one of {MLA_MODES} ('auto': the absorbed form for "
            f"all-decode batches and the naive form otherwise; 'naive' / 'absorbed' force one)"
        )
    return mode


class GatedMLA(nn.Module):
    """Gated MLA with NoPE (spec 3). `mode` picks the attention form per instance: "auto" (absorbed for
    all-decode batches, naive otherwise), "naive" or "absorbed" (tests compare the two; see
    `p2pk3.model.stage.K3Stage.set_mla_mode` for a whole stage)."""

    def __init__(self, cfg: K3Config, layer_idx: int, mode: str = "auto"):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.mode = check_mla_mode(mode)
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H = H
        if cfg.q_lora_rank:
            self.q_a_proj = linear(D, cfg.q_lora_rank)
            # default eps 1e-6, not rms_norm_eps (spec 3.1, [V2] from three ports: uncertain)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = linear(cfg.q_lora_rank, H * cfg.q_head_dim)
        else:
            self.q_proj = linear(D, H * cfg.q_head_dim)
        self.kv_a_proj_with_mqa = linear(D, cfg.mla_cache_width)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        if cfg.mla_use_output_gate:
            self.g_proj = linear(D, H * cfg.v_head_dim)
        self.o_proj = linear(H * cfg.v_head_dim, D)

    def _wkv(self):
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.H, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]  # W_UK [H,dn,R], W_UV [H,dv,R]

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = self.cfg
        N, H, R, dn = x.shape[0], self.H, c.kv_lora_rank, c.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q = q.view(N, H, c.q_head_dim)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        kv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(kv[:, :R]), kv[:, R:]], -1)  # [N, 576]: normed c ; raw k_pe
        pool = batch.cache.mla_kv[self.layer_idx]
        flat = pool.view(-1, pool.shape[-1])
        rows = batch.memo("token_rows", lambda: batch.cache.token_rows(batch.spans, batch.device))
        flat[rows] = latent.to(pool.dtype)
        w_uk, w_uv = self._wkv()
        scale = c.q_head_dim**-0.5
        if self.mode == "absorbed" or (self.mode == "auto" and batch.decode):
            o = self._absorbed(q_nope, q_pe, w_uk, w_uv, pool, batch, scale)
        elif self.mode == "auto" and batch.parts is not None:  # mixed: each group on its own fast path
            one, multi = batch.parts
            ti, tm = batch.token_index(one), batch.token_index(multi)
            o = torch.empty(N, H, c.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
            o[ti] = self._absorbed(q_nope[ti], q_pe[ti], w_uk, w_uv, pool, batch.sub(one), scale)
            o[tm] = self._naive(q_nope[tm], q_pe[tm], w_uk, w_uv, flat, batch.sub(multi), scale)
        else:
            o = self._naive(q_nope, q_pe, w_uk, w_uv, flat, batch, scale)
        o = o.reshape(N, H * c.v_head_dim)
        if c.mla_use_output_gate:
            o = (o.float() * torch.sigmoid(self.g_proj(x).float())).to(x.dtype)
        return self.o_proj(o)

    def _naive(self, q_nope, q_pe, w_uk, w_uv, flat, batch: Batch, scale):
        """Expanded form (spec 3.1) per span against the whole cached sequence, causal."""
        R = self.cfg.kv_lora_rank
        out = torch.empty(q_nope.shape[0], self.H, self.cfg.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        cu = batch.cu_seqlens
        bs = batch.cache.block_size
        for i, sp in enumerate(batch.spans):
            s, e = cu[i], cu[i + 1]
            blocks = torch.tensor(batch.cache.sessions[sp.session].blocks, device=flat.device)
            L = sp.start + sp.length
            pos = torch.arange(L, device=flat.device)
            idx = blocks[pos // bs] * bs + pos % bs
            kv = flat[idx].to(q_nope.dtype)  # [L, 576]
            ckv, k_pe = kv[:, :R], kv[:, R:]
            k_nope = torch.einsum("lr,hdr->hld", ckv, w_uk)  # [H, L, dn]
            v = torch.einsum("lr,hdr->hld", ckv, w_uv)  # [H, L, dv]
            sc = (
                torch.einsum("thd,hld->htl", q_nope[s:e], k_nope).float()
                + torch.einsum("thd,ld->htl", q_pe[s:e], k_pe).float()
            ) * scale
            pos_q = torch.arange(sp.start, L, device=sc.device)
            mask = torch.arange(L, device=sc.device)[None, :] > pos_q[:, None]
            p = torch.softmax(sc.masked_fill(mask, -float("inf")), -1)
            out[s:e] = torch.einsum("htl,hld->thd", p, v.float()).to(out.dtype)
        return out

    def _absorbed(self, q_nope, q_pe, w_uk, w_uv, pool, batch: Batch, scale):
        """Weight-absorbed form over the 576-wide latent cache (spec 3.2)."""
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)  # [N, H, R]
        if batch.decode:
            bt = batch.memo("bt", lambda: batch.cache.block_table(batch.spans, batch.device))
            lens = batch.memo(
                "lens", lambda: torch.tensor([s.start + 1 for s in batch.spans], dtype=torch.int32, device=batch.device)
            )
            z = ops.mla_decode(q_lat, q_pe, pool, bt, lens, scale)
        else:  # absorbed prefill (tests): each token attends to its causal prefix
            z = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
            bt_all = batch.cache.block_table(batch.spans, batch.device)
            for i, sp in enumerate(batch.spans):
                for t in range(sp.length):
                    n = batch.cu_seqlens[i] + t
                    z[n] = ops.mla_decode(
                        q_lat[n : n + 1],
                        q_pe[n : n + 1],
                        pool,
                        bt_all[i : i + 1],
                        torch.tensor([sp.start + t + 1], dtype=torch.int32),
                        scale,
                    )[0]
        return torch.einsum("nhr,hdr->nhd", z.to(q_nope.dtype), w_uv)


# -------------------------------------------------------------------------- Stable LatentMoE (spec 5)
class Router(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.top_k, self.renorm, self.scaling = (
            cfg.num_experts_per_token,
            cfg.moe_renormalize,
            cfg.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 sigmoid scores; choose by score + bias (noaux_tc), weigh by the unbiased score (spec 5.1)."""
        s = torch.sigmoid(x.float() @ self.weight.float().T)
        ids = torch.topk(s + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=True).indices
        w = s.gather(-1, ids)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * self.scaling


class LatentMoE(nn.Module):
    """Router on the full hidden state, experts in the latent width, RMSNorm of the combined latent,
    up-projection, plus shared experts. Holds only the routed experts of this stage (`held`); `covered`
    are the experts held by all stages that share this layer (a split layer). `finish` False: a stage that
    only adds its experts' partial sum holds no shared experts and no up-projection (weights.mlp_tensors)."""

    # Optional MXFP8 (E4M3, 32-wide E8M0 blocks) fake quantization of the routed experts' input, off by
    # default: the checkpoint declares no activation quantization (spec 6.4); K3's QAT reportedly used
    # MXFP8 activations [S]. Only the expert input z is quantized here (the sm_120 W4A8 kernel variant also
    # quantizes the intermediate). Set per stage by the formats map (`expert_inputs = "mxfp8"`, applied by
    # p2pk3.quant.convert.apply_formats at load), or on the class.
    mxfp8_activations = False

    def __init__(
        self,
        cfg: K3Config,
        layer_idx: int,
        held: list[int] | None = None,
        covered: list[int] | None = None,
        finish: bool = True,
    ):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        E, W, I = cfg.num_experts, cfg.expert_width, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        if cfg.routed_expert_hidden_size:
            self.routed_expert_down_proj = linear(cfg.hidden_size, W)
            if finish:
                self.routed_expert_up_proj = linear(W, cfg.hidden_size)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(W, cfg.rms_norm_eps)
        if cfg.num_shared_experts and finish:
            self.shared_experts = MLP(cfg, cfg.num_shared_experts * I)
        held = list(range(E)) if held is None else sorted(set(held))
        self.held, self._covered_ids = held, sorted(set(held) | set(covered or []))
        self.register_buffer("g2l", torch.empty(E, dtype=torch.long), persistent=False)
        self.register_buffer("covered", torch.empty(E, dtype=torch.bool), persistent=False)
        self.init_maps()
        n = len(held)
        self.master = False  # training: float master experts + MXFP4 fake-quant (see enable_master_experts)
        self.last_ids: torch.Tensor | None = None
        if cfg.quant is not None:  # MXFP4, the checkpoint's own packed layout, stacked over held experts
            for w, (o, i) in (("w1", (I, W)), ("w3", (I, W)), ("w2", (W, I))):
                self.register_buffer(f"{w}_packed", torch.zeros(n, o, i // 2, dtype=torch.uint8))
                self.register_buffer(f"{w}_scale", torch.full((n, o, i // 32), 127, dtype=torch.uint8))
        else:
            for w, (o, i) in (("w1", (I, W)), ("w3", (I, W)), ("w2", (W, I))):
                self.register_buffer(f"{w}_weight", torch.zeros(n, o, i))

    def init_maps(self) -> None:
        """global expert id -> local index (-1: not held here); which experts the layer's stages cover."""
        E = self.cfg.num_experts
        g2l = torch.full((E,), -1, dtype=torch.long)
        g2l[torch.tensor(self.held, dtype=torch.long)] = torch.arange(len(self.held))
        cov = torch.zeros(E, dtype=torch.bool)
        cov[torch.tensor(self._covered_ids, dtype=torch.long)] = True
        self.g2l, self.covered = g2l.to(self.g2l.device), cov.to(self.covered.device)
        # Python facts for the hot path (no device round trip per step): every expert held here / covered
        self.holds_all, self.covers_all = len(self.held) == E, len(self._covered_ids) == E

    def expert_state_names(self) -> dict[str, tuple[str, int, str]]:
        """checkpoint name suffix (relative to this module) -> (buffer, local index, kind)."""
        out = {}
        kinds = ("weight_packed", "weight_scale") if self.cfg.quant is not None else ("weight",)
        for li, e in enumerate(self.held):
            for w in ("w1", "w2", "w3"):
                for k in kinds:
                    out[f"experts.{e}.{w}.{k}"] = (f"{w}_{k.split('_')[-1]}" if k != "weight" else f"{w}_weight", li, k)
        return out

    dequantized = False  # MXFP4 experts held dequantized (dequantize_experts)

    def dequantize_experts(self) -> None:
        """Hold the MXFP4 routed experts dequantized in fp32 (every MXFP4 value exactly; 8x the packed bytes),
        W1 over W3 as `w13_weight` [E, 2I, W] and `w2_weight` [E, W, I]: the torch path then skips the
        per-step dequantization and casts and runs the experts as two batched matmuls (same arithmetic,
        same values; kernels/mxfp4_moe_ref.py `dequantized_moe`). A CPU option (`load_stage(...,
        dequant_experts=True)`); the Triton kernels read the packed bytes themselves and need no such copy."""
        from p2pk3_kernels.mxfp4_moe_ref import dequant_mxfp4

        if self.cfg.quant is None or self.dequantized:
            return
        w = {
            n: dequant_mxfp4(self._buffers.pop(f"{n}_packed"), self._buffers.pop(f"{n}_scale"))
            for n in ("w1", "w2", "w3")
        }
        self.register_buffer("w13_weight", torch.cat([w["w1"], w["w3"]], 1).contiguous())
        self.register_buffer("w2_weight", w["w2"].contiguous())
        self.dequantized = True

    def enable_master_experts(self, init: dict[str, torch.Tensor] | None = None) -> None:
        """Training: hold float master weights `w{1,2,3}_master` [E, out, in] as parameters; the forward
        uses their MXFP4 fake-quantization with a straight-through gradient (quantization-aware training)."""
        c = self.cfg
        E, W, I = len(self.held), c.expert_width, c.moe_intermediate_size
        for w, shape in (("w1", (E, I, W)), ("w3", (E, I, W)), ("w2", (E, W, I))):
            t = init[w] if init else torch.randn(shape) / math.sqrt(shape[-1])
            self.register_parameter(f"{w}_master", nn.Parameter(t.float().clone()))
        self.master = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = self.gate(x)
        if self.training:
            self.last_ids = ids.detach()
        if self.covers_all:  # nothing to check, and no host sync on the decode path
            return ids, w
        bad = ~self.covered[ids]
        if bad.any():
            missing = sorted(set(ids[bad].tolist()))
            raise ExpertNotHeld(
                f"layer {self.layer_idx}: tokens routed to experts {missing} that this stage "
                f"does not hold (holds {len(self.held)} of {self.cfg.num_experts})"
            )
        return ids, w

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the held routed experts, in the expert width, fp32 [N, W]."""
        c = self.cfg
        ids, w = self.route(x)
        local = ids if self.holds_all else self.g2l[ids]
        z = self.routed_expert_down_proj(x) if c.routed_expert_hidden_size else x
        if self.mxfp8_activations:
            from p2pk3.quant.mxfp4 import mxfp8_e4m3_fake_quant

            z = mxfp8_e4m3_fake_quant(z)
        if self.master:
            from p2pk3.quant.qat import fake_quant_mxfp4_ste

            fq = fake_quant_mxfp4_ste if c.quant is not None else (lambda t: t)
            return ops.dense_moe(
                z,
                fq(self.w1_master),
                fq(self.w3_master),
                fq(self.w2_master),
                local,
                w,
                c.hidden_act,
                c.situ_beta,
                c.situ_linear_beta,
            )
        if self.dequantized:
            return ops.dequantized_moe(
                z,
                self.w13_weight,
                self.w2_weight,
                local,
                w,
                c.hidden_act,
                c.situ_beta,
                c.situ_linear_beta,
            )
        if c.quant is not None:
            return ops.mxfp4_moe(
                z,
                self.w1_packed,
                self.w1_scale,
                self.w3_packed,
                self.w3_scale,
                self.w2_packed,
                self.w2_scale,
                local,
                w,
                c.hidden_act,
                c.situ_beta,
                c.situ_linear_beta,
            )
        return ops.dense_moe(
            z, self.w1_weight, self.w3_weight, self.w2_weight, local, w, c.hidden_act, c.situ_beta, c.situ_linear_beta
        )

    def finish(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        u = u.to(x.dtype)
        if c.routed_expert_hidden_size:
            if c.latent_moe_use_norm:
                u = self.routed_expert_norm(u)  # "Stable": norm of the combined latent (spec 5.1 step 7)
            u = self.routed_expert_up_proj(u)
        if c.num_shared_experts:
            u = u + self.shared_experts(x)
        return u


# ------------------------------------------------------------------------------ decoder layer (1.4, 4)
class AttnResMix(nn.Module):
    """One Attention-Residual mix (spec 4.2): a softmax over the block snapshots and the running sum,
    scored by RMS-normalised candidates against the pseudo-query w = norm.weight * proj.weight.

    Module paths are `<name>.norm.weight` / `<name>.proj.weight`; the checkpoint stores them as
    `<name>_norm.weight` / `<name>_proj.weight` (`checkpoint_to_module` / `module_to_checkpoint` map the
    names; `p2pk3.model.stage.K3Stage.load_weights` takes checkpoint names)."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.proj = linear(cfg.hidden_size, 1)

    def forward(self, bank: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """bank [R, N, D] snapshots, prefix [N, D] running sum -> mixed input [N, D] (dtype of prefix)."""
        w = self.norm.weight.float() * self.proj.weight[0].float()
        return ops.attnres_mix(bank, prefix, w, self.norm.eps)


# Checkpoint names of the AttnRes pairs vs. module paths (the only names that differ, see AttnResMix).
_ATTN_RES = "self_attention_res|mlp_res|output_attn_res"
_CKPT_ATTN_RES = re.compile(rf"\.({_ATTN_RES})_(norm|proj)\.weight$")
_MODULE_ATTN_RES = re.compile(rf"\.({_ATTN_RES})\.(norm|proj)\.weight$")


def checkpoint_to_module(name: str) -> str:
    """Checkpoint tensor name (p2pk3.model.weights) -> parameter path in a `p2pk3.model.stage.K3Stage`; the
    identity except for AttnRes: `model.layers.3.mlp_res_norm.weight` -> `model.layers.3.mlp_res.norm.weight`."""
    return _CKPT_ATTN_RES.sub(r".\1.\2.weight", name)


def module_to_checkpoint(name: str) -> str:
    """Inverse of `checkpoint_to_module` (export a trained stage under the published names)."""
    return _MODULE_ATTN_RES.sub(r".\1_\2.weight", name)


@dataclass
class Hop:
    """What travels between stages (spec 4.3), for a packed batch of N tokens."""

    prefix: torch.Tensor  # [N, D] running sum of the current AttnRes block (plain residual without AttnRes)
    bank: torch.Tensor  # [R, N, D] block snapshots written so far (R = 0 without AttnRes)
    partial: torch.Tensor | None = None  # [N, W] fp32 latent-MoE sum of a layer split across stages


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: K3Config,
        i: int,
        parts: tuple[str, ...] = ("attn", "mlp"),
        experts: list[int] | None = None,
        covered: list[int] | None = None,
        mla_mode: str = "auto",
        finish: bool = True,
    ):
        super().__init__()
        self.cfg, self.layer_idx, self.parts = cfg, i, parts
        if "attn" in parts:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.self_attn = KimiDeltaAttention(cfg, i) if cfg.layer_types[i] == "kda" else GatedMLA(cfg, i, mla_mode)
            if cfg.uses_attn_res:
                self.self_attention_res = AttnResMix(cfg)
        if "mlp" in parts:
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.is_moe_layer(i):
                self.block_sparse_moe = LatentMoE(cfg, i, experts, covered, finish)
            else:
                self.mlp = MLP(cfg, cfg.intermediate_size)
            if cfg.uses_attn_res:
                self.mlp_res = AttnResMix(cfg)

    def attn_part(self, h: Hop, batch: Batch) -> None:
        c = self.cfg
        if not c.uses_attn_res:
            h.prefix = h.prefix + self.self_attn(self.input_layernorm(h.prefix), batch)
            return
        x = self.self_attention_res(h.bank, h.prefix) if h.bank.shape[0] else h.prefix
        fresh = self.layer_idx % c.attn_res_block_size == 0
        if fresh:  # snapshot the pre-mix running sum, start a new block
            h.bank = torch.cat([h.bank, h.prefix.unsqueeze(0)], 0)
        a = self.self_attn(self.input_layernorm(x), batch)
        h.prefix = a if fresh else h.prefix + a

    def mlp_part(self, h: Hop, batch: Batch, finish: bool) -> None:
        c = self.cfg
        x = self.mlp_res(h.bank, h.prefix) if c.uses_attn_res else h.prefix
        x = self.post_attention_layernorm(x)
        if not c.is_moe_layer(self.layer_idx):
            h.prefix = h.prefix + self.mlp(x)
            return
        moe = self.block_sparse_moe
        u = moe.partial(x)
        if h.partial is not None:
            u = h.partial + u
        if finish:
            h.prefix = h.prefix + moe.finish(x, u)
            h.partial = None
        else:
            h.partial = u
