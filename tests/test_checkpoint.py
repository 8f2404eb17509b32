"""kevscore.model.checkpoint: text-only, multimodal, sharded and untied checkpoint directories, and their errors."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kevscore.cli import app
from kevscore.demo.train import tied_weight_shapes
from kevscore.errors import KevscoreError
from kevscore.model.checkpoint import load_checkpoint, load_directory
from kevscore.model.config import KevConfig
from kevscore.model.demo import DEMO_CONFIG, demo_checkpoint_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return demo_checkpoint_dir()


@pytest.fixture(scope="module")
def demo_tensors(demo_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(demo_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def text_config(demo_dir: Path) -> dict:
    return json.loads((demo_dir / "config.json").read_text())


def write_dir(path: Path, demo_dir: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A checkpoint directory: config.json, the demo's tokenizer files and (if given) model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(demo_dir / name, path / name)
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def multimodal_config(text_config: dict) -> dict:
    text = {k: v for k, v in text_config.items() if k not in ("architectures", "tie_word_embeddings")}
    text["model_type"] = "qwen3_5_text"
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": True, "text_config": text,
            "vision_config": {"model_type": "qwen3_5", "depth": 2, "hidden_size": 64}}


def multimodal_tensors(demo_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"model.language_model." + k[len("model."):]: v for k, v in demo_tensors.items()}
    assert len(out) == len(demo_tensors) and all(k.startswith("model.language_model.") for k in out)
    gen = torch.Generator().manual_seed(1)
    out.update({
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=gen),
        "model.visual.merger.linear_fc1.weight": torch.randn(16, 32, generator=gen),
        "mtp.fc.weight": torch.randn(128, 256, generator=gen),
        "mtp.layers.0.mlp.gate_proj.weight": torch.randn(256, 128, generator=gen),
    })
    return out


def assert_same_as_demo(ckpt, demo_tensors: dict[str, torch.Tensor]) -> None:
    assert ckpt.config == DEMO_CONFIG
    assert set(ckpt.weights) == set(demo_tensors) | {"lm_head.weight"}
    for name, tensor in demo_tensors.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    assert ckpt.weights["lm_head.weight"] is ckpt.weights["model.embed_tokens.weight"]  # tied


def error(path_or_spec, *parts: str) -> str:
    with pytest.raises(KevscoreError) as info:
        if isinstance(path_or_spec, Path):
            load_directory(path_or_spec)
        else:
            load_checkpoint(path_or_spec)
    msg = str(info.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


# ---------------------------------------------------------------- checkpoints that load

def test_demo_is_a_text_only_checkpoint(demo_dir: Path, demo_tensors, text_config: dict) -> None:
    assert text_config["model_type"] == "qwen3_5_text"
    assert set(demo_tensors) == set(tied_weight_shapes(DEMO_CONFIG))  # tied: no lm_head on disk
    ckpt = load_checkpoint("demo")
    assert ckpt.name == "demo" and ckpt.path == demo_dir
    assert_same_as_demo(ckpt, demo_tensors)
    for name, shape in tied_weight_shapes(DEMO_CONFIG).items():
        assert tuple(ckpt.weights[name].shape) == shape, name
    assert ckpt.tokenizer.encode("Yes", add_special_tokens=False) == [361]


def test_text_only_copy_by_path(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = write_dir(tmp_path / "text", demo_dir, text_config, demo_tensors)
    ckpt = load_checkpoint(str(path))
    assert ckpt.name == str(path) and ckpt.path == path
    assert_same_as_demo(ckpt, demo_tensors)


def test_multimodal_checkpoint(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = write_dir(tmp_path / "mm", demo_dir, multimodal_config(text_config), multimodal_tensors(demo_tensors))
    ckpt = load_directory(path)
    assert KevConfig.from_hf(json.loads((path / "config.json").read_text())) == DEMO_CONFIG
    assert_same_as_demo(ckpt, demo_tensors)
    assert not [k for k in ckpt.weights if "visual" in k or k.startswith("mtp.") or "language_model" in k]


def test_multimodal_config_tie_inside_text_config(tmp_path: Path, demo_dir: Path, demo_tensors,
                                                  text_config: dict) -> None:
    config = multimodal_config(text_config)
    del config["tie_word_embeddings"]
    config["text_config"]["tie_word_embeddings"] = True
    path = write_dir(tmp_path / "mm", demo_dir, config, multimodal_tensors(demo_tensors))
    assert_same_as_demo(load_directory(path), demo_tensors)


def write_sharded(path: Path, demo_dir: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 3) -> dict:
    write_dir(path, demo_dir, config)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k].contiguous() for k in part}, str(path / file))
        weight_map.update({k: file for k in part})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_sharded_checkpoint(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = tmp_path / "sharded"
    index = write_sharded(path, demo_dir, text_config, demo_tensors)
    assert len(set(index["weight_map"].values())) == 3
    assert not (path / "model.safetensors").exists()
    assert_same_as_demo(load_directory(path), demo_tensors)


def test_sharded_multimodal_checkpoint(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = tmp_path / "sharded-mm"
    write_sharded(path, demo_dir, multimodal_config(text_config), multimodal_tensors(demo_tensors), shards=4)
    assert_same_as_demo(load_directory(path), demo_tensors)


def untied(text_config: dict, demo_tensors) -> tuple[dict, dict[str, torch.Tensor]]:
    config = dict(text_config, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(2)
    embed = demo_tensors["model.embed_tokens.weight"]
    head = torch.randn(embed.shape, generator=gen) * 0.05
    return config, {**demo_tensors, "lm_head.weight": head}


def test_untied_embeddings(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    config, tensors = untied(text_config, demo_tensors)
    ckpt = load_directory(write_dir(tmp_path / "untied", demo_dir, config, tensors))
    assert ckpt.config == dataclasses.replace(DEMO_CONFIG, tie_word_embeddings=False)
    assert torch.equal(ckpt.weights["lm_head.weight"], tensors["lm_head.weight"])
    assert not torch.equal(ckpt.weights["lm_head.weight"], ckpt.weights["model.embed_tokens.weight"])
    for name, tensor in demo_tensors.items():
        assert torch.equal(ckpt.weights[name], tensor), name


def test_tied_config_ignores_a_stored_lm_head(tmp_path: Path, demo_dir: Path, demo_tensors, text_config) -> None:
    _, tensors = untied(text_config, demo_tensors)  # an lm_head on disk, but the config says tied
    ckpt = load_directory(write_dir(tmp_path / "tied", demo_dir, text_config, tensors))
    assert ckpt.weights["lm_head.weight"] is ckpt.weights["model.embed_tokens.weight"]


# ---------------------------------------------------------------- errors

def test_not_a_directory(tmp_path: Path) -> None:
    error("nowhere", "nowhere", "not a checkpoint directory", "demo", "kev-4b")
    error(str(tmp_path / "nowhere"), f"{tmp_path / 'nowhere'}: no such model directory")
    (tmp_path / "file").write_text("x")
    error(str(tmp_path / "file"), "not a model directory")


def test_no_config(tmp_path: Path, demo_dir: Path, demo_tensors) -> None:
    path = write_dir(tmp_path / "c", demo_dir, {}, demo_tensors)
    (path / "config.json").unlink()
    error(path, str(path), "no config.json")


def test_wrong_model_type(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = write_dir(tmp_path / "c", demo_dir, dict(text_config, model_type="llama"), demo_tensors)
    error(path, str(path / "config.json"), "'llama'", "qwen3_5")


def test_no_safetensors(tmp_path: Path, demo_dir: Path, text_config: dict) -> None:
    path = write_dir(tmp_path / "c", demo_dir, text_config)
    error(path, str(path), "no *.safetensors")


def test_shard_listed_but_missing(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = tmp_path / "sharded"
    write_sharded(path, demo_dir, text_config, demo_tensors)
    (path / "model-00002-of-00003.safetensors").unlink()
    error(path, str(path / "model.safetensors.index.json"), "model-00002-of-00003.safetensors", "missing")


@pytest.mark.parametrize("drop", ["model.layers.2.linear_attn.A_log", "model.layers.3.self_attn.q_proj.weight",
                                  "model.embed_tokens.weight"])
def test_missing_tensor(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict, drop: str) -> None:
    tensors = {k: v for k, v in demo_tensors.items() if k != drop}
    assert len(tensors) == len(demo_tensors) - 1
    path = write_dir(tmp_path / "c", demo_dir, text_config, tensors)
    error(path, str(path), "weights missing", drop)


def test_missing_tensor_multimodal(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    tensors = multimodal_tensors(demo_tensors)
    del tensors["model.language_model.layers.0.mlp.up_proj.weight"]
    path = write_dir(tmp_path / "c", demo_dir, multimodal_config(text_config), tensors)
    error(path, "weights missing 1 tensors", "model.layers.0.mlp.up_proj.weight")


def test_untied_without_lm_head(tmp_path: Path, demo_dir: Path, demo_tensors, text_config: dict) -> None:
    path = write_dir(tmp_path / "c", demo_dir, dict(text_config, tie_word_embeddings=False), demo_tensors)
    error(path, str(path), "untied embeddings", "lm_head.weight")


# ---------------------------------------------------------------- end to end

def test_cli_run_with_multimodal_checkpoint(tmp_path: Path, demo_dir: Path, demo_tensors, text_config) -> None:
    model = write_dir(tmp_path / "mm", demo_dir, multimodal_config(text_config), multimodal_tensors(demo_tensors))
    shutil.copy(EXAMPLES / "questions.parquet", tmp_path / "questions.parquet")
    runner = CliRunner()
    outputs = {}
    for spec in (str(model), "demo"):
        out = tmp_path / f"{Path(spec).name}.parquet"
        result = runner.invoke(app, ["run", str(tmp_path / "questions.parquet"), "--model", spec,
                                     "--device", "cpu", "-o", str(out)])
        assert result.exit_code == 0, (result.stderr, result.exception)
        outputs[spec] = pq.read_table(out)
    mm, demo = outputs[str(model)], outputs["demo"]
    assert mm.num_rows == 15
    assert mm.column("question_id").to_pylist() == demo.column("question_id").to_pylist()
    assert mm.column("probs").to_pylist() == demo.column("probs").to_pylist()
    assert mm.column("label_mass").to_pylist() == demo.column("label_mass").to_pylist()
