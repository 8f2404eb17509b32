"""The built-in demo checkpoint: deterministic bytes, loadable by transformers, a usable tokenizer, the cache."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from kevscore.demo.train import tied_weight_shapes
from kevscore.model.config import KevConfig
from kevscore.model.demo import (
    DEMO_CONFIG,
    DEMO_NAME,
    TOKENIZER_FILES,
    TRAINED_DIR,
    build_demo_checkpoint,
    demo_checkpoint_dir,
)

FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
PATCHED = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("demo") / "ckpt"
    build_demo_checkpoint(dest)
    return dest


@pytest.fixture(scope="module")
def tok(ckpt: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_build_is_byte_identical(ckpt: Path, tmp_path: Path) -> None:
    build_demo_checkpoint(tmp_path / "again")
    assert set(_digests(ckpt)) == FILES
    assert _digests(ckpt) == _digests(tmp_path / "again")


def test_shipped_tokenizer_files_are_what_the_builder_makes() -> None:
    from kevscore.demo.tokenizer import tokenizer_files

    assert tokenizer_files() == {name: (TRAINED_DIR / name).read_bytes() for name in TOKENIZER_FILES}


def test_config_round_trips(ckpt: Path, tok) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    assert KevConfig.from_hf(raw) == DEMO_CONFIG
    assert DEMO_CONFIG.vocab_size == -(-len(tok) // 64) * 64
    assert raw["eos_token_id"] == tok.eos_token_id and raw["pad_token_id"] == tok.pad_token_id
    assert raw["bos_token_id"] is None and raw["dtype"] == "float32"


def test_transformers_loads_and_runs(ckpt: Path, tok, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from safetensors import safe_open

    for name in PATCHED:  # the fla kernels transformers picks up do not run on CPU
        fn = getattr(modeling, name)
        monkeypatch.setattr(modeling, name, getattr(fn, "__wrapped__", fn))
    config = modeling.Qwen3_5TextConfig(**json.loads((ckpt / "config.json").read_text()))
    model, info = modeling.Qwen3_5ForCausalLM.from_pretrained(ckpt, config=config, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert tied_weight_shapes(DEMO_CONFIG) == expected
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        weights = {k: f.get_tensor(k) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert all(v.dtype == torch.float32 for v in weights.values())
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())  # nothing re-initialised on load
    assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])  # tied
    # transformers itself, on the full prompt, answers the demo task's example questions
    from kevscore.demo.train import example_rows
    from kevscore.model.prompt import chat_template

    template, rows = chat_template(tok), example_rows()[:8]
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    for dtype in (torch.float32, torch.bfloat16):
        right = 0
        for e in rows:
            ids = tok(template.prefix(e.document), add_special_tokens=False)["input_ids"]
            ids += tok(template.branch(e.question), add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model.to(dtype)(torch.tensor([ids])).logits[0, -1].float()
            assert torch.isfinite(logits).all()
            right += ("Yes" if logits[yes] >= logits[no] else "No") == e.answer
        assert right >= 7, (dtype, right)


@pytest.mark.parametrize("word", ["Yes", "No", " Yes", " No", "yes", "no"])
def test_label_words_are_single_tokens(tok, word: str) -> None:
    assert len(tok.encode(word, add_special_tokens=False)) == 1


def test_special_tokens(tok) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    ids = [tok.convert_tokens_to_ids(t) for t in specials]
    assert len(set(ids)) == 5 and all(i >= len(tok) - 5 for i in ids)
    assert tok.encode("".join(specials), add_special_tokens=False) == ids
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok.model_max_length == 4096


def test_chat_template(tok) -> None:
    msgs = [{"role": "user", "content": "X"}]
    head = "<|im_start|>user\nX<|im_end|>\n<|im_start|>assistant\n"
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == head + "<think>\n\n</think>\n\n"
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert on == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == head + "<think>\n"
    full = [{"role": "system", "content": "S"}, *msgs, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(full, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n" + head + "A<|im_end|>\n"
    )


@pytest.mark.parametrize("text", [
    "Does the document mention the price? Yes.",
    "Héllo wörld — 日本語 🎉\ttabs  and\n\nnewlines  ",
    " ¿Sí? Ωμέγα <|im_end|> \u200b\r\n zero\u0000byte \U0010ffff",
])
def test_round_trip(tok, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_cache_dir_builds_once_and_repairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = demo_checkpoint_dir(tmp_path)
    assert first == tmp_path / DEMO_NAME and {p.name for p in first.iterdir()} == FILES
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert demo_checkpoint_dir(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    (first / "tokenizer.json").unlink()
    assert demo_checkpoint_dir(tmp_path) == first
    assert {p.name for p in first.iterdir()} == FILES
    lock = f".{DEMO_NAME}.lock"
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock, DEMO_NAME]  # no temporary directories left behind
    monkeypatch.setenv("KEVSCORE_CACHE", str(tmp_path))
    assert demo_checkpoint_dir() == first
    assert sorted(os.listdir(tmp_path)) == [lock, DEMO_NAME]


def _build_and_read(root: str, barrier) -> tuple[int, int, int]:
    barrier.wait()
    ckpt = demo_checkpoint_dir(Path(root))
    sizes = sum(len((ckpt / name).read_bytes()) for name in sorted(FILES))  # raises if a file vanished
    stat = (ckpt / "model.safetensors").stat()
    return stat.st_ino, stat.st_mtime_ns, sizes  # which build this process read


def test_cache_dir_built_once_by_concurrent_processes(tmp_path: Path) -> None:
    """Parallel test workers ask for the checkpoint at the same moment: one builds it, the others wait and read
    that same directory; none moves a complete one away from under a reader."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            got = pool.starmap(_build_and_read, [(str(tmp_path), barrier)] * 4)
    assert len(set(got)) == 1, got
