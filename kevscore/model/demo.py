"""The built-in demo model: a small Kev checkpoint, byte-for-byte the same on every machine.

Its config is `DEMO_CONFIG`; its tokenizer files (a byte-level BPE made by `kevscore.demo.tokenizer`) and its
weights (trained on the demo task by `kevscore.demo.train`) ship in `demo_model/`. On first use they are put
together into a checkpoint directory in the cache.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kevscore.durable import cache_root, file_sha256, lock_file
from kevscore.errors import KevscoreError
from kevscore.model.config import FULL, LINEAR, KevConfig

DEMO_NAME = "demo-v4"
TRAINED_DIR = Path(__file__).parent / "demo_model"  # the shipped files: weights, training.json, tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # made by kevscore.demo.tokenizer
FILES = ("config.json", "model.safetensors", *TOKENIZER_FILES)

DEMO_CONFIG = KevConfig(vocab_size=1280, hidden_size=128, intermediate_size=256,
                        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                        linear_value_head_dim=64, max_position_embeddings=4096)  # the rest: KevConfig's defaults


def write_demo_files(dest: Path, cfg: KevConfig = DEMO_CONFIG) -> None:
    """Write config.json and the shipped tokenizer files of the demo model into `dest` (another `cfg` than
    the demo's: a model of the same tokenizer, for training experiments)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TRAINED_DIR / name, dest / name)
    ids = {t["content"]: t["id"] for t in json.loads((dest / "tokenizer.json").read_text("utf-8"))["added_tokens"]}
    config = cfg.to_hf() | {"bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
                            "dtype": "float32"}
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def build_demo_checkpoint(dest: Path) -> None:
    """Write the demo checkpoint into `dest`: config.json, the tokenizer files and the shipped trained weights
    (kevscore/model/demo_model/model.safetensors), checked against the SHA-256 that the training run recorded
    beside them (training.json)."""
    write_demo_files(dest)
    path = TRAINED_DIR / "model.safetensors"
    try:
        want = json.loads((TRAINED_DIR / "training.json").read_text())["model_sha256"]
        have = file_sha256(path)
    except (OSError, ValueError, KeyError) as exc:
        raise KevscoreError(f"{TRAINED_DIR}: the demo model's trained weights are missing or unreadable "
                            f"({exc}); reinstall kevscore") from exc
    if have != want:
        raise KevscoreError(f"{path}: SHA-256 {have[:12]}… is not the trained weights' {want[:12]}…; reinstall kevscore")
    shutil.copyfile(path, dest / "model.safetensors")


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in FILES)


def demo_checkpoint_dir(root: Path | None = None) -> Path:
    """The demo checkpoint in the cache ($KEVSCORE_CACHE or ~/.cache/kevscore), built atomically on first use.

    Builders serialize on a flock and re-check under it, so a complete directory is never moved while another
    process reads it (parallel test workers all ask for it at once); only an incomplete one is replaced."""
    root = Path(root or cache_root())
    target = root / DEMO_NAME
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with lock_file(root / f".{DEMO_NAME}.lock"):
        if _complete(target):  # built by another process while we waited
            return target
        # built in a temporary directory, which also takes an incomplete target aside and is removed with it
        with tempfile.TemporaryDirectory(prefix=f".{DEMO_NAME}.", dir=root, ignore_cleanup_errors=True) as tmp:
            build_demo_checkpoint(Path(tmp) / "new")
            if target.exists():  # incomplete (a build killed mid-way, by hand): moved aside, then replaced
                os.rename(target, Path(tmp) / "old")
            os.rename(Path(tmp) / "new", target)
    return target
