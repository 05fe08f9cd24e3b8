"""Independent oracles: the model's modules against the math of the spec, written out plainly here.

Nothing in this file imports a formula from the code under test. Every oracle reads the module's own
weights from the *checkpoint state dict* (canonical tensor names, p2pk3/model/weights.py) and recomputes
the output by explicit matrix math in float64, so a wrong constant, a swapped tap or a dropped term in
p2pk3/model or kernels/*_ref.py shows up as a mismatch. Modules are driven only through the whole-stage
API (`build_stage` + `K3Stage.forward` on a one-layer `StagePlan`), never through private helpers.

  * gated MLA with NoPE (spec 3.1/3.2): causal softmax over 5+ tokens with scale (qk_nope + qk_rope)^-1/2,
    naive / absorbed / auto modes, across prefill/decode boundaries with two interleaved sessions, the
    MLA decode kernel reference (and the Triton kernel under TRITON_INTERPRET=1 when triton imports);
  * KDA short conv (spec 2.3): a hand example with asymmetric taps [1, 2, 3, 4] (tap 3 = current token),
    SiLU after the conv, the conv cache across prefill / decode / second prefill chunk;
  * a whole KDA layer by recurrence (K3 bounded gate + full-rank output gate; Kimi Linear softplus gate +
    low-rank output gate g_a_proj/g_b_proj);
  * the Kimi-Linear dense MoE (experts at the hidden width, SiLU-GLU, routed_scaling_factor 2.446);
  * top-k / top-p sampling: the set of tokens that can ever be drawn over a seed sweep equals the allowed
    set computed by sorting probabilities by hand, and the frequencies match the renormalised ones.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from p2pk3_kernels import mla_decode_ref, ops

import p2pk3.model.cache as cache_mod
from p2pk3.checkpoint.tiny import random_state_dict
from p2pk3.model.config import TINY_K3, TINY_KIMI_LINEAR
from p2pk3.model.kimi_k3 import GatedMLA, Hop
from p2pk3.model.stage import StagePlan, build_stage

# cache.Segment is being renamed to Span: accept either
Span = getattr(cache_mod, "Span", None) or cache_mod.Segment

D64 = torch.float64

# Plain residual stream (no AttnRes) so that a one-layer stage computes exactly prefix + f(norm(prefix)).
K3_PLAIN = TINY_K3.replace(attn_res_block_size=None)
KL_PLAIN = TINY_KIMI_LINEAR  # Kimi Linear has no AttnRes
MLA_LAYER = 3  # TINY_K3: layers 3 and 5 are MLA
KDA_LAYER = 0
MOE_LAYER = 1


# ------------------------------------------------------------------------------------------ helpers
def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def state_for(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors, with every 1-D norm weight randomised too (the writer sets them to 1,
    which would hide a missing or misplaced norm weight)."""
    sd = random_state_dict(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    for n, t in sd.items():
        if t.dim() == 1 and (n.endswith("norm.weight") or n.endswith("layernorm.weight")):
            sd[n] = (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)
    return sd


def one_layer_stage(cfg, layer: int, part: str, sd: dict[str, torch.Tensor]):
    plan = StagePlan(layers=[layer], parts={layer: (part,)})
    return build_stage(cfg, plan, sd)


def W(sd, name) -> torch.Tensor:
    return sd[name].to(D64)


class Runner:
    """Feeds hidden states through a one-layer stage span by span; returns the layer's outputs f(x)."""

    def __init__(self, stage, sessions=("a", "b"), block_size: int = 4):
        self.stage = stage
        self.cache = stage.new_cache(max_sessions=len(sessions), max_tokens=64, block_size=block_size)
        for s in sessions:
            self.cache.open(s)

    def __call__(self, spans: list[tuple[str, int, int]], x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        hop = Hop(prefix=x.clone(), bank=x.new_zeros(0, *x.shape))
        with torch.inference_mode():
            out = self.stage([Span(s, start, n) for s, start, n in spans], self.cache, hop=hop)
        return out.prefix.double() - x.double()


def set_mla_mode(stage, mode: str) -> None:
    # per instance: works whether `mode` is a class attribute (old) or an instance attribute (new)
    n = 0
    for m in stage.modules():
        if isinstance(m, GatedMLA):
            m.mode = mode
            n += 1
    assert n == 1


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-5) -> tuple[bool, float]:
    err = float((a.double() - b.double()).abs().max())
    scale = float(b.double().abs().max())
    return err <= tol * max(1.0, scale), err


# ------------------------------------------------------------------------------------- MLA oracle
def mla_oracle(sd, cfg, layer: int, x: torch.Tensor, return_parts: bool = False):
    """Gated MLA with NoPE for ONE sequence x [T, D] (spec 3.1), float64, from the checkpoint tensors."""
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    T = x.shape[0]
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    xn = rms(x.to(D64), cfg.rms_norm_eps) * W(sd, p + "input_layernorm.weight")
    # queries: q-LoRA with its own norm (eps 1e-6)
    cq = rms(xn @ W(sd, a + "q_a_proj.weight").T, 1e-6) * W(sd, a + "q_a_layernorm.weight")
    q = (cq @ W(sd, a + "q_b_proj.weight").T).view(T, H, dn + dr)
    # keys / values from the compressed latent; the 64-d "rope" key is shared by all heads and unrotated
    kv = xn @ W(sd, a + "kv_a_proj_with_mqa.weight").T  # [T, R + dr]
    c = rms(kv[:, :R], 1e-6) * W(sd, a + "kv_a_layernorm.weight")
    k_pe = kv[:, R:]
    kvb = (c @ W(sd, a + "kv_b_proj.weight").T).view(T, H, dn + dv)
    k = torch.cat([kvb[..., :dn], k_pe[:, None, :].expand(T, H, dr)], -1)  # [T, H, dn + dr]
    v = kvb[..., dn:]
    scale = 1.0 / math.sqrt(dn + dr)  # q head dim = 128 + 64 = 192 for K3
    o = torch.zeros(T, H, dv, dtype=D64)
    for t in range(T):  # causal: token t sees tokens 0..t; no positional encoding anywhere
        s = torch.einsum("hd,jhd->hj", q[t], k[: t + 1]) * scale
        pr = torch.softmax(s, -1)
        o[t] = torch.einsum("hj,jhd->hd", pr, v[: t + 1])
    gate = torch.sigmoid(xn @ W(sd, a + "g_proj.weight").T)
    y = (o.reshape(T, H * dv) * gate) @ W(sd, a + "o_proj.weight").T
    if return_parts:
        return y, dict(q=q, c=c, k_pe=k_pe, o=o, scale=scale)
    return y


@pytest.fixture(scope="module")
def mla_setup():
    sd = state_for(K3_PLAIN, seed=11)
    return sd


def _x(T: int, D: int, seed: int) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["naive", "absorbed", "auto"])
def test_mla_prefill_matches_causal_softmax_oracle(mla_setup, mode):
    sd = mla_setup
    stage = one_layer_stage(K3_PLAIN, MLA_LAYER, "attn", sd)
    set_mla_mode(stage, mode)
    x = _x(6, K3_PLAIN.hidden_size, 1)
    want = mla_oracle(sd, K3_PLAIN, MLA_LAYER, x)
    got = Runner(stage)([("a", 0, 6)], x)
    ok, err = close(got, want)
    assert ok, f"MLA prefill ({mode}) differs from the causal softmax oracle by {err:.3g}"
    # the oracle is sensitive to what matters: a plain (unscaled) softmax would be far off
    assert (want[0] - want[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["naive", "absorbed", "auto"])
def test_mla_across_prefill_decode_boundaries(mla_setup, mode):
    """Two sessions interleaved: prefill chunks, decode steps and a mixed batch, each row against the
    oracle over that session's whole sequence (paged cache with block size 4: blocks are crossed)."""
    sd = mla_setup
    stage = one_layer_stage(K3_PLAIN, MLA_LAYER, "attn", sd)
    set_mla_mode(stage, mode)
    D = K3_PLAIN.hidden_size
    xa, xb = _x(9, D, 2), _x(7, D, 3)
    wa, wb = mla_oracle(sd, K3_PLAIN, MLA_LAYER, xa), mla_oracle(sd, K3_PLAIN, MLA_LAYER, xb)
    run = Runner(stage)
    steps = [  # (spans, rows of a, rows of b)
        [("a", 0, 3)],
        [("a", 3, 1)],  # decode
        [("b", 0, 5), ("a", 4, 1)],  # mixed: prefill of b + decode of a
        [("a", 5, 1), ("b", 5, 1)],  # batched decode of two lengths
        [("a", 6, 3), ("b", 6, 1)],  # second prefill chunk of a
    ]
    pos = {"a": 0, "b": 0}
    for spans in steps:
        xs = torch.cat([(xa if s == "a" else xb)[st : st + n] for s, st, n in spans])
        got = run(spans, xs)
        r = 0
        for s, st, n in spans:
            assert pos[s] == st
            want = (wa if s == "a" else wb)[st : st + n]
            ok, err = close(got[r : r + n], want)
            assert ok, f"mode {mode}: session {s} tokens {st}..{st + n - 1} after spans {spans}: err {err:.3g}"
            r += n
            pos[s] += n


def _paged(latent: torch.Tensor, bs: int, order: list[int]):
    """A paged cache [NB, bs, W] holding `latent` [L, W] in the blocks `order` (shuffled on purpose)."""
    L, Wd = latent.shape
    nb = -(-L // bs)
    NB = max(order) + 1
    cache = torch.full((NB, bs, Wd), 1e4)  # junk outside the sequence: must never be read
    for i in range(nb):
        rows = latent[i * bs : (i + 1) * bs]
        cache[order[i], : rows.shape[0]] = rows
    return cache, torch.tensor([order[:nb]], dtype=torch.int32)


def _mla_kernel_case(sd):
    cfg = K3_PLAIN
    a = f"model.layers.{MLA_LAYER}.self_attn."
    x = _x(7, cfg.hidden_size, 4)
    _, parts = mla_oracle(sd, cfg, MLA_LAYER, x, return_parts=True)
    dn, H = cfg.qk_nope_head_dim, cfg.num_attention_heads
    wkvb = W(sd, a + "kv_b_proj.weight").view(H, dn + cfg.v_head_dim, cfg.kv_lora_rank)
    w_uk, w_uv = wkvb[:, :dn], wkvb[:, dn:]
    t = x.shape[0] - 1  # decode the last token against the whole prefix
    q_lat = torch.einsum("hd,hdr->hr", parts["q"][t, :, :dn], w_uk)[None]  # absorbed query [1, H, R]
    q_pe = parts["q"][t, :, dn:][None]
    latent = torch.cat([parts["c"], parts["k_pe"]], -1)  # [L, 576-like]
    kv, bt = _paged(latent.float(), 2, [5, 1, 3, 0, 2])
    lens = torch.tensor([t + 1], dtype=torch.int32)
    return q_lat.float(), q_pe.float(), kv, bt, lens, parts, w_uv, t


def test_mla_decode_kernel_reference_matches_oracle(mla_setup):
    q_lat, q_pe, kv, bt, lens, parts, w_uv, t = _mla_kernel_case(mla_setup)
    z = mla_decode_ref.mla_decode(q_lat, q_pe, kv, bt, lens, parts["scale"])
    o = torch.einsum("hr,hdr->hd", z[0].double(), w_uv)
    ok, err = close(o, parts["o"][t])
    assert ok, f"kernels/mla_decode_ref.py differs from the oracle's attention output by {err:.3g}"


def _triton_usable() -> bool:
    if not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()):
        return False
    try:
        import triton  # noqa: F401
        from p2pk3_kernels import mla_decode  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _triton_usable(), reason="triton not importable (or no interpreter / GPU)")
def test_mla_decode_triton_kernel_matches_oracle(mla_setup):
    from p2pk3_kernels import mla_decode

    q_lat, q_pe, kv, bt, lens, parts, w_uv, t = _mla_kernel_case(mla_setup)
    dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    z = mla_decode.mla_decode(q_lat.to(dev), q_pe.to(dev), kv.to(dev), bt.to(dev), lens.to(dev), parts["scale"])
    o = torch.einsum("hr,hdr->hd", z[0].double().cpu(), w_uv)
    ok, err = close(o, parts["o"][t], 5e-3 if dev == "cuda" else 2e-5)  # GPU: tf32 dots
    assert ok, f"the Triton MLA decode kernel differs from the oracle by {err:.3g}"


# ------------------------------------------------------------------------------------ KDA short conv
def _capture_kda_inputs(monkeypatch):
    """Record the q, k, v the KDA kernels receive (= SiLU(short conv(projections)), reshaped [N, H, K])."""
    seen: list[tuple[torch.Tensor, ...]] = []
    for name in ("kda_prefill", "kda_decode"):
        orig = getattr(ops, name)

        def wrap(*args, _orig=orig, **kw):
            seen.append(tuple(t.detach().clone().float() for t in args[:3]))
            return _orig(*args, **kw)

        monkeypatch.setattr(ops, name, wrap)
    return seen


def _conv_oracle(pre: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv, pre [T, C], taps [C, K] with tap K-1 on the current token, then SiLU."""
    T, C = pre.shape
    K = taps.shape[1]
    out = torch.zeros(T, C, dtype=D64)
    for t in range(T):
        for j in range(K):
            s = t - (K - 1) + j
            if s >= 0:
                out[t] += taps[:, j] * pre[s]
    return torch.nn.functional.silu(out)


# spans of one session crossing prefill -> decode -> prefill chunk -> decode; the second session (b) keeps
# its own history in between
CONV_STEPS = [[("a", 0, 2)], [("a", 2, 1), ("b", 0, 1)], [("a", 3, 2)], [("a", 5, 1), ("b", 1, 1)]]


def test_kda_short_conv_hand_example_asymmetric_taps(monkeypatch):
    """Channel 0 of q sees exactly x[:, 0] = 0.1, -0.2, 0.3, -0.1, 0.2, -0.3 (q_proj row 0 = e_0, unit-RMS
    inputs) and has taps [1, 2, 3, 4] (tap 3 on the current token): the conv gives 0.4, -0.5, 0.8, 0.2, 0.9,
    -0.5, then SiLU (reversed taps would give 0.1, 0, 0.2, 0.3, 0.1, 1.0; small values so SiLU is visible)."""
    cfg = K3_PLAIN
    D = cfg.hidden_size
    sd = state_for(cfg, seed=21)
    a = f"model.layers.{KDA_LAYER}.self_attn."
    sd[f"model.layers.{KDA_LAYER}.input_layernorm.weight"] = torch.ones(D, dtype=torch.bfloat16)
    qp = sd[a + "q_proj.weight"].clone()
    qp[0] = 0
    qp[0, 0] = 1
    sd[a + "q_proj.weight"] = qp
    cw = sd[a + "q_conv1d.weight"].clone()
    cw[0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sd[a + "q_conv1d.weight"] = cw
    stage = one_layer_stage(cfg, KDA_LAYER, "attn", sd)
    seen = _capture_kda_inputs(monkeypatch)
    vals = torch.tensor([0.1, -0.2, 0.3, -0.1, 0.2, -0.3])
    xa = torch.zeros(6, D)
    xa[:, 0] = vals
    xa[:, 1] = torch.sqrt(D - vals**2)  # mean square exactly 1: the RMSNorm leaves x[:, 0] as it is
    xb = _x(2, D, 5)
    run = Runner(stage)
    got = []
    for spans in CONV_STEPS:
        xs = torch.cat([(xa if s == "a" else xb)[st : st + n] for s, st, n in spans])
        run(spans, xs)
        q = seen[-1][0]
        r = 0
        for s, _st, n in spans:
            if s == "a":
                got.append(q[r : r + n, 0, 0])
            r += n
    got = torch.cat(got).double()
    want = torch.nn.functional.silu(torch.tensor([0.4, -0.5, 0.8, 0.2, 0.9, -0.5], dtype=D64))
    # (the norm's eps 1e-5 on a unit mean square changes x[:, 0] by < 1e-5 relative)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (got.tolist(), want.tolist())


def test_kda_short_conv_all_channels_with_cache(monkeypatch):
    """Every channel of q, k and v (random asymmetric taps from the checkpoint) against the causal conv +
    SiLU oracle, across prefill / decode / second prefill chunk, two sessions."""
    cfg = K3_PLAIN
    D = cfg.hidden_size
    sd = state_for(cfg, seed=22)
    p = f"model.layers.{KDA_LAYER}."
    stage = one_layer_stage(cfg, KDA_LAYER, "attn", sd)
    seen = _capture_kda_inputs(monkeypatch)
    xa, xb = _x(6, D, 6), _x(2, D, 7)
    run = Runner(stage)
    got = {"a": [], "b": []}
    for spans in CONV_STEPS:
        xs = torch.cat([(xa if s == "a" else xb)[st : st + n] for s, st, n in spans])
        run(spans, xs)
        q, k, v = seen[-1]
        r = 0
        for s, _st, n in spans:
            got[s].append(torch.stack([t[r : r + n].reshape(n, -1) for t in (q, k, v)]))
            r += n
    for s, x in (("a", xa), ("b", xb)):
        xn = rms(x.to(D64), cfg.rms_norm_eps) * W(sd, p + "input_layernorm.weight")
        for i, n in enumerate("qkv"):
            pre = xn @ W(sd, p + f"self_attn.{n}_proj.weight").T
            want = _conv_oracle(pre, W(sd, p + f"self_attn.{n}_conv1d.weight")[:, 0, :])
            g = torch.cat([blk[i] for blk in got[s]])
            ok, err = close(g, want)
            assert ok, f"session {s}: {n} after the short conv differs from the oracle by {err:.3g}"


# ---------------------------------------------------------------------------------- whole KDA layer
def kda_oracle(sd, cfg, layer: int, x: torch.Tensor) -> torch.Tensor:
    """One KDA layer for one sequence (spec 2.1, 2.3) by plain recurrence, float64."""
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    T = x.shape[0]
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    xn = rms(x.to(D64), cfg.rms_norm_eps) * W(sd, p + "input_layernorm.weight")
    qkv = [
        _conv_oracle(xn @ W(sd, a + f"{n}_proj.weight").T, W(sd, a + f"{n}_conv1d.weight")[:, 0, :]).view(T, H, K)
        for n in "qkv"
    ]
    q, k, v = qkv
    gl = ((xn @ W(sd, a + "f_a_proj.weight").T) @ W(sd, a + "f_b_proj.weight").T).view(T, H, K)
    gl = gl + W(sd, a + "dt_bias").view(H, K)
    A = W(sd, a + "A_log")[:H].exp().view(H, 1)
    if cfg.kda_gate_lower_bound is None:  # Kimi Linear: g = -exp(A_log) * softplus(a + dt_bias)
        g = -A * torch.nn.functional.softplus(gl)
    else:  # K3: g = lb * sigmoid(exp(A_log) * (a + dt_bias))
        g = cfg.kda_gate_lower_bound * torch.sigmoid(A * gl)
    beta = torch.sigmoid(xn @ W(sd, a + "b_proj.weight").T)  # [T, H]
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(H, K, K, dtype=D64)  # [H, key, value]
    o = torch.zeros(T, H, K, dtype=D64)
    for t in range(T):
        S = S * g[t].exp().unsqueeze(-1)  # decay the key rows
        err = v[t] - torch.einsum("hk,hkv->hv", k[t], S)  # read with the decayed state
        S = S + beta[t][:, None, None] * torch.einsum("hk,hv->hkv", k[t], err)
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)  # read after the write
    o = rms(o, cfg.rms_norm_eps) * W(sd, a + "o_norm.weight")
    if cfg.kda_full_rank_gate:
        gate = torch.sigmoid(xn @ W(sd, a + "g_proj.weight").T)
    else:  # Kimi Linear low-rank output gate
        gate = torch.sigmoid((xn @ W(sd, a + "g_a_proj.weight").T) @ W(sd, a + "g_b_proj.weight").T)
    return (o.reshape(T, H * K) * gate) @ W(sd, a + "o_proj.weight").T


@pytest.mark.parametrize("cfg", [K3_PLAIN, KL_PLAIN], ids=["k3-bounded-gate", "kimi-linear-low-rank-gate"])
def test_kda_layer_matches_recurrence_oracle(cfg):
    if cfg is KL_PLAIN:
        assert not cfg.kda_full_rank_gate and cfg.kda_gate_lower_bound is None
    sd = state_for(cfg, seed=31)
    stage = one_layer_stage(cfg, KDA_LAYER, "attn", sd)
    D = cfg.hidden_size
    xa, xb = _x(6, D, 8), _x(2, D, 9)
    wa, wb = kda_oracle(sd, cfg, KDA_LAYER, xa), kda_oracle(sd, cfg, KDA_LAYER, xb)
    run = Runner(stage)
    for spans in CONV_STEPS:
        xs = torch.cat([(xa if s == "a" else xb)[st : st + n] for s, st, n in spans])
        got = run(spans, xs)
        r = 0
        for s, st, n in spans:
            ok, err = close(got[r : r + n], (wa if s == "a" else wb)[st : st + n], 5e-5)
            assert ok, f"{cfg.model_type}: KDA session {s} tokens {st}..{st + n - 1}: err {err:.3g}"
            r += n


# ------------------------------------------------------------------------------ Kimi-Linear dense MoE
def kimi_linear_moe_oracle(sd, cfg, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear MoE (spec 8): sigmoid router, top-k by score + bias, weights = renormalised unbiased
    scores x routed_scaling_factor, experts SiLU-GLU at the hidden width, plus the shared expert."""
    p = f"model.layers.{layer}."
    m = p + "block_sparse_moe."
    xn = rms(x.to(D64), cfg.rms_norm_eps) * W(sd, p + "post_attention_layernorm.weight")
    s = torch.sigmoid(xn @ W(sd, m + "gate.weight").T)
    bias = W(sd, m + "gate.e_score_correction_bias")
    out = torch.zeros_like(xn)
    for n in range(xn.shape[0]):
        chosen = sorted(range(cfg.num_experts), key=lambda e: -float(s[n, e] + bias[e]))[: cfg.num_experts_per_token]
        tot = sum(float(s[n, e]) for e in chosen)
        for e in chosen:
            w1, w3, w2 = (W(sd, m + f"experts.{e}.{w}.weight") for w in ("w1", "w3", "w2"))
            h = torch.nn.functional.silu(w1 @ xn[n]) * (w3 @ xn[n])
            out[n] += float(s[n, e]) / tot * cfg.routed_scaling_factor * (w2 @ h)
    sh = m + "shared_experts."
    hs = torch.nn.functional.silu(xn @ W(sd, sh + "gate_proj.weight").T) * (xn @ W(sd, sh + "up_proj.weight").T)
    return out + hs @ W(sd, sh + "down_proj.weight").T


def test_kimi_linear_dense_moe_by_hand():
    cfg = KL_PLAIN
    assert cfg.routed_expert_hidden_size is None and cfg.quant is None and cfg.hidden_act == "silu"
    assert cfg.routed_scaling_factor != 1.0
    sd = state_for(cfg, seed=41)
    m = f"model.layers.{MOE_LAYER}.block_sparse_moe."
    # a correction bias large enough to change some choices (selection by s + b, weights by s)
    sd[m + "gate.e_score_correction_bias"] = (
        torch.randn(cfg.num_experts, generator=torch.Generator().manual_seed(3)) * 0.3
    )
    stage = one_layer_stage(cfg, MOE_LAYER, "mlp", sd)
    x = _x(8, cfg.hidden_size, 10)
    want = kimi_linear_moe_oracle(sd, cfg, MOE_LAYER, x)
    got = Runner(stage)([("a", 0, 8)], x)
    ok, err = close(got, want)
    assert ok, f"Kimi-Linear MoE differs from the hand computation by {err:.3g}"
    # the bias really changes the routing for some token (else this test would not check it)
    xn = rms(x.to(D64), cfg.rms_norm_eps) * W(sd, f"model.layers.{MOE_LAYER}.post_attention_layernorm.weight")
    s = torch.sigmoid(xn @ W(sd, m + "gate.weight").T)
    k = cfg.num_experts_per_token
    b = W(sd, m + "gate.e_score_correction_bias")
    assert any(set(s[n].topk(k).indices.tolist()) != set((s[n] + b).topk(k).indices.tolist()) for n in range(8))


# ------------------------------------------------------------------------------------------ sampling
def _sampling():
    try:
        from p2pk3.engine.sampling import SamplingParams, sample_at
    except ImportError:  # pragma: no cover - moved
        from p2pk3.engine.sampling import sample_at
        from p2pk3.params import SamplingParams
    return SamplingParams, sample_at


LOGITS = [2.0, -1.0, 0.5, 1.7, 0.0, -0.3, 1.1, -2.0, 0.9, 0.2]


def allowed_by_hand(logits, temperature, top_k, top_p):
    """{token: probability} of the distribution top-k then top-p sampling draws from, by sorting."""
    z = [l / temperature for l in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k:
        order = order[:top_k]
    mx = max(z[i] for i in order)
    e = {i: math.exp(z[i] - mx) for i in order}
    tot = sum(e.values())
    probs = {i: e[i] / tot for i in order}
    keep, mass = [], 0.0
    for i in order:  # smallest prefix (by decreasing probability) whose mass reaches top_p
        keep.append(i)
        mass += probs[i]
        if mass >= top_p:
            break
    tot = sum(probs[i] for i in keep)
    return {i: probs[i] / tot for i in keep}


SAMPLING_CASES = [
    dict(temperature=1.0, top_k=0, top_p=0.7),
    dict(temperature=1.0, top_k=3, top_p=1.0),
    dict(temperature=0.7, top_k=5, top_p=0.8),
    dict(temperature=1.6, top_k=0, top_p=0.85),
    dict(temperature=1.0, top_k=0, top_p=1.0),
]


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=lambda c: f"T{c['temperature']}-k{c['top_k']}-p{c['top_p']}")
def test_top_k_top_p_allowed_set_and_frequencies(case):
    SamplingParams, sample_at = _sampling()
    want = allowed_by_hand(LOGITS, **case)
    # every allowed token is drawn often enough to be seen, and no top-p boundary is within rounding
    assert min(want.values()) > 0.004
    if case["top_p"] < 1:
        kept = allowed_by_hand(LOGITS, case["temperature"], case["top_k"], 1.0)
        cum = 0.0
        for i in sorted(kept, key=lambda i: -kept[i]):
            cum += kept[i]
            assert abs(cum - case["top_p"]) > 0.01
    logits = torch.tensor(LOGITS)
    n = 3000
    counts: dict[int, int] = {}
    for seed in range(3):
        params = SamplingParams(seed=seed, max_tokens=1, **case)
        for pos in range(n // 3):
            t = sample_at(logits, params, pos)
            counts[t] = counts.get(t, 0) + 1
    assert set(counts) == set(want), f"drawn {sorted(counts)} but the allowed set is {sorted(want)}"
    for t, p in want.items():
        f = counts[t] / n
        assert abs(f - p) < 0.035, f"token {t}: frequency {f:.3f}, probability {p:.3f} ({case})"


def test_sampling_is_a_function_of_seed_and_position():
    SamplingParams, sample_at = _sampling()
    logits = torch.tensor(LOGITS)
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=1)
    a = [sample_at(logits, p, i) for i in range(50)]
    assert a == [sample_at(logits, p, i) for i in range(50)]
    assert a != [sample_at(logits, SamplingParams(temperature=1.0, seed=6, max_tokens=1), i) for i in range(50)]
    assert len(set(a)) > 3
    assert sample_at(logits, SamplingParams(temperature=0.0), 0) == 0  # greedy = argmax
