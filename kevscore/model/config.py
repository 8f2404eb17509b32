"""Kev model configuration: the subset of a Qwen3.5 text config that kevscore's layers need."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from kevscore.errors import KevscoreError

LINEAR, FULL = "linear_attention", "full_attention"

HF_ROPE = ("rope_theta", "partial_rotary_factor")  # fields `rope_parameters` (or `rope_scaling`) may hold


@dataclass(frozen=True, slots=True)
class KevConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    # the defaults: what transformers' Qwen3.5 text config assumes for a field its config.json leaves out
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q and k (`linear_num_key_heads` heads each), then v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def conv_state_len(self) -> int:
        """Conv inputs a document's bank entry keeps: its last k - 1."""
        return self.linear_conv_kernel_dim - 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "KevConfig":
        """Read a Hugging Face `config.json` dict of model_type qwen3_5 (multimodal) or qwen3_5_text."""
        text = raw.get("text_config", raw) if raw.get("model_type") != "qwen3_5_text" else raw
        if missing := [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers") if k not in text]:
            raise KevscoreError(f"config.json: missing {', '.join(missing)} (is this a Qwen3.5 / Kev checkpoint?)")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise KevscoreError(f"config.json: rope type {rope.get('rope_type')!r} is not supported (only 'default')")
        layers = text.get("num_hidden_layers")
        types = text.get("layer_types") or [FULL if (i + 1) % text.get("full_attention_interval", 4) == 0 else LINEAR
                                            for i in range(layers)]
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        given = {f.name: text[f.name] for f in fields(cls) if f.name in text}
        return cls(**{**given, **{k: v for k, v in rope.items() if k in HF_ROPE},
                      "layer_types": tuple(types[:layers]), "tie_word_embeddings": bool(tie)})

    def to_hf(self) -> dict[str, Any]:
        """A `qwen3_5_text` config.json dict that transformers' Qwen3_5TextConfig accepts."""
        d = asdict(self)
        rope = {"rope_type": "default", **{name: d.pop(name) for name in HF_ROPE}}
        return d | {"layer_types": list(self.layer_types), "num_hidden_layers": len(self.layer_types),
                    "rope_parameters": rope, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
                    "hidden_act": "silu"}


def _shape(hidden: int, mlp: int, layers: int, heads: tuple[int, int], lin: tuple[int, int], vocab: int) -> KevConfig:
    types = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers))
    return KevConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, layer_types=types,
                     num_attention_heads=heads[0], num_key_value_heads=heads[1], linear_num_key_heads=lin[0],
                     linear_num_value_heads=lin[1], rope_theta=10_000_000.0, max_position_embeddings=262144)


# Benchmark shapes (seeded random weights; see kevscore.model.checkpoint.random_weights).
SHAPES: dict[str, KevConfig] = {"kev-0.8b": _shape(1024, 3584, 24, (8, 2), (16, 16), 248320),
                                "kev-4b": _shape(2560, 9216, 32, (16, 4), (16, 32), 248320)}


def weight_shapes(cfg: KevConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every text-model tensor of `Qwen3_5ForCausalLM` for this config."""
    h, d, mlp, hv = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.linear_num_value_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    block = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (mlp, h),
             "mlp.up_proj.weight": (mlp, h), "mlp.down_proj.weight": (h, mlp)}
    linear = {"in_proj_qkv.weight": (cfg.conv_dim, h), "in_proj_z.weight": (cfg.value_dim, h), "in_proj_b.weight": (hv, h),
              "in_proj_a.weight": (hv, h), "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), "A_log": (hv,),
              "dt_bias": (hv,), "norm.weight": (cfg.linear_value_head_dim,), "out_proj.weight": (h, cfg.value_dim)}
    attention = {"q_proj.weight": (2 * nh * d, h), "k_proj.weight": (nkv * d, h), "v_proj.weight": (nkv * d, h),
                 "o_proj.weight": (h, nh * d), "q_norm.weight": (d,), "k_norm.weight": (d,)}
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i, kind in enumerate(cfg.layer_types):  # per layer its block's tensors, then its mixer's
        mixer, mixer_shapes = ("linear_attn.", linear) if kind == LINEAR else ("self_attn.", attention)
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in block.items()})
        shapes.update({f"model.layers.{i}.{mixer}{name}": shape for name, shape in mixer_shapes.items()})
    return shapes
