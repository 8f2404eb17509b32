"""The checkpoint's tokenizer: the class AutoTokenizer picks (told without AutoTokenizer where `auto_class` can),
remembered so that later loads skip it, and the snapshot of a fast tokenizer that later loads encode with, without
transformers."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from kevscore import durable
from kevscore.model import checkpoint as checkpoint_module
from kevscore.model import tokenizer_snapshot
from kevscore.model.checkpoint import MODEL_TYPES, auto_class, load_tokenizer, tokenizer_key
from kevscore.model.demo import TRAINED_DIR, demo_checkpoint_dir
from kevscore.model.prompt import chat_template, load_template, tokenize, tokenize_labels
from kevscore.model.tokenizer_snapshot import LightTokenizer

TEXTS = ["Document: the grid failed at noon.", "Ünïcode — and <|im_end|> inside", " leading space", ""]
MORE_TEXTS = [*TEXTS, "<|im_start|>user\nHi<|im_end|>\n", "  two  spaces\tand a tab\n", "ﬁ ligature, 𝔘 and 🙂",
              "a <sep> b<sep>c", "<|endoftext|>", " " + "the long document goes on. " * 400]


@pytest.fixture(scope="module")
def demo() -> Path:
    return demo_checkpoint_dir()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch, demo: Path) -> Path:
    monkeypatch.setenv("KEVSCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(durable, "_REMEMBERED", {})
    return tmp_path / "cache" / "tokenizer-classes.json"


def tokenizer_dir(path: Path, demo: Path, tokenizer_class: str | None, model_type: str = "qwen3_5_text",
                  config: dict | None = None) -> Path:
    """The demo's tokenizer files, naming `tokenizer_class` (None: naming none), beside the demo's config with
    `model_type` and `config`'s entries."""
    path.mkdir(parents=True)
    shutil.copy(demo / "tokenizer.json", path / "tokenizer.json")
    settings = {k: v for k, v in json.loads((demo / "tokenizer_config.json").read_text()).items() if k != "tokenizer_class"}
    named = {} if tokenizer_class is None else {"tokenizer_class": tokenizer_class}
    (path / "tokenizer_config.json").write_text(json.dumps({**settings, **named}))
    demo_config = json.loads((demo / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**demo_config, "model_type": model_type, **(config or {})}))
    return path


def count_auto_loads(monkeypatch) -> list[str]:
    """The paths AutoTokenizer loads, as kevscore finds it now (a test before may have reloaded transformers)."""
    auto_tokenizer = sys.modules["transformers"].AutoTokenizer
    calls, auto = [], auto_tokenizer.from_pretrained

    def counted(path, *args, **kwargs):
        calls.append(path)
        return auto(path, *args, **kwargs)

    monkeypatch.setattr(auto_tokenizer, "from_pretrained", counted)
    return calls


def count_picks(monkeypatch) -> list[type | None]:
    """What `auto_class` answered, call by call (None: AutoTokenizer decides)."""
    picked, auto = [], checkpoint_module.auto_class
    monkeypatch.setattr(checkpoint_module, "auto_class", lambda path: picked.append(auto(path)) or picked[-1])
    return picked


def built_dir(path: Path, demo: Path) -> Path:
    """A tokenizer unlike the demo's, made with `tokenizers`: NFKC, Metaspace, a BPE with an unknown token, an added
    token that strips spaces, a post-processor adding <s> and </s>, and truncation to 5 tokens and padding to 16 in
    tokenizer.json (transformers' calls without truncation or padding ignore them); split_special_tokens set."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizers.NFKC(), pre_tokenizers.Metaspace(), decoders.Metaspace()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator((TRAINED_DIR / "corpus.txt").read_text().splitlines(),
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    tok.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.enable_truncation(max_length=5)
    tok.enable_padding(length=16, pad_id=3, pad_token="<pad>")
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "split_special_tokens": True, "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(demo / "config.json", path / "config.json")
    return path


@pytest.fixture(params=["demo", "built"])
def checkpoint(request, tmp_path: Path, demo: Path) -> Path:
    """A directory of the demo's tokenizer files, or of `built_dir`'s."""
    if request.param == "demo":
        return tokenizer_dir(tmp_path / "demo", demo, "PreTrainedTokenizerFast")
    return built_dir(tmp_path / "built", demo)


def light(path: Path) -> LightTokenizer:
    """The tokenizer of a later load (a first load kept the snapshot)."""
    load_tokenizer(path)
    tok = load_tokenizer(path)
    assert isinstance(tok, LightTokenizer)
    return tok


def real(tok):
    """transformers' tokenizer: `tok`, or the one under a first load's light tokenizer."""
    return tok.transformers_tokenizer() if isinstance(tok, LightTokenizer) else tok


def snapshot_key(path: Path) -> str:
    """The tokenizer key the snapshot of `path` was kept under."""
    return json.loads(tokenizer_snapshot.snapshot_file(path).read_bytes().split(b"\n")[1])["key"]


def answers(tok) -> dict:
    """What kevscore asks of a tokenizer, as prompt.py and checkpoint.py ask it."""
    return {"batch": tokenize(tok, MORE_TEXTS), "one": [tok(t, add_special_tokens=False)["input_ids"] for t in MORE_TEXTS],
            "encode": tokenize_labels(tok, MORE_TEXTS), "template": load_template(None, tok),
            "chat": chat_template(tok), "has_chat": bool(getattr(tok, "chat_template", None)),
            "ids": (tok.pad_token_id, tok.eos_token_id, tok.split_special_tokens)}


def ids(tokenizer) -> list[list[int]]:
    return tokenizer(TEXTS, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("named", ["PreTrainedTokenizerFast", "Qwen2Tokenizer", "LlamaTokenizerFast"])
def test_the_class_autotokenizer_picks_is_remembered(tmp_path: Path, demo: Path, cache: Path, monkeypatch,
                                                      named: str) -> None:
    """The class `auto_class` tells, or AutoTokenizer where it cannot (a Llama class), is remembered."""
    path = tokenizer_dir(tmp_path / "ckpt", demo, named)
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    calls, picks = count_auto_loads(monkeypatch), count_picks(monkeypatch)
    first = load_tokenizer(path)
    asked = [str(path)] if named.startswith("Llama") else []
    assert type(real(first)) is type(auto) and calls == asked and (picks == [None]) == bool(asked)
    assert json.loads(cache.read_text()) == {
        tokenizer_key(path): f"{type(auto).__module__}:{type(auto).__qualname__}"}
    monkeypatch.setattr(durable, "_REMEMBERED", {})  # a later process: the class from the cache file
    tokenizer_snapshot.snapshot_file(path).unlink(missing_ok=True)  # and no snapshot
    again = load_tokenizer(path)
    assert calls == asked and len(picks) == 1, "the class was decided again"
    assert type(real(again)) is type(auto)
    assert ids(again) == ids(auto) == ids(first)
    assert again.chat_template == auto.chat_template and again.eos_token_id == auto.eos_token_id
    monkeypatch.setattr(durable, "_REMEMBERED", {})
    load_tokenizer(path)
    if isinstance(later := load_tokenizer(path), LightTokenizer):  # its light tokenizer falls back to the class too
        later = later.transformers_tokenizer()
    assert type(later) is type(auto) and calls == asked and len(picks) == 1


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("named", ["PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast", None,
                                   "NoSuchTokenizer"])
def test_a_first_load_tells_autotokenizers_class_without_it(tmp_path: Path, demo: Path, cache: Path, monkeypatch,
                                                             named: str | None, model_type: str) -> None:
    """The demo's tokenizer files naming a class (None: naming none; an unknown name, which AutoTokenizer answers
    with its fallback): `auto_class` tells AutoTokenizer's class, whose tokenizer answers as AutoTokenizer's."""
    path = tokenizer_dir(tmp_path / "ckpt", demo, named, model_type)
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    calls = count_auto_loads(monkeypatch)
    first = load_tokenizer(path)
    assert calls == [], f"AutoTokenizer was asked: does auto_class mirror transformers {transformers.__version__}?"
    assert type(real(first)) is type(auto) and answers(first) == answers(auto)


ODD = ["a Llama class", "a class named in config.json", "another model type", "not a class name", "an empty class name",
       "an auto_map", "a hub id's path", "an older transformers", "a newer transformers"]


@pytest.mark.parametrize("odd", ODD)
def test_where_auto_class_cannot_tell_autotokenizer_decides(tmp_path: Path, demo: Path, cache: Path, monkeypatch,
                                                            odd: str) -> None:
    monkeypatch.chdir(tmp_path)
    named = {"a Llama class": "LlamaTokenizerFast", "not a class name": "not a name", "an empty class name": "",
             "a hub id's path": "Qwen2Tokenizer", "a class named in config.json": None}.get(odd, "PreTrainedTokenizerFast")
    path = tokenizer_dir(Path("google/umt5-small" if odd == "a hub id's path" else "ckpt"), demo, named,
                         "qwen3" if odd == "another model type" else "qwen3_5_text",
                         {"tokenizer_class": "Qwen2Tokenizer"} if odd == "a class named in config.json" else None)
    if odd == "an auto_map":  # remote code for another auto class: AutoTokenizer ignores it, auto_class leaves it
        settings = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**settings, "auto_map": {"AutoModel": "m.Model"}}))
    if odd.endswith("transformers"):  # on the module imported now: a test before may have reloaded transformers
        (major, oldest), (_, newest) = checkpoint_module.AUTO_VERSIONS  # one major version
        version = f"{major}.{oldest - 1}.0" if odd == "an older transformers" else f"{major}.{newest + 1}.0"
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    calls = count_auto_loads(monkeypatch)
    assert auto_class(path) is None
    first = load_tokenizer(path)
    assert calls == [str(path)] and type(real(first)) is type(auto) and answers(first) == answers(auto)


def test_changed_tokenizer_files_decide_the_class_again(tmp_path: Path, demo: Path, cache: Path, monkeypatch) -> None:
    path = tokenizer_dir(tmp_path / "ckpt", demo, "PreTrainedTokenizerFast")
    picks = count_picks(monkeypatch)
    load_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    tok = load_tokenizer(path)
    assert len(picks) == 2 and type(real(tok)).__name__ == "Qwen2Tokenizer"
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.parametrize("stored", ["not json", json.dumps(["a list"]), "{KEY: 'no.such.module:Tokenizer'}",
                                    "{KEY: 'transformers:NoSuchTokenizer'}"])
def test_a_bad_cache_decides_the_class_again(tmp_path: Path, demo: Path, cache: Path, monkeypatch, stored: str) -> None:
    """An unreadable cache: the class is told again; a remembered class that is gone: AutoTokenizer loads."""
    path = tokenizer_dir(tmp_path / "ckpt", demo, "PreTrainedTokenizerFast")
    if stored.startswith("{KEY"):
        stored = json.dumps({tokenizer_key(path): stored.split("'")[1]})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(stored)
    calls, picks = count_auto_loads(monkeypatch), count_picks(monkeypatch)
    tok = load_tokenizer(path)
    assert (calls, len(picks)) == (([str(path)], 0) if stored.startswith("{") else ([], 1))
    assert ids(tok) == ids(transformers.AutoTokenizer.from_pretrained(str(path)))


def test_the_snapshot_answers_as_transformers(checkpoint: Path, cache: Path) -> None:
    auto = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    tok = light(checkpoint)
    assert answers(tok) == answers(auto)
    assert tok._real is None, "a call fell back to transformers"
    assert (tokenize(tok, ["<|im_end|>"]) == [[1260]]) == (checkpoint.name == "demo")  # split only by the built one
    assert max(map(len, tokenize(tok, MORE_TEXTS))) > 16 and 3 not in tokenize(tok, ["x"])[0]  # no truncation, padding


def fresh_load(path: Path, real: bool = False) -> tuple[str, list[list[int]], list[str]]:
    """`load_tokenizer(path)` in a new process: the tokenizer's class name (real: of transformers' tokenizer under
    a light one), the ids of MORE_TEXTS' prompts and the transformers modules it imported."""
    code = ("import json, sys; from pathlib import Path; from kevscore.model.checkpoint import load_tokenizer; "
            "from kevscore.model.prompt import load_template, tokenize; "
            f"tok = load_tokenizer(Path({str(path)!r})); t = load_template(None, tok); "
            f"ids = tokenize(tok, [t.prefix(d) for d in {MORE_TEXTS!r}]); "
            "imported = [m for m in sys.modules if m.split('.')[0] == 'transformers']; "
            f"tok = tok.transformers_tokenizer() if {real} and hasattr(tok, 'transformers_tokenizer') else tok; "
            "print(json.dumps([type(tok).__name__, ids, imported]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout))


def prompt_ids(path: Path) -> list[list[int]]:
    """AutoTokenizer's ids of MORE_TEXTS' prompts."""
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return tokenize(auto, [load_template(None, auto).prefix(d) for d in MORE_TEXTS])


def test_a_warm_load_imports_no_transformers(checkpoint: Path, cache: Path) -> None:
    load_tokenizer(checkpoint)
    name, ids, imported = fresh_load(checkpoint)
    assert (name, imported) == ("LightTokenizer", [])
    assert ids == prompt_ids(checkpoint)


@pytest.mark.parametrize("named", ["the demo", "Qwen2Tokenizer", None])
def test_a_first_load_imports_no_autotokenizer(tmp_path: Path, demo: Path, cache: Path, named: str | None) -> None:
    """A first load (no snapshot, no remembered class) in a new process: AutoTokenizer's class and ids, and
    none of transformers' auto classes' model code (their import takes seconds, on some versions)."""
    path = demo if named == "the demo" else tokenizer_dir(tmp_path / "ckpt", demo, named, "qwen3_5")
    name, ids, imported = fresh_load(path, real=True)
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert name == type(auto).__name__ and ids == prompt_ids(path)
    assert "transformers.models.auto.auto_factory" not in imported
    assert tokenizer_snapshot.snapshot_file(path).is_file(), "not a first load"


def test_a_changed_tokenizer_json_changes_the_key_and_the_ids(tmp_path: Path, demo: Path, cache: Path) -> None:
    from tokenizers import Tokenizer

    path = tokenizer_dir(tmp_path / "ckpt", demo, "PreTrainedTokenizerFast")
    key, before = tokenizer_key(path), tokenize(light(path), TEXTS)
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    backend.add_tokens(["grid failed"])
    backend.save(str(path / "tokenizer.json"))
    assert tokenizer_key(path) != key
    first = load_tokenizer(path)
    assert snapshot_key(path) == tokenizer_key(path), "the old snapshot answered for new files"
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert tokenize(first, TEXTS) == tokenize(light(path), TEXTS) == tokenize(auto, TEXTS) != before


@pytest.mark.parametrize("damage", ["truncated", "a value changed", "empty", "not a snapshot", "another format"])
def test_a_corrupt_snapshot_loads_through_transformers(checkpoint: Path, cache: Path, damage: str,
                                                       monkeypatch) -> None:
    load_tokenizer(checkpoint)
    file = tokenizer_snapshot.snapshot_file(checkpoint)
    data = file.read_bytes()
    digest, _, body = data.partition(b"\n")
    meta, _, pipeline = body.partition(b"\n")
    meta = json.loads(meta)
    other = json.dumps({**meta, "format": -1}).encode() + b"\n" + pipeline
    changed = json.dumps({**meta, "eos_token_id": meta["eos_token_id"] + 1}).encode() + b"\n" + pipeline
    file.write_bytes({"truncated": data[: len(data) // 2], "a value changed": digest + b"\n" + changed,
                      "empty": b"", "not a snapshot": b"{}\n",
                      "another format": hashlib.sha256(other).hexdigest().encode() + b"\n" + other}[damage])
    loads, load = [], checkpoint_module.transformers_tokenizer
    monkeypatch.setattr(checkpoint_module, "transformers_tokenizer", lambda *a: loads.append(a) or load(*a))
    tok = load_tokenizer(checkpoint)
    assert len(loads) == 1, "the corrupt snapshot answered"
    auto = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    assert answers(tok) == answers(auto)
    assert file.read_bytes() == data, "the load did not keep a new snapshot"


def test_other_calls_fall_back_to_transformers(checkpoint: Path, cache: Path) -> None:
    auto = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    tok = light(checkpoint)
    assert tok(TEXTS[0]) == auto(TEXTS[0])  # special tokens added, attention mask: transformers' answer
    assert isinstance(tok._real, type(auto))
    tok = light(checkpoint)
    ids = tokenize(tok, MORE_TEXTS)
    assert tok._real is None
    assert [tok.decode(i) for i in ids] == [auto.decode(i) for i in ids]
    assert isinstance(tok._real, type(auto)) and len(tok) == len(auto)
    tok.split_special_tokens = not auto.split_special_tokens  # set on transformers' tokenizer, which answers now
    assert tok.split_special_tokens is tok._real.split_special_tokens is not auto.split_special_tokens
    assert tokenize(tok, ["<|im_end|>"]) != tokenize(auto, ["<|im_end|>"])
    tok.chat_template = "X{{ messages[0]['content'] }}"
    assert chat_template(tok).head == "X"


@pytest.mark.parametrize("unlike", ["its own encode path", "a custom pre-tokenizer"])
def test_no_snapshot_of_a_tokenizer_unlike_transformers_fast_ones(tmp_path: Path, demo: Path, cache: Path,
                                                                   unlike: str) -> None:
    from tokenizers.pre_tokenizers import PreTokenizer

    class Whole:  # a pre-tokenizer in Python: tokenizers cannot serialize it
        def pre_tokenize(self, pretok) -> None:
            pretok.split(lambda i, s: [s])

    path = tokenizer_dir(tmp_path / "ckpt", demo, "PreTrainedTokenizerFast")
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if unlike == "its own encode path":
        tok.__class__ = type("OwnEncode", (type(tok),), {"_encode_plus": lambda self, *a, **k: None})
    else:
        tok.backend_tokenizer.pre_tokenizer = PreTokenizer.custom(Whole())
    tokenizer_snapshot.save(path, tokenizer_key(path), tok)
    assert not tokenizer_snapshot.snapshot_file(path).exists()


def test_a_snapshot_that_cannot_be_written_costs_only_the_next_load(checkpoint: Path, cache: Path,
                                                                    monkeypatch) -> None:
    """A full disk while the snapshot is written: the load still returns transformers' tokenizer, nothing is
    left half-written, and the next load (through transformers again) writes the snapshot then."""
    from kevscore.model import tokenizer_snapshot

    write = durable.write_atomic

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable, "write_atomic", full)
    tokenizer = load_tokenizer(checkpoint)
    assert not isinstance(tokenizer, tokenizer_snapshot.LightTokenizer)
    assert tokenizer(["a test"], add_special_tokens=False)["input_ids"]
    assert not list(tokenizer_snapshot.snapshot_file(checkpoint).parent.glob("*"))
    monkeypatch.setattr(durable, "write_atomic", write)
    loads, load = [], checkpoint_module.transformers_tokenizer
    monkeypatch.setattr(checkpoint_module, "transformers_tokenizer", lambda *a: loads.append(a) or load(*a))
    load_tokenizer(checkpoint)
    assert len(loads) == 1 and tokenizer_snapshot.snapshot_file(checkpoint).is_file()
    assert isinstance(load_tokenizer(checkpoint), tokenizer_snapshot.LightTokenizer) and len(loads) == 1
