"""The checkpoint's tokenizer: the class AutoTokenizer picks, remembered so that later loads skip it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from kevscore import durable
from kevscore.model.checkpoint import load_tokenizer, tokenizer_key
from kevscore.model.demo import demo_checkpoint_dir

TEXTS = ["Document: the grid failed at noon.", "Ünïcode — and <|im_end|> inside", " leading space", ""]


@pytest.fixture(scope="module")
def demo() -> Path:
    return demo_checkpoint_dir()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch, demo: Path) -> Path:
    monkeypatch.setenv("KEVSCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(durable, "_REMEMBERED", {})
    return tmp_path / "cache" / "tokenizer-classes.json"


def tokenizer_dir(path: Path, demo: Path, tokenizer_class: str) -> Path:
    """The demo's tokenizer files, naming `tokenizer_class`, beside a qwen3_5 config."""
    path.mkdir(parents=True)
    shutil.copy(demo / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((demo / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    shutil.copy(demo / "config.json", path / "config.json")
    return path


def count_auto_loads(monkeypatch) -> list[str]:
    calls, auto = [], transformers.AutoTokenizer.from_pretrained

    def counted(path, *args, **kwargs):
        calls.append(path)
        return auto(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return calls


def ids(tokenizer) -> list[list[int]]:
    return tokenizer(TEXTS, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("named", ["PreTrainedTokenizerFast", "Qwen2Tokenizer"])
def test_the_class_autotokenizer_picks_is_remembered(tmp_path: Path, demo: Path, cache: Path, monkeypatch,
                                                      named: str) -> None:
    path = tokenizer_dir(tmp_path / "ckpt", demo, named)
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    calls = count_auto_loads(monkeypatch)
    first = load_tokenizer(path)
    assert type(first) is type(auto) and calls == [str(path)]
    assert json.loads(cache.read_text()) == {
        tokenizer_key(path, transformers.__version__): f"{type(auto).__module__}:{type(auto).__qualname__}"}
    monkeypatch.setattr(durable, "_REMEMBERED", {})  # a later process: the class from the cache file
    again = load_tokenizer(path)
    assert calls == [str(path)], "AutoTokenizer was asked again"
    assert type(again) is type(auto)
    assert ids(again) == ids(auto) == ids(first)
    assert again.chat_template == auto.chat_template and again.eos_token_id == auto.eos_token_id


def test_changed_tokenizer_files_ask_autotokenizer_again(tmp_path: Path, demo: Path, cache: Path, monkeypatch) -> None:
    path = tokenizer_dir(tmp_path / "ckpt", demo, "PreTrainedTokenizerFast")
    calls = count_auto_loads(monkeypatch)
    load_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    tok = load_tokenizer(path)
    assert len(calls) == 2 and type(tok).__name__ == "Qwen2Tokenizer"
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.parametrize("stored", ["not json", json.dumps(["a list"]), "{KEY: 'no.such.module:Tokenizer'}",
                                    "{KEY: 'transformers:NoSuchTokenizer'}"])
def test_a_bad_cache_falls_back_to_autotokenizer(tmp_path: Path, demo: Path, cache: Path, monkeypatch,
                                                 stored: str) -> None:
    path = tokenizer_dir(tmp_path / "ckpt", demo, "PreTrainedTokenizerFast")
    if stored.startswith("{KEY"):
        stored = json.dumps({tokenizer_key(path, transformers.__version__): stored.split("'")[1]})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(stored)
    calls = count_auto_loads(monkeypatch)
    tok = load_tokenizer(path)
    assert calls == [str(path)]
    assert ids(tok) == ids(transformers.AutoTokenizer.from_pretrained(str(path)))
