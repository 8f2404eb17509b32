"""Models by hub id (`--model org/name[@revision]`) from Hugging Face's local cache, laid out here in a
temporary directory; offline, a missing model is one line naming the cache and how to fetch it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kevscore.errors import KevscoreError
from kevscore.model.checkpoint import hub_cache, load_checkpoint, peek_config
from kevscore.model.demo import demo_checkpoint_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_CACHE holding `kev-org/kev-demo` at COMMIT (its `main`), a copy of the demo checkpoint."""
    hub = tmp_path / "hub"
    repo = hub / "models--kev-org--kev-demo"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(demo_checkpoint_dir(), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


@pytest.mark.parametrize("spec", ["kev-org/kev-demo", "kev-org/kev-demo@main", f"kev-org/kev-demo@{COMMIT}"])
def test_a_hub_id_loads_the_cached_snapshot(cache, demo, spec):
    ckpt = load_checkpoint(spec)
    assert ckpt.name == spec and ckpt.path.parent.name == "snapshots" and ckpt.path.is_relative_to(cache)
    assert ckpt.config == demo.config
    assert all(torch.equal(ckpt.weights[k], demo.weights[k]) for k in demo.weights)
    assert peek_config(spec) == demo.config


def test_the_cache_follows_huggingface_hubs_variables(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache() == tmp_path / "elsewhere"


def test_a_missing_model_offline_says_where_it_looked_and_how_to_fetch_it(cache):
    with pytest.raises(KevscoreError) as info:
        load_checkpoint("kev-org/other@v2")
    message = str(info.value)
    assert "\n" not in message and str(cache) in message and "hf download kev-org/other --revision v2" in message
    assert peek_config("kev-org/other") is None  # the job's early config read never downloads


def test_a_missing_model_online_is_downloaded_or_reported(cache, monkeypatch):
    """Without HF_HUB_OFFLINE a missing snapshot is fetched (only config, tokenizer and weights); a failed
    fetch (no network here) is one line."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake(repo, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None):
        calls.append((repo, local_files_only, tuple(allow_patterns)))
        raise OSError("cannot reach the hub") if not local_files_only else FileNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(KevscoreError, match="not downloadable .cannot reach the hub.; fetch it with"):
        load_checkpoint("kev-org/other")
    assert [c[:2] for c in calls] == [("kev-org/other", True), ("kev-org/other", False)]
    assert "*.safetensors" in calls[1][2]


def test_not_a_directory_nor_a_hub_id(tmp_path):
    with pytest.raises(KevscoreError, match="not a checkpoint directory, a hub id"):
        load_checkpoint("no-such-name")
    with pytest.raises(KevscoreError, match="/no/such/dir: no such model directory"):
        load_checkpoint(str(tmp_path / "no" / "such" / "dir"))


def test_a_path_that_is_no_directory_is_not_a_hub_id(tmp_path, monkeypatch) -> None:
    """`--model ./nonexist-dir` (or ../x, /x, a/b/c, a file): no model directory, not Hugging Face's cache."""
    from kevscore.model.checkpoint import model_directory

    (tmp_path / "file").write_text("")
    (tmp_path / "in").mkdir()
    monkeypatch.chdir(tmp_path / "in")  # ../x is tmp_path/x: absent whatever the machine holds
    for spec, said in (("./nonexist-dir", "no such"), ("../x", "no such"), (str(tmp_path / "x"), "no such"),
                       ("a/b/c", "no such"), (str(tmp_path / "file"), "not a")):
        with pytest.raises(KevscoreError) as e:
            model_directory(spec, download=False)
        assert str(e.value) == f"{spec}: {said} model directory"
