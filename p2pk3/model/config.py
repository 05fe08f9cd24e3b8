"""Model configuration: parse the published `config.json` of Kimi K3 / Kimi Linear, plus presets.
(One module over 500 lines: K3Config, its parser and the presets built from it are one definition of the
model's shape, and the presets double as the parser's test vectors.)

Facts and their sources are in `shared/spec/kimi-k3-architecture.md` (section 1.1 for K3, section 8 for
Kimi-Linear-48B-A3B). Layer lists in the checkpoint are **1-indexed**; everything in this package is
0-indexed (`layer_types[i]`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that we cannot run exactly: missing or inconsistent values, unsupported features (and,
    with strict=True, keys this engine does not know)."""


class ConfigWarning(UserWarning):
    """A config.json key that is neither transformers boilerplate nor a key this engine knows (ignored)."""


# What transformers' PretrainedConfig writes into every config.json it saves, at the top level and in each
# nested config (`text_config`, `vision_config`): 4.x generation defaults (`top_k: 50`, `max_length: 20`, ...),
# fine-tuning / encoder-decoder / export attributes, 5.x `dtype` and implementation switches. None of them
# changes the math of this inference-only decoder, so they are ignored without a word at every level (the
# token ids and `model_type` among them are still read from the text config; `_HF_DEFAULT_ONLY` are checked).
_HF_BOILERPLATE = frozenset(
    {
        # bookkeeping
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "_attn_implementation_autoset",
        "attn_implementation",
        "_attn_implementation",
        "experts_implementation",
        "torch_dtype",
        "dtype",
        "use_bfloat16",
        "torchscript",
        "tf_legacy_loss",
        # outputs / caching switches
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "output_scores",
        "return_dict_in_generate",
        "use_cache",
        "chunk_size_feed_forward",
        "pruned_heads",
        "tie_word_embeddings",
        # encoder-decoder / cross attention
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "decoder_start_token_id",
        # fine-tuning and tokenizer hints
        "finetuning_task",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        # special token ids
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        # generation defaults (sampling is configured per request / generation_config.json, not here)
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "repetition_penalty",
        "encoder_repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
    }
)
# Boilerplate keys that would describe a different model if they left their default.
_HF_DEFAULT_ONLY = {
    "pruned_heads": {},
    "is_encoder_decoder": False,
    "add_cross_attention": False,
    "tie_encoder_decoder": False,
}

# Keys of the multimodal K3 wrapper (top level) besides boilerplate; they do not concern the text tower.
_WRAPPER_KEYS = frozenset(
    {
        "text_config",
        "vision_config",
        "quantization_config",
        "media_placeholder_token_id",
        "ignore_index",
        "image_token_index",
        "image_token_id",
        "video_token_id",
        "projector_hidden_act",
        "projector_ln_eps",
        "mm_projector_type",
        "mm_hidden_size",
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "video_placeholder",
        "image_placeholder",
    }
)


@dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors quantization of the routed experts (spec 1.1, 6.2)."""

    format: str = "mxfp4-pack-quantized"
    group_size: int = 32
    num_bits: int = 4
    ignore: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class K3Config:
    # -- trunk
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_position_embeddings: int = 1 << 20
    # -- layer pattern (0-indexed here)
    full_attn_layers: tuple[int, ...] = ()
    # -- KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = None  # K3: -5.0 (bounded sigmoid gate); None: Kimi-Linear softplus gate
    kda_full_rank_gate: bool = True  # K3: g_proj hidden->H*K; Kimi-Linear: g_a_proj/g_b_proj low rank
    # -- MLA
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = False
    # -- MLP / MoE
    intermediate_size: int = 0
    first_k_dense_replace: int = 1
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: int | None = None  # latent width (K3 3584); None: experts run at hidden
    latent_moe_use_norm: bool = False
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    hidden_act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # -- Attention Residuals (None: plain residual stream, Kimi Linear)
    attn_res_block_size: int | None = None
    # -- quantization of routed experts (None: experts stored as bf16 `weight`)
    quant: QuantConfig | None = None
    model_type: str = "kimi_k3"

    # ---------------------------------------------------------------- derived
    def __post_init__(self) -> None:
        self.validate()

    @property
    def layer_types(self) -> tuple[str, ...]:
        full = set(self.full_attn_layers)
        return tuple("mla" if i in full else "kda" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:  # 576 for K3
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_width(self) -> int:  # the width routed experts read and write
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def kda_gate_low_rank(self) -> int:  # f_a_proj (and Kimi-Linear's g_a_proj) rank = head_dim (128)
        return self.kda_head_dim

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def kda_a_log_len(self) -> int:
        # K3 stores A_log as [128] with only the first 96 (= heads) entries real (spec 1.2, [V2]).
        # Our reading: the tensor is padded to max(heads, head_dim). Uncertain for other shapes;
        # the loader accepts any length >= heads and checks that the padding is zero.
        return max(self.kda_num_heads, self.kda_head_dim)

    def bank_rows_before(self, layer: int) -> int:
        """Number of AttnRes snapshots that exist before `layer` runs (spec 4.2: ceil(l/12))."""
        if not self.uses_attn_res:
            return 0
        return math.ceil(layer / self.attn_res_block_size)

    @property
    def max_bank_rows(self) -> int:
        return self.bank_rows_before(self.num_hidden_layers)

    # ---------------------------------------------------------------- checks
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        L = self.num_hidden_layers
        need(
            L > 0 and self.hidden_size > 0 and self.vocab_size > 0,
            "hidden_size, num_hidden_layers and vocab_size must be positive",
        )
        need(all(0 <= i < L for i in self.full_attn_layers), f"full_attn_layers name layers outside 1..{L}")
        n_kda = L - len(set(self.full_attn_layers))
        if n_kda:
            need(
                self.kda_num_heads > 0 and self.kda_head_dim > 0,
                "KDA layers present but linear_attn_config.num_heads/head_dim missing",
            )
        if self.full_attn_layers:
            need(self.num_attention_heads > 0, "MLA layers present but num_attention_heads missing")
        if self.kda_gate_lower_bound is not None:
            need(
                -5.0 <= self.kda_gate_lower_bound < 0,
                f"gate_lower_bound must be in [-5, 0), got {self.kda_gate_lower_bound}",
            )
        need(self.hidden_act in ("situ", "silu"), f"hidden_act {self.hidden_act!r} is not supported (situ or silu)")
        if self.num_experts:
            need(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token must be in 1..num_experts")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size missing")
            need(0 <= self.first_k_dense_replace <= L, "first_k_dense_replace out of range")
        if self.first_k_dense_replace > 0 or not self.num_experts:
            need(self.intermediate_size > 0, "dense layers present but intermediate_size missing")
        if self.latent_moe_use_norm:
            need(self.routed_expert_hidden_size is not None, "latent_moe_use_norm needs routed_expert_hidden_size")
        if self.quant is not None:
            g = self.quant.group_size
            need(
                self.quant.format == "mxfp4-pack-quantized",
                f"quantization format {self.quant.format!r} is not supported (mxfp4-pack-quantized)",
            )
            need(g == 32 and self.quant.num_bits == 4, "MXFP4 needs group_size 32 and 4 bits")
            need(
                self.expert_width % g == 0 and self.moe_intermediate_size % g == 0,
                f"expert widths ({self.expert_width}, {self.moe_intermediate_size}) must be multiples of the MX group {g}",
            )
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size must be positive")

    def replace(self, **kw: Any) -> "K3Config":
        return replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---------------------------------------------------------------- HF config.json
    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json in the published layout (K3: multimodal wrapper + text_config)."""
        L = self.num_hidden_layers
        full = sorted(set(self.full_attn_layers))
        text: dict[str, Any] = {
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": L,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_conv_size,
                "kda_layers": [i + 1 for i in range(L) if i not in set(full)],
                "full_attn_layers": [i + 1 for i in full],
            },
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "topk_method": "noaux_tc",
            "num_expert_group": 1,
            "topk_group": 1,
            "hidden_act": self.hidden_act,
            "num_nextn_predict_layers": 0,
            "rope_theta": 10000.0,
        }
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, k) is not None:
                text[k] = getattr(self, k)
        if self.kda_gate_lower_bound is not None:
            text["linear_attn_config"]["gate_lower_bound"] = self.kda_gate_lower_bound
        text["linear_attn_config"]["use_full_rank_gate"] = self.kda_full_rank_gate
        if self.model_type == "kimi_linear":
            text["architectures"] = ["KimiLinearForCausalLM"]
            if self.quant is not None:
                text["quantization_config"] = _quant_to_hf(self.quant)
            return text
        text.update(
            {
                "mla_use_output_gate": self.mla_use_output_gate,
                "routed_expert_hidden_size": self.routed_expert_hidden_size,
                "latent_moe_use_norm": self.latent_moe_use_norm,
                "activation_situ_beta": self.situ_beta,
                "activation_situ_linear_beta": self.situ_linear_beta,
                "attn_res_block_size": self.attn_res_block_size,
            }
        )
        out: dict[str, Any] = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
        }
        if self.quant is not None:
            out["quantization_config"] = _quant_to_hf(self.quant)
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, strict: bool = False) -> "K3Config":
        """Parse a published config.json (dict). Transformers boilerplate is ignored; keys neither
        boilerplate nor known to this engine give one ConfigWarning naming them (`strict`: a ConfigError)."""
        return _parse_hf(raw, strict=strict)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, strict: bool = False) -> "K3Config":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        try:
            return _parse_hf(raw, strict=strict, source=str(p))
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None


def _quant_to_hf(q: QuantConfig) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": q.format,
        "config_groups": {
            "group_0": {
                "format": q.format,
                "targets": ["Linear"],
                "weights": {
                    "num_bits": q.num_bits,
                    "type": "float",
                    "group_size": q.group_size,
                    "strategy": "group",
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(q.ignore)
        or [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*routed_expert_(down|up)_proj.*",
            "re:.*block_sparse_moe\\.gate$",
            "lm_head",
        ],
    }


def _parse_quant(q: dict[str, Any] | None) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (compressed-tensors)")
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"quantization_config needs exactly one config group, found {len(groups)}")
    (grp,) = groups.values()
    w = grp.get("weights") or {}
    fmt = grp.get("format", fmt)
    if w.get("type") != "float":
        raise ConfigError(f"quantized weight type {w.get('type')!r} is not supported (float = MXFP4)")
    if grp.get("input_activations"):
        raise ConfigError("activation quantization in the checkpoint is not supported (K3 declares none)")
    return QuantConfig(
        format=fmt,
        group_size=int(w.get("group_size", 0)),
        num_bits=int(w.get("num_bits", 0)),
        ignore=tuple(q.get("ignore") or ()),
    )


# Model keys of the text config (kimi_linear): read below, checked below, or known not to change the
# math at inference (training-only knobs, legacy fields, rope_* of a NoPE model).
_TEXT_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "num_experts",
        "num_experts_per_token",
        "num_experts_per_tok",
        "n_routed_experts",
        "num_shared_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "routed_expert_hidden_size",
        "latent_moe_use_norm",
        "hidden_act",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "attn_res_block_size",
        "rms_norm_eps",
        "routed_scaling_factor",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "mla_use_nope",
        "mla_use_output_gate",
        "full_attn_layers",
        "kda_layers",
        "linear_attn_config",
        "quantization_config",
        "max_position_embeddings",
        "model_max_length",
        "first_k_dense_replace",
        "moe_layer_freq",
        "moe_router_activation_func",
        "moe_renormalize",
        "norm_topk_prob",
        "scoring_func",
        "topk_method",
        "use_grouped_topk",
        "num_expert_group",
        "n_group",
        "topk_group",
        "num_nextn_predict_layers",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "initializer_range",
        "attention_dropout",
        "attention_bias",
        "pretraining_tp",
        "aux_loss_alpha",
        "seq_aux",
        "router_aux_loss_coef",
        "output_router_logits",
        "ep_size",
        "use_cache_for_linear",
    }
)
_LINEAR_ATTN_KEYS = frozenset(
    {
        "num_heads",
        "head_dim",
        "short_conv_kernel_size",
        "gate_lower_bound",
        "use_full_rank_gate",
        "kda_layers",
        "full_attn_layers",
    }
)

_warned: set[tuple[str, ...]] = set()  # unknown-key sets already reported (warn once per process)


def _check_keys(raw: dict[str, Any], known: frozenset[str], where: str) -> list[str]:
    """Unknown keys of one level (as `where.key`); boilerplate that must keep its default is checked."""
    for k, default in _HF_DEFAULT_ONLY.items():
        if k in raw and raw[k] not in (default, None):
            raise ConfigError(
                f"{where}{k} = {raw[k]!r}: this engine runs the model only with the default "
                f"{default!r} (a decoder-only model without pruned heads or cross attention)"
            )
    return [where + k for k in sorted(set(raw) - known - _HF_BOILERPLATE)]


def _report_unknown(unknown: list[str], strict: bool, source: str) -> None:
    if not unknown:
        return
    if strict:
        raise ConfigError(f"unknown keys {unknown} (strict: remove them, or load without strict to ignore them)")
    key = (source, *unknown)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"{source}: ignoring keys this engine does not know: {', '.join(unknown)}. If one of them "
        f"changes the model, the result will be wrong: check it against p2pk3/model/config.py "
        f"(strict=True makes this an error)",
        ConfigWarning,
        stacklevel=4,
    )


def _parse_hf(raw: dict[str, Any], *, strict: bool, source: str = "config.json") -> K3Config:
    """`strict`: unknown keys are an error instead of a (once-per-process) ConfigWarning."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    mt = raw.get("model_type")
    quant_raw = raw.get("quantization_config")
    unknown: list[str] = []
    if mt == "kimi_k3":
        unknown += _check_keys(raw, _WRAPPER_KEYS, "")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("kimi_k3 config has no text_config (the text tower's settings)")
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ConfigError(f"text_config.model_type {text.get('model_type')!r}; expected kimi_linear")
        quant_raw = quant_raw or text.get("quantization_config")
        model_type, where = "kimi_k3", "text_config."
    elif mt == "kimi_linear":
        text = raw
        model_type, where = "kimi_linear", ""
    else:
        raise ConfigError(f"model_type {mt!r} is not supported (kimi_k3 or kimi_linear)")

    unknown += _check_keys(text, _TEXT_KEYS, where)
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"{where}linear_attn_config must be an object, got {lac!r}")
    unknown += [f"{where}linear_attn_config.{k}" for k in sorted(set(lac) - _LINEAR_ATTN_KEYS)]
    _report_unknown(unknown, strict, source)

    L = _int(text, "num_hidden_layers", where)
    full1 = lac.get("full_attn_layers", text.get("full_attn_layers"))
    kda1 = lac.get("kda_layers", text.get("kda_layers"))
    if full1 is None and kda1 is None:
        raise ConfigError("neither full_attn_layers nor kda_layers given")
    full1 = list(full1 or [])
    kda1 = list(kda1 if kda1 is not None else [i for i in range(1, L + 1) if i not in set(full1)])
    if kda1 and not full1 and "full_attn_layers" not in lac and "full_attn_layers" not in text:
        full1 = [i for i in range(1, L + 1) if i not in set(kda1)]
    both = set(full1) & set(kda1)
    if both:
        raise ConfigError(f"layers {sorted(both)} are in both kda_layers and full_attn_layers")
    missing = set(range(1, L + 1)) - set(full1) - set(kda1)
    if missing:
        raise ConfigError(
            f"layers {sorted(missing)} are in neither kda_layers nor full_attn_layers (lists are 1-indexed)"
        )
    outside = [i for i in full1 + kda1 if not 1 <= i <= L]
    if outside:
        raise ConfigError(f"layer numbers {outside} outside 1..{L} (lists are 1-indexed)")

    heads = int(text.get("num_attention_heads", 0))
    kvh = text.get("num_key_value_heads", heads)
    if kvh != heads:
        raise ConfigError(
            f"num_key_value_heads {kvh} != num_attention_heads {heads}: MLA shares one latent, heads must match"
        )
    if text.get("mla_use_nope") is False:
        raise ConfigError("mla_use_nope=false (rotary MLA) is not supported: K3 and Kimi Linear use NoPE")
    if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError("only the sigmoid router is supported")
    if text.get("num_expert_group", 1) != 1 or text.get("topk_group", 1) != 1:
        raise ConfigError("grouped top-k routing with more than one group is not supported")
    if text.get("num_nextn_predict_layers", 0):
        raise ConfigError("MTP layers (num_nextn_predict_layers > 0) are not supported")
    if text.get("moe_layer_freq", 1) != 1:
        raise ConfigError("moe_layer_freq != 1 is not supported")
    n_experts = int(text.get("num_experts", text.get("n_routed_experts", 0)) or 0)
    topk = int(text.get("num_experts_per_token", text.get("num_experts_per_tok", 0)) or 0)

    is_k3 = model_type == "kimi_k3"
    act = text.get("hidden_act", "situ" if is_k3 else "silu")
    return K3Config(
        model_type=model_type,
        vocab_size=_int(text, "vocab_size", where),
        hidden_size=_int(text, "hidden_size", where),
        num_hidden_layers=L,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        bos_token_id=text.get("bos_token_id"),
        eos_token_id=_first(text.get("eos_token_id")),
        pad_token_id=text.get("pad_token_id"),
        max_position_embeddings=int(text.get("max_position_embeddings", text.get("model_max_length", 1 << 20))),
        full_attn_layers=tuple(sorted(i - 1 for i in full1)),
        kda_num_heads=int(lac.get("num_heads", 0)),
        kda_head_dim=int(lac.get("head_dim", 128)),
        kda_conv_size=int(lac.get("short_conv_kernel_size", 4)),
        kda_gate_lower_bound=lac.get("gate_lower_bound"),
        kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        num_attention_heads=heads,
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=int(text.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(text.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(text.get("qk_rope_head_dim", 64)),
        v_head_dim=int(text.get("v_head_dim", 128)),
        mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
        intermediate_size=int(text.get("intermediate_size", 0)),
        first_k_dense_replace=int(text.get("first_k_dense_replace", 0)),
        num_experts=n_experts,
        num_experts_per_token=topk,
        num_shared_experts=int(text.get("num_shared_experts", text.get("n_shared_experts", 0)) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0)),
        routed_expert_hidden_size=text.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)),
        moe_renormalize=bool(text.get("moe_renormalize", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        hidden_act=act,
        situ_beta=float(text.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=text.get("attn_res_block_size"),
        quant=_parse_quant(quant_raw),
    )


def _int(d: dict[str, Any], k: str, where: str = "") -> int:
    if k not in d:
        raise ConfigError(f"missing required key {where + k!r}")
    v = d[k]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"{where}{k} must be an integer, got {v!r}")
    return v


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


# ------------------------------------------------------------------------------------------- presets
def _k3_full_attn(L: int) -> tuple[int, ...]:
    """K3 cadence: every 4th layer (1-indexed 4, 8, ...) plus the last layer is MLA."""
    return tuple(sorted({i for i in range(3, L, 4)} | {L - 1}))


KIMI_K3 = K3Config(
    vocab_size=163840,
    hidden_size=7168,
    num_hidden_layers=93,
    rms_norm_eps=1e-5,
    bos_token_id=163584,
    eos_token_id=163586,
    pad_token_id=163839,
    full_attn_layers=_k3_full_attn(93),
    kda_num_heads=96,
    kda_head_dim=128,
    kda_conv_size=4,
    kda_gate_lower_bound=-5.0,
    kda_full_rank_gate=True,
    num_attention_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    mla_use_output_gate=True,
    intermediate_size=33792,
    first_k_dense_replace=1,
    num_experts=896,
    num_experts_per_token=16,
    num_shared_experts=2,
    moe_intermediate_size=3072,
    routed_expert_hidden_size=3584,
    latent_moe_use_norm=True,
    routed_scaling_factor=1.0,
    hidden_act="situ",
    situ_beta=4.0,
    situ_linear_beta=25.0,
    attn_res_block_size=12,
    quant=QuantConfig(),
    model_type="kimi_k3",
)

KIMI_LINEAR_48B = K3Config(
    vocab_size=163840,
    hidden_size=2304,
    num_hidden_layers=27,
    rms_norm_eps=1e-5,
    bos_token_id=163584,
    eos_token_id=163586,
    pad_token_id=163839,
    full_attn_layers=tuple(i - 1 for i in (4, 8, 12, 16, 20, 24, 27)),
    kda_num_heads=32,
    kda_head_dim=128,
    kda_conv_size=4,
    kda_gate_lower_bound=None,
    kda_full_rank_gate=False,
    num_attention_heads=32,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    mla_use_output_gate=False,
    intermediate_size=9216,
    first_k_dense_replace=1,
    num_experts=256,
    num_experts_per_token=8,
    num_shared_experts=1,
    moe_intermediate_size=1024,
    routed_expert_hidden_size=None,
    latent_moe_use_norm=False,
    routed_scaling_factor=2.446,
    hidden_act="silu",
    attn_res_block_size=None,
    quant=None,
    model_type="kimi_linear",
)

# Tiny models in the same layout, for tests. Every structural feature of K3 is present: KDA and MLA
# in the K3 cadence (last two layers MLA), a dense layer 0, latent MoE with MXFP4 experts, several
# AttnRes blocks (block size 2 so that snapshots are pushed inside a 6-layer model).
TINY_K3 = KIMI_K3.replace(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    full_attn_layers=_k3_full_attn(6),
    kda_num_heads=2,
    kda_head_dim=16,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    attn_res_block_size=2,
)

# A "small" K3 for CPU benchmarks (tools/bench_vs_mlx.py): the same structure, widths where per-op overhead
# no longer dominates every matmul (~40M parameters).
SMALL_K3 = KIMI_K3.replace(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    full_attn_layers=_k3_full_attn(8),
    kda_num_heads=4,
    kda_head_dim=64,
    num_attention_heads=8,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    intermediate_size=1536,
    num_experts=32,
    num_experts_per_token=4,
    num_shared_experts=1,
    moe_intermediate_size=256,
    routed_expert_hidden_size=256,
    attn_res_block_size=2,
)

TINY_KIMI_LINEAR = KIMI_LINEAR_48B.replace(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    full_attn_layers=(3,),
    kda_num_heads=2,
    kda_head_dim=16,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=128,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
)

PRESETS: dict[str, K3Config] = {
    "kimi-k3": KIMI_K3,
    "kimi-linear-48b": KIMI_LINEAR_48B,
    "tiny-k3": TINY_K3,
    "small-k3": SMALL_K3,
    "tiny-kimi-linear": TINY_KIMI_LINEAR,
}


def preset(name: str) -> K3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
