"""Loading Kev / Qwen3.5 checkpoints: a local directory, the built-in demo, or a benchmark shape."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kevscore.config import SHAPES, KevConfig
from kevscore.errors import KevscoreError

MODEL_NAMES = ("demo", *SHAPES)  # --model values that name no directory

MULTIMODAL_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "visual.")


@dataclass(slots=True)
class Checkpoint:
    name: str
    config: KevConfig
    weights: dict[str, torch.Tensor]  # text-model names: model.embed_tokens.weight, model.layers.N..., lm_head.weight
    tokenizer: object                  # a transformers PreTrainedTokenizerBase
    path: Path | None = None


def load_checkpoint(spec: str, device: str | torch.device = "cpu", seed: int = 0) -> Checkpoint:
    """`demo`, a benchmark shape name (`kev-0.8b`, `kev-4b`) or a checkpoint directory."""
    from kevscore.demo import demo_checkpoint_dir

    if spec == "demo":
        ckpt = load_directory(demo_checkpoint_dir())
        ckpt.name = "demo"
        return ckpt
    if spec in SHAPES:
        tok = load_tokenizer(demo_checkpoint_dir())
        cfg = SHAPES[spec]
        return Checkpoint(spec, cfg, random_weights(cfg, seed, torch.bfloat16, device), tok)
    path = Path(spec)
    if not path.is_dir():
        names = ", ".join(MODEL_NAMES)
        raise KevscoreError(f"--model {spec}: not a checkpoint directory (or one of: {names})")
    return load_directory(path)


def load_directory(path: Path) -> Checkpoint:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise KevscoreError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") not in ("qwen3_5", "qwen3_5_text"):
        raise KevscoreError(f"{cfg_file}: model_type {raw.get('model_type')!r} is not qwen3_5 / qwen3_5_text")
    cfg = KevConfig.from_hf(raw)
    weights = normalize_names(read_safetensors(path), cfg, path)
    return Checkpoint(str(path), cfg, weights, load_tokenizer(path), path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise KevscoreError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise KevscoreError(f"{path}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).is_file():
            raise KevscoreError(f"{index}: lists {name}, which is missing")
        weights.update(load_file(str(path / name)))
    return weights


def normalize_names(weights: dict[str, torch.Tensor], cfg: KevConfig, path: Path) -> dict[str, torch.Tensor]:
    """Map multimodal (`model.language_model.`) names to text-model names, drop vision/MTP, tie lm_head."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith(MULTIMODAL_PREFIX):
            name = "model." + name[len(MULTIMODAL_PREFIX):]
        elif name.startswith(SKIPPED_PREFIXES):
            continue
        out[name] = tensor
    if "lm_head.weight" not in out or cfg.tie_word_embeddings:
        if not cfg.tie_word_embeddings:
            raise KevscoreError(f"{path}: untied embeddings but no lm_head.weight in the weights")
        if "model.embed_tokens.weight" in out:  # else reported as missing below
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    missing = sorted(set(weight_shapes(cfg)) - set(out))
    if missing:
        raise KevscoreError(f"{path}: weights missing {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
    return out


def weight_shapes(cfg: KevConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every text-model tensor of `Qwen3_5ForCausalLM` for this config."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, cfg.intermediate_size)})
        if kind == "linear_attention":
            a, hv = p + "linear_attn.", cfg.linear_num_value_heads
            shapes.update({a + "in_proj_qkv.weight": (cfg.conv_dim, h), a + "in_proj_z.weight": (cfg.value_dim, h),
                           a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                           a + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                           a + "A_log": (hv,), a + "dt_bias": (hv,),
                           a + "norm.weight": (cfg.linear_value_head_dim,),
                           a + "out_proj.weight": (h, cfg.value_dim)})
        else:
            a, nh, nkv = p + "self_attn.", cfg.num_attention_heads, cfg.num_key_value_heads
            shapes.update({a + "q_proj.weight": (2 * nh * d, h), a + "k_proj.weight": (nkv * d, h),
                           a + "v_proj.weight": (nkv * d, h), a + "o_proj.weight": (h, nh * d),
                           a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    return shapes


def random_weights(cfg: KevConfig, seed: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Seeded random weights for benchmark shapes and tests: timing does not depend on their values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[name] = _init(name, shape, gen, device).to(dtype)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    rand = lambda: torch.rand(shape, generator=gen, device=device)  # noqa: E731
    if name.endswith("A_log"):
        return torch.log(1 + 15 * rand())
    if name.endswith("dt_bias"):
        return 0.5 + rand()
    if name.endswith("linear_attn.norm.weight"):
        return 0.9 + 0.2 * rand()
    if name.endswith("norm.weight"):
        return 0.2 * rand() - 0.1
    if name.endswith("conv1d.weight"):
        return (2 * rand() - 1) * 0.8
    if name == "model.embed_tokens.weight" or name == "lm_head.weight":
        return torch.randn(shape, generator=gen, device=device) * 0.5
    return (2 * rand() - 1) * (0.75 / shape[-1]) ** 0.5  # std 0.5 / sqrt(fan_in): well-conditioned in fp32
