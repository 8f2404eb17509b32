"""Loading Kev / Qwen3.5 checkpoints: a local directory, a hub id, the built-in demo, or a benchmark shape.

Each with its tokenizer: transformers' on a first load, then the snapshot it left (kevscore.model.tokenizer_snapshot)."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path

import torch

from kevscore.durable import remembered
from kevscore.errors import KevscoreError, first_line
from kevscore.model import tokenizer_snapshot
from kevscore.model.config import SHAPES, KevConfig, weight_shapes

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")  # org/name or org/name@revision
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
MODEL_NAMES = ("demo", *SHAPES)  # --model values that name no directory

TokenizerReady = Callable[[object, KevConfig], None]  # (tokenizer, config), called before the weights load
NOTHING_TO_DO: TokenizerReady = lambda tokenizer, config: None  # noqa: E731
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")  # config.json's model_type in a checkpoint kevscore loads
# AutoTokenizer.from_pretrained as `auto_class` mirrors it: the transformers versions (major, minor) read, the tables
# of models/auto/tokenization_auto.py it consults, the generic classes it sets aside for TokenizersBackend
AUTO_VERSIONS = ((5, 17), (5, 25))
AUTO_TABLES = ("TOKENIZER_MAPPING_NAMES", "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", "MODEL_IDS_TO_TOKENIZERS_BACKEND")
GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast")

MULTIMODAL_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "visual.")
# random weights (benchmark shapes, tests): by name suffix (the first that matches), a uniform draw u in [0, 1) mapped
# into the range such a weight takes
UNIFORM_INITS = (("A_log", lambda u: torch.log(1 + 15 * u)), ("dt_bias", lambda u: 0.5 + u),
                 ("linear_attn.norm.weight", lambda u: 0.9 + 0.2 * u), ("norm.weight", lambda u: 0.2 * u - 0.1),
                 ("conv1d.weight", lambda u: (2 * u - 1) * 0.8))


@dataclass(slots=True)
class Checkpoint:
    name: str
    config: KevConfig
    weights: dict[str, torch.Tensor]  # text-model names: model.embed_tokens.weight, model.layers.N..., lm_head.weight
    tokenizer: object                  # a transformers PreTrainedTokenizerBase, or a LightTokenizer of one
    path: Path | None = None

    @property
    def pad_id(self) -> int:
        """The token that pads a batch's rows: the tokenizer's pad token, else its end of sequence, else 0."""
        return next((int(t) for t in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id) if t is not None), 0)


def load_checkpoint(spec: str, device: str | torch.device = "cpu",
                    tokenizer_ready: TokenizerReady = NOTHING_TO_DO) -> Checkpoint:
    """`demo`, a benchmark shape name (`kev-0.8b`, `kev-4b`), a checkpoint directory or a hub id. The tokenizer loads
    first: `tokenizer_ready(tokenizer, config)` is called before the weights load (a job tokenizes its input
    meanwhile)."""
    if spec in SHAPES:
        tok, cfg = load_tokenizer(model_directory("demo")), SHAPES[spec]
        tokenizer_ready(tok, cfg)
        return Checkpoint(spec, cfg, random_weights(cfg, 0, torch.bfloat16, device), tok)
    directory = model_directory(spec)
    return load_directory(directory, device, tokenizer_ready, None if directory == Path(spec) else spec)


def model_directory(spec: str, download: bool = True) -> Path:
    """The checkpoint directory `spec` names: the demo's (built on first use), a directory, or a hub id's
    snapshot in Hugging Face's cache (`hub_directory`)."""
    from kevscore.model.demo import demo_checkpoint_dir

    if spec == "demo":
        return demo_checkpoint_dir()
    if Path(spec).is_dir():
        return Path(spec)
    if Path(spec).exists() or spec.startswith(("/", "./", "../", "~")) or spec.partition("@")[0].count("/") > 1:
        raise KevscoreError(f"{spec}: {'not a' if Path(spec).exists() else 'no such'} model directory")  # a path
    if HUB_ID.match(spec):
        return hub_directory(spec, download)
    raise KevscoreError(f"--model {spec}: not a checkpoint directory, a hub id (org/name[@revision]) or one of: "
                        f"{', '.join(MODEL_NAMES)}")


def hub_cache() -> Path:
    """Hugging Face's hub cache, as huggingface_hub finds it (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME), read now."""
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.environ.get("HF_HUB_CACHE") or Path(home) / "hub").expanduser()


def hub_directory(spec: str, download: bool = True) -> Path:
    """The snapshot of hub id `org/name[@revision]` in Hugging Face's local cache; fetched into it when it is
    missing, `download` is set and HF_HUB_OFFLINE is not (only the config, tokenizer and weight files)."""
    from huggingface_hub import snapshot_download

    repo, _, revision = spec.partition("@")
    cache = hub_cache()
    offline = not download or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    for local in (True, False):  # the cache, then the hub
        try:
            return Path(snapshot_download(repo, revision=revision or None, cache_dir=cache, local_files_only=local,
                                          allow_patterns=HUB_FILES))
        except Exception as exc:  # noqa: BLE001 - a missing snapshot, network, authentication and not-found errors alike
            if offline or not local:
                fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
                where = f"the Hugging Face cache {cache}" + ("" if local else " and not downloadable")
                raise KevscoreError(f"--model {spec}: not in {where} ({first_line(exc)}); fetch it with `{fetch}` "
                                    "where there is network") from exc


def peek_config(spec: str) -> KevConfig | None:
    """The model config of `spec` without its weights, or None when it cannot be read (the load reports why)."""
    if spec in SHAPES:
        return SHAPES[spec]
    try:
        return KevConfig.from_hf(json.loads((model_directory(spec, download=False) / "config.json").read_text()))
    except (OSError, ValueError, KevscoreError):
        return None


def load_directory(path: Path, device: str | torch.device = "cpu", tokenizer_ready: TokenizerReady = NOTHING_TO_DO,
                   name: str | None = None) -> Checkpoint:
    """A checkpoint directory's config, tokenizer and weights; `name` (default: the path) is what runs report."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise KevscoreError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") not in MODEL_TYPES:
        raise KevscoreError(f"{cfg_file}: model_type {raw.get('model_type')!r} is not qwen3_5 / qwen3_5_text")
    cfg = KevConfig.from_hf(raw)
    tokenizer = load_tokenizer(path)
    tokenizer_ready(tokenizer, cfg)
    return Checkpoint(name or str(path), cfg, normalize_names(read_safetensors(path, device), cfg, path), tokenizer, path)


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. Its first load (per `tokenizer_key`) is transformers' (`transformers_tokenizer`)
    and keeps a snapshot of a fast tokenizer; from then on a `LightTokenizer` of that snapshot answers, which
    encodes with `tokenizers` alone: over the tokenizer just loaded, and in later loads without transformers,
    whose import takes seconds (benchmarks/NOTES.md 21). Without a snapshot: transformers' tokenizer."""
    key = tokenizer_key(path)
    if (light := tokenizer_snapshot.load(path, key, lambda: transformers_tokenizer(path, key))) is not None:
        return light
    tokenizer = transformers_tokenizer(path, key)
    tokenizer_snapshot.save(path, key, tokenizer)
    # a first job encodes as later ones do: transformers' own call runs Python per text (seconds over a job's texts)
    return tokenizer_snapshot.load(path, key, lambda: tokenizer) or tokenizer


def transformers_tokenizer(path: Path, key: str):
    """The checkpoint's tokenizer, of the class transformers' AutoTokenizer picks for it (`auto_class`, where it
    can tell, else AutoTokenizer's own load). The class is remembered under `key`, and later loads import only it:
    AutoTokenizer's import brings in transformers' model and generation code (seconds, on some versions)."""
    import transformers

    def pick() -> str:  # the class AutoTokenizer picks, by its name
        cls = auto_class(path) or type(transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        return f"{cls.__module__}:{cls.__qualname__}"

    try:
        name = remembered("tokenizer-classes.json", key, pick,
                          lambda key: os.path.isdir(key.partition(":")[2].rpartition(":")[0]))
        try:
            cls = pkgutil.resolve_name(name)
        except (ImportError, AttributeError, ValueError):  # remembered wrongly: AutoTokenizer decides again
            cls = transformers.AutoTokenizer
        return cls.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise KevscoreError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc


def auto_class(path: Path) -> type | None:
    """The class AutoTokenizer.from_pretrained picks for directory `path`, decided as it decides but without its
    import, nor that of the model's config class (they bring in transformers' model and generation code: seconds,
    on some versions); None where that is not certain (`auto_class_certain`) or anything is unexpected."""
    import transformers

    try:
        file = path / "tokenizer_config.json"
        settings = json.loads(file.read_text()) if file.is_file() else {}
        # AutoTokenizer asks AutoConfig's config its model_type, tokenizer_class, model_name and _name_or_path: for
        # MODEL_TYPES, config.json's entries and the path (their classes add none; importing them costs seconds)
        config = json.loads((path / "config.json").read_text())
        mapping, misnamed, hub_ids = auto_tables(transformers)
        if not auto_class_certain(transformers.__version__, settings, config, str(path), hub_ids):
            return None
        named, kind = settings.get("tokenizer_class"), config["model_type"]
        registered = (mapping.get(kind) or "").removesuffix("Fast")  # the model type's class
        if named and registered and registered != named.removesuffix("Fast"):
            name = registered if kind in misnamed else named  # the hub's class, unless transformers knows it wrong
            picked = None if registered in GENERIC else (  # tokenizer_class_from_name: the class, or that less "Fast"
                getattr(transformers, name, None) or getattr(transformers, name.removesuffix("Fast"), None))
            cls = transformers.TokenizersBackend if picked is None or picked.__name__ in GENERIC else picked
        elif named:
            name = named.removesuffix("Fast")
            picked = getattr(transformers, name, None) or getattr(transformers, name + "Fast", None)
            cls = transformers.TokenizersBackend if picked is None or picked.__name__ == "PythonBackend" else picked
        else:  # the model type's class (each of MODEL_TYPES has a config class of its own)
            cls = getattr(transformers, mapping[kind])
        return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase) else None
    except Exception:  # noqa: BLE001 - whatever fails here, AutoTokenizer decides
        return None


def auto_class_certain(version: str, settings: dict, config: dict, path: str, hub_ids: list) -> bool:
    """Whether `auto_class` can tell AutoTokenizer's choice: a transformers it was read from (AUTO_VERSIONS), a
    model type kevscore loads, no remote code, no config.json entry that names a tokenizer or a hub id, not a
    Llama class (AutoTokenizer treats those apart), not a path AutoTokenizer takes for a hub id, and a class
    name that is one (or none)."""
    named = settings.get("tokenizer_class")
    return (AUTO_VERSIONS[0] <= tuple(int(n) for n in version.split(".")[:2]) <= AUTO_VERSIONS[1]
            and config.get("model_type") in MODEL_TYPES
            and "auto_map" not in settings
            and not {"auto_map", "tokenizer_class", "model_name", "_name_or_path", "name_or_path"} & config.keys()
            and str(named).removesuffix("Fast") != "LlamaTokenizer"
            and not any(fnmatch(path.lower(), pattern) for pattern in hub_ids)
            and (named is None or str(named).isidentifier()))


def auto_tables(transformers) -> tuple[dict, set, list]:
    """AUTO_TABLES as the installed transformers' tokenization_auto.py defines them, evaluated from its text."""
    from transformers.utils import import_utils

    file = Path(transformers.__file__).parent / "models" / "auto" / "tokenization_auto.py"
    values = {getattr(node.targets[0] if isinstance(node, ast.Assign) else node.target, "id", None): node.value
              for node in ast.parse(file.read_text()).body if isinstance(node, (ast.Assign, ast.AnnAssign))}
    scope = {**vars(import_utils), "OrderedDict": dict}  # the names the tables' text calls
    mapping, misnamed, hub_ids = (eval(compile(ast.Expression(values[n]), file.name, "eval"), scope) for n in AUTO_TABLES)
    return {**dict.fromkeys(misnamed, "TokenizersBackend"), **mapping}, misnamed, hub_ids  # as the file fills them in


def tokenizer_key(path: Path) -> str:
    """What a loaded tokenizer depends on: transformers' and tokenizers' versions, the directory (AutoTokenizer
    matches some hub names) and the contents of the files a tokenizer reads (`tokenizer_files`)."""
    versions = "+".join(metadata.version(package) for package in ("transformers", "tokenizers"))
    digest = hashlib.sha256()
    for file in tokenizer_files(path):
        data = file.read_bytes()
        digest.update(f"{file.relative_to(path)}\0{len(data)}\0".encode() + data)
    return f"{versions}:{path.resolve()}:{digest.hexdigest()}"


def tokenizer_files(path: Path) -> list[Path]:
    """The files of `path` a tokenizer may read: what a hub id's download fetches (HUB_FILES) but the weights,
    and the extra chat templates."""
    files = [p for p in path.iterdir() if p.is_file() and not p.name.endswith(".safetensors")
             and any(fnmatch(p.name, pattern) for pattern in HUB_FILES)]
    return sorted(files + [p for p in path.glob("additional_chat_templates/*") if p.is_file()])


def read_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, memory-mapped and put straight on `device`."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else sorted(p.name for p in path.glob("*.safetensors")))
    if not files:
        raise KevscoreError(f"{path}: no *.safetensors weight files")
    if missing := [name for name in files if not (path / name).is_file()]:
        raise KevscoreError(f"{index}: lists {missing[0]}, which is missing")
    return {key: t for name in files for key, t in load_file(str(path / name), device=str(device)).items()}


def normalize_names(weights: dict[str, torch.Tensor], cfg: KevConfig, path: Path) -> dict[str, torch.Tensor]:
    """Map multimodal (`model.language_model.`) names to text-model names, drop vision/MTP, tie lm_head."""
    out = {"model." + name.removeprefix(MULTIMODAL_PREFIX) if name.startswith(MULTIMODAL_PREFIX) else name: tensor
           for name, tensor in weights.items() if not name.startswith(SKIPPED_PREFIXES)}
    if not cfg.tie_word_embeddings and "lm_head.weight" not in out:
        raise KevscoreError(f"{path}: untied embeddings but no lm_head.weight in the weights")
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in out:  # else reported as missing below
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    if missing := sorted(set(weight_shapes(cfg)) - set(out)):
        raise KevscoreError(f"{path}: weights missing {len(missing)} tensors, e.g. {', '.join(missing[:3])}")
    return out


def random_weights(cfg: KevConfig, seed: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Seeded random weights for benchmark shapes and tests: timing does not depend on their values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():  # a tied lm_head is the embedding, listed before it
        tied = cfg.tie_word_embeddings and name == "lm_head.weight"
        out[name] = out["model.embed_tokens.weight"] if tied else _init(name, shape, gen, device).to(dtype)
    return out


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    rand = lambda: torch.rand(shape, generator=gen, device=device)  # noqa: E731
    if init := next((init for suffix, init in UNIFORM_INITS if name.endswith(suffix)), None):
        return init(rand())
    if name == "model.embed_tokens.weight" or name == "lm_head.weight":
        return torch.randn(shape, generator=gen, device=device) * 0.5
    return (2 * rand() - 1) * (0.75 / shape[-1]) ** 0.5  # std 0.5 / sqrt(fan_in): well-conditioned in fp32
