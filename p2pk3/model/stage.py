"""A stage: a contiguous piece of the K3 model (`p2pk3.model.kimi_k3`), possibly the whole model, possibly
half a layer at each end, run over a packed batch of token spans. `StagePlan` says which piece;
`K3Stage` holds its layers (plus the embedding on the first stage, the final norm and head on the last),
wires its caches, runs a batch from tokens or an incoming `Hop` to the next `Hop` or the logits, rolls a
speculative verify pass back, and loads checkpoint-named weights; `build_stage` builds one on a device
without materialising random weights first. The parallel split is applied from here; the model file
knows only layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .batch import Batch
from .cache import Span, StageCache
from .config import K3Config
from .kimi_k3 import (
    AttnResMix,
    DecoderLayer,
    GatedMLA,
    Hop,
    LatentMoE,
    RMSNorm,
    check_mla_mode,
    checkpoint_to_module,
    linear,
)
from .split import even_layer_ranges


@dataclass
class StagePlan:
    """Which part of the model one stage runs.

    layers: contiguous layer indices. parts[i]: ("attn",), ("mlp",) or both (default both).
    experts[i]: routed experts held for MoE layer i (default all); covered[i]: experts held by all the
    stages that share layer i (default = experts[i]); finish[i]: whether this stage completes layer i's
    MoE (False when the next stage adds more experts). embed/head: first/last stage duties.
    """

    layers: list[int]
    embed: bool = False
    head: bool = False
    parts: dict[int, tuple[str, ...]] = field(default_factory=dict)
    experts: dict[int, list[int]] = field(default_factory=dict)
    covered: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def whole(cls, cfg: K3Config) -> "StagePlan":
        return cls(layers=list(range(cfg.num_hidden_layers)), embed=True, head=True)

    @classmethod
    def split_even(cls, cfg: K3Config, n: int) -> list["StagePlan"]:
        """`n` stages of whole layers, cut by `p2pk3.model.split.even_layer_ranges` (the larger ones first)."""
        ranges = even_layer_ranges(cfg.num_hidden_layers, n)
        return [cls(layers=list(r), embed=k == 0, head=k == n - 1) for k, r in enumerate(ranges)]

    def parts_of(self, i: int) -> tuple[str, ...]:
        return self.parts.get(i, ("attn", "mlp"))


def cache_layers(cfg: K3Config, plan: StagePlan) -> tuple[list[int], list[int]]:
    """(KDA layers, MLA layers) whose attention a stage of `plan` runs: the ones with a cache there."""
    kda = [i for i in plan.layers if "attn" in plan.parts_of(i) and cfg.layer_types[i] == "kda"]
    mla = [i for i in plan.layers if "attn" in plan.parts_of(i) and cfg.layer_types[i] == "mla"]
    return kda, mla


class K3Stage(nn.Module):
    """A contiguous piece of the model. `forward` runs one packed batch through it.

    mla_mode: the attention form of every MLA layer of the stage ("auto", "naive" or "absorbed", see
    GatedMLA); `set_mla_mode` changes it later."""

    def __init__(self, cfg: K3Config, plan: StagePlan, mla_mode: str = "auto"):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        check_mla_mode(mla_mode)
        self.model = nn.Module()
        if plan.embed:
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(
                    cfg,
                    i,
                    plan.parts_of(i),
                    plan.experts.get(i),
                    plan.covered.get(i),
                    mla_mode,
                    plan.finish.get(i, True),
                )
                for i in plan.layers
            }
        )
        if plan.head:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            if cfg.uses_attn_res:
                self.model.output_attn_res = AttnResMix(cfg)
            if not cfg.tie_word_embeddings:
                self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)

    # ---------------------------------------------------------------- caches
    def new_cache(
        self, max_sessions: int, max_tokens: int, block_size: int = 64, device=None, prefix_blocks: int = 0
    ) -> StageCache:
        c = self.cfg
        kda, mla = cache_layers(c, self.plan)
        return StageCache(
            kda_layers=kda,
            mla_layers=mla,
            kda_heads=c.kda_num_heads,
            kda_head_dim=c.kda_head_dim,
            conv_channels=3 * c.kda_num_heads * c.kda_head_dim,
            conv_size=c.kda_conv_size,
            mla_width=c.mla_cache_width,
            max_sessions=max_sessions,
            max_tokens=max_tokens,
            block_size=block_size,
            dtype=self.act_dtype,
            device=device or self.device,
            prefix_blocks=prefix_blocks,
        )

    def cache_layers(self) -> tuple[list[int], list[int]]:
        return cache_layers(self.cfg, self.plan)

    act_dtype: torch.dtype = torch.float32  # set by load_weights

    def set_mla_mode(self, mode: str) -> None:
        """Attention form of every MLA layer of this stage: "auto", "naive" or "absorbed"."""
        check_mla_mode(mode)
        for m in self.modules():
            if isinstance(m, GatedMLA):
                m.mode = mode

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ---------------------------------------------------------------- run
    def forward(
        self,
        spans: list[Span],
        cache: StageCache,
        *,
        tokens: torch.Tensor | None = None,
        hop: Hop | None = None,
        logits: str = "last",
    ) -> Hop | torch.Tensor:
        """Run a packed batch. First stage: `tokens` [N]; others: `hop`. Last stage returns logits
        (fp32; "last": one row per span, "all": one per token, "none": the final hidden state),
        others the Hop for the next stage. The cache is updated only if the whole batch succeeds
        its admission check (`reserve`). Call under torch.inference_mode() when serving; without it the
        forward is differentiable (training uses the same path with a throw-away cache)."""
        cache.reserve(spans)
        batch = Batch(spans, cache, self.device)
        if self.plan.embed:
            tokens = tokens.to(self.device)
        else:
            assert hop is not None, "a stage without the embedding needs the incoming hop"
        args = (tokens, *((hop.prefix, hop.bank, hop.partial) if hop is not None else (None, None, None)), logits)
        out = None
        if self.decode_graph is not None and batch.decode and not batch.verify and not torch.is_grad_enabled():
            out = self.decode_graph.run(batch, *args)
        if out is None:
            out = self._step(batch, *args)
        cache.commit(spans)
        return out[0] if self.plan.head else Hop(*out)

    decode_graph = None  # a CompiledDecode (p2pk3.model.compiled) once `compile_decode` is called

    def compile_decode(self, enabled: bool | None = None, cuda_graphs: bool | None = None) -> bool:
        """Run decode batches through the compiled step (`p2pk3.model.compiled`); None: the device's default
        (`default_compile`). Returns whether it is on."""
        from .compiled import CompiledDecode, default_compile

        on = default_compile(self.device) if enabled is None else enabled
        self.decode_graph = CompiledDecode(self, self._step, cuda_graphs) if on else None
        return on

    def _step(self, batch: Batch, tokens, prefix, bank, partial, logits: str) -> tuple:
        """The layers over one batch: (logits,) on the last stage, else (prefix, bank, partial) of the hop. The
        same code eager and compiled (tensors in, tensors out)."""
        if self.plan.embed:
            x = self.model.embed_tokens(tokens)
            hop = Hop(prefix=x, bank=x.new_zeros(0, *x.shape))
        else:
            hop = Hop(prefix, bank, partial)
        for i in self.plan.layers:
            layer = self.model.layers[str(i)]
            parts = self.plan.parts_of(i)
            if "attn" in parts:
                layer.attn_part(hop, batch)
            if "mlp" in parts:
                layer.mlp_part(hop, batch, self.plan.finish.get(i, True))
        if not self.plan.head:
            return hop.prefix, hop.bank, hop.partial
        return (self.head(hop, batch.cu_seqlens, logits),)

    @torch.inference_mode()
    def rollback(self, cache: StageCache, session: str, length: int) -> None:
        """Speculative decoding: take `session` back to `length` tokens, inside its last verify pass (the
        rejected drafts leave no trace: KDA and short-conv state as if the pass had ended there, MLA rows
        beyond `length` forgotten). SessionError (nothing changed) when the checkpoint does not cover it."""
        ck = cache.check_rollback(session, length)
        row = cache.sessions[session].row
        for i, kck in ck.kda.items():
            self.model.layers[str(i)].self_attn.restore(cache, row, kck, length - ck.start)
        cache.truncate(session, length)

    def head(self, hop: Hop, cu_seqlens: list[int], which: str = "last") -> torch.Tensor:
        m = self.model
        h = m.output_attn_res(hop.bank, hop.prefix) if self.cfg.uses_attn_res else hop.prefix
        if which == "last" and len(cu_seqlens) - 1 != h.shape[0]:  # (one token per span: already one row each)
            h = h[torch.tensor([e - 1 for e in cu_seqlens[1:]], device=h.device)]
        h = m.norm(h)
        if which == "none":
            return h
        if not self.cfg.tie_word_embeddings and not isinstance(self.lm_head, nn.Linear):
            return self.lm_head(h).float()  # re-quantized at load (p2pk3.quant.convert.MXLinear)
        w = m.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return (h @ w.T).float()

    # ---------------------------------------------------------------- weights
    def expected_tensors(self) -> dict:
        from .weights import embed_tensors, head_tensors, layer_tensors, mlp_tensors

        t = embed_tensors(self.cfg) if self.plan.embed else {}
        for i in self.plan.layers:
            if "attn" in self.plan.parts_of(i):
                t.update(layer_tensors(self.cfg, i, (), ("attn",)))
            if "mlp" in self.plan.parts_of(i):
                t.update(mlp_tensors(self.cfg, i, self.plan.experts.get(i), finish=self.plan.finish.get(i, True)))
        if self.plan.head:
            t.update(head_tensors(self.cfg))
        return t

    def load_weights(self, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
        """Load canonical checkpoint names (see weights.py; mapped to module paths here, the one place that
        does it: `checkpoint_to_module`). Float weights are cast to `dtype`, except the ones K3 keeps in
        fp32 (conv, A_log, dt_bias, o_norm, correction bias); experts stay packed."""
        expected = self.expected_tensors()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise KeyError(f"missing tensors for this stage: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        params = dict(self.named_parameters())
        moe_maps = {}  # prefix -> (module, checkpoint suffix -> (buffer, local index, kind))
        for i in self.plan.layers:
            layer = self.model.layers[str(i)]
            if hasattr(layer, "block_sparse_moe"):
                moe = layer.block_sparse_moe
                moe_maps[f"model.layers.{i}.block_sparse_moe."] = (moe, moe.expert_state_names())
        for name in expected:
            t = state[name]
            path = checkpoint_to_module(name)
            if path in params:
                p = params[path]
                keep32 = expected[name].dtype == torch.float32
                with torch.no_grad():
                    if tuple(p.shape) != tuple(t.shape):
                        raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {tuple(p.shape)}")
                    p.data = t.to(torch.float32 if keep32 else dtype).to(p.device)  # no copy when it already fits
                continue
            for pre, (moe, names) in moe_maps.items():
                if name.startswith(pre + "experts."):
                    buf, li, kind = names[name[len(pre) :]]
                    target = getattr(moe, buf)
                    with torch.no_grad():
                        target[li].copy_(t if kind != "weight" else t.to(target.dtype))
                    break
            else:
                raise KeyError(f"{name}: no parameter of this stage takes it")
        self.act_dtype = dtype
        for moe, _ in moe_maps.values():
            if moe.cfg.quant is None:
                for w in ("w1", "w2", "w3"):
                    setattr(moe, f"{w}_weight", getattr(moe, f"{w}_weight").to(dtype))


def build_stage(
    cfg: K3Config,
    plan: StagePlan,
    state: dict[str, torch.Tensor],
    dtype=torch.float32,
    device="cpu",
    mla_mode: str = "auto",
) -> K3Stage:
    with torch.device("meta"):
        stage = K3Stage(cfg, plan, mla_mode)
    stage = stage.to_empty(device=device)
    for m in stage.modules():
        if isinstance(m, LatentMoE):
            m.init_maps()  # non-persistent buffers come back empty from the meta device
    stage.load_weights(state, dtype)
    return stage
