"""Prefill planning on the CPU: the host-side indices of a packed group, group budgets, and the entries a
packed group writes against one document at a time."""
from pathlib import Path

import pytest
import torch
from conftest import cpu_engine, synthetic, transformers_states

from kevscore.engine.bank import BankLayout, StateBank
from kevscore.engine.pipeline import Scores
from kevscore.engine.plan import prefill_group_tokens
from kevscore.engine.runner import prefill_inputs, upload_together


def test_prefill_inputs_index_what_fla_and_the_layers_derive(demo):
    """The host-side chunk indices equal FLA's own, and the conv tails, positions and K/V slots are those of
    each document."""
    from fla.ops.utils.index import prepare_chunk_indices

    lens = [1, 5, 64, 65, 130, 3]
    bank = StateBank(demo.config, BankLayout(8, 400), "cpu", torch.float32)
    slots = [bank.alloc(n) for n in lens]
    docs = [list(range(100 + i, 100 + i + n)) for i, n in enumerate(lens)]
    ids, ctx = prefill_inputs(docs, slots, bank, "cpu", 3)
    assert ids.tolist() == [sum(docs, [])]
    assert torch.equal(ctx.chunk_indices, prepare_chunk_indices(ctx.cu_seqlens_long, 64))
    assert ctx.cu_seqlens.tolist() == [0, 1, 6, 70, 135, 265, 268] and ctx.max_len == 130
    assert ctx.positions.tolist() == sum([list(range(n)) for n in lens], [])
    assert ctx.kv_slots.tolist() == sum([list(range(bank.entry_start(s), bank.entry_start(s) + n))
                                         for s, n in zip(slots, lens)], [])
    ends = ctx.cu_seqlens_long[1:]
    for d, n in enumerate(lens):  # the last 3 tokens of each document; fewer for short ones
        want = [int(ends[d]) - 3 + j for j in range(3)]
        assert ctx.tail_valid[d].tolist() == [j >= 3 - n for j in range(3)]
        assert [t for t, ok in zip(ctx.tail_index[d].tolist(), ctx.tail_valid[d].tolist()) if ok] == want[3 - min(n, 3):]



def test_upload_together_gives_each_tensor_back_aligned():
    """One buffer carries every index tensor: each view equals its tensor (dtype, shape, values), empty ones
    included, and starts 16-byte aligned (a misaligned view would make int64 loads fault on a GPU)."""
    tensors = [torch.arange(5), torch.tensor([[True, False, True]]), torch.arange(3, dtype=torch.int32),
               torch.empty(0, 2, dtype=torch.int64), torch.tensor([[7, -1], [2, 9]])]
    out = upload_together(tensors, torch.device("cpu"))
    assert [(t.dtype, t.shape) for t in out] == [(t.dtype, t.shape) for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))
    base = out[0].untyped_storage().data_ptr()
    assert {t.untyped_storage().data_ptr() for t in out} == {base}
    assert all((t.data_ptr() - base) % 16 == 0 for t in out if t.numel())

@pytest.mark.parametrize("free, per_token, expected", [
    (80 << 30, 270_000, 65536),        # an H200 after model and bank: the cap
    (2 << 30, 270_000, 3968),          # little memory: what half of it holds, a multiple of 64
    (100 << 20, 270_000, 2048),        # almost none: the floor (the engine splits on out-of-memory)
])
def test_prefill_group_tokens(free, per_token, expected):
    assert prefill_group_tokens(free, per_token) == expected


def test_group_budget_does_not_change_the_entries(tiny):
    """One document per group, a few per group and all in one group write the same entries (CPU, fp32), up
    to the last bits a GEMM's row blocking moves with the group's size."""
    enc = synthetic([1, 5, 64, 65, 130, 40], [4])
    banks = []
    for budget in (1, 100, 1 << 16):
        engine = cpu_engine(tiny, docs=enc.prefixes)
        engine.prefill_tokens = budget
        engine.prefill_wave(enc, list(range(len(enc.prefixes))), Scores.empty(0).stats)
        bank = engine.runner.bank
        banks.append((bank.state.clone(), bank.conv.clone(), bank.kv.clone()))
    for other in banks[1:]:
        for a, b in zip(banks[0], other):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_groups_pack_sorted_documents_within_the_budget(tiny):
    enc = synthetic([300, 10, 200, 50, 120, 90], [4])
    engine = cpu_engine(tiny, docs=enc.prefixes)
    engine.prefill_tokens = 300
    groups = engine._prefill_groups(enc, list(range(6)))
    assert sorted(d for g in groups for d in g) == list(range(6))
    lengths = [len(enc.prefixes[d]) for g in groups for d in g]
    assert lengths == sorted(lengths)
    assert all(sum(len(enc.prefixes[d]) for d in g) <= 300 or len(g) == 1 for g in groups)
    assert len(groups) == 3  # 10+50+90+120 | 200 | 300


PINS_OFFERED = """
import sys
sys.path.insert(0, {tests!r})
from kevscore.kernels import fla_packages
fla_packages.defer_package_inits()
import fla.utils._device as device
device.get_all_max_shared_mem = lambda: [232448]  # an H200's shared memory per block, as FLA reads it there
import importlib
import fla_oracles
for (module, kernel), wanted in fla_oracles.PINS["H200"].items():
    tuner = fla_oracles.autotuner(getattr(importlib.import_module(module), kernel))
    assert sum(fla_oracles.matches(c, wanted) for c in tuner.configs) >= 1, (kernel, tuner.configs)
print("offered")
"""


def test_pins_name_configurations_fla_offers():
    """Every pinned configuration is one of the kernel's own autotuning configurations (FLA 0.5.2) as FLA lists
    them on the H200 (its lists depend on the GPU's shared memory: a fresh interpreter where FLA reads an H200's),
    so pinning never launches a configuration FLA did not write."""
    import subprocess
    import sys

    script = PINS_OFFERED.format(tests=str(Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "offered" in res.stdout, res.stderr[-3000:]


def test_padded_attention_indices_round_trip(demo):
    """Documents of similar lengths get pad/unpad indices: gathering the packed tokens into [D, L] and back
    gives them unchanged; far-apart lengths get none (attention then runs on the packed tokens)."""
    bank = StateBank(demo.config, BankLayout(8, 2000), "cpu", torch.float32)
    for lens, padded in (([100, 90, 110, 95], True), ([1, 5, 64, 65, 130, 3], False), ([64] * 3, True)):
        bank.reset()
        slots = [bank.alloc(n) for n in lens]
        _, ctx = prefill_inputs([[7] * n for n in lens], slots, bank, "cpu", 3)
        assert (ctx.pad_index is not None) == padded
        if padded:
            tokens = torch.arange(sum(lens))
            assert torch.equal(tokens[ctx.pad_index].flatten()[ctx.unpad_index], tokens)
            assert ctx.pad_index.shape == (len(lens), max(lens))


def test_warm_up_model_runs_a_job_of_the_same_layer_shapes(demo):
    """The warm-up's two-layer model keeps every layer shape of the job's model and runs prefill groups and
    scoring batches of each kind through the runner (here the CPU one, whose ops it shares the plan with)."""
    from kevscore.engine.warmup import compile_kernels, prepare_device, small_model
    from kevscore.model.config import FULL, LINEAR, SHAPES

    cfg = SHAPES["kev-4b"]
    small = small_model(cfg)
    assert small.layer_types == (LINEAR, FULL, FULL) and small.vocab_size == 1024
    assert (small.hidden_size, small.conv_dim, small.head_dim) == (cfg.hidden_size, cfg.conv_dim, cfg.head_dim)
    steps = compile_kernels(demo.config, torch.device("cpu"), "indexed")
    assert steps["real_pass"]["prefill_s"] > 0 and steps["real_pass"]["score_s"] > 0
    assert prepare_device(torch.device("cpu"), demo.config, "indexed") is None  # nothing to warm on a CPU


def test_warm_up_pass_meets_both_prefill_groups_before_its_mark(demo, monkeypatch):
    """The pass calls `after_prefill` (precompile's mark: the job starts once what was met before it compiled) only
    once both prefill groups have run, and scores no row before it."""
    from kevscore.engine.pipeline import Engine
    from kevscore.engine.warmup import PREFILL_GROUPS, shape_pass

    events = []
    prefill_wave, score_rows = Engine.prefill_wave, Engine.score_rows
    monkeypatch.setattr(Engine, "prefill_wave", lambda self, enc, *a, **k: (
        events.append(("prefill", tuple(map(len, enc.prefixes)))), prefill_wave(self, enc, *a, **k))[1])
    monkeypatch.setattr(Engine, "score_rows", lambda self, *a, **k: (
        events.append(("score",)), score_rows(self, *a, **k))[1])
    shape_pass(demo.config, torch.device("cpu"), "indexed", None)(lambda: events.append(("mark",)))
    mark = events.index(("mark",))
    assert events[:mark] == [("prefill", tuple(group)) for group in PREFILL_GROUPS]
    assert ("score",) in events[mark:]


@pytest.mark.parametrize("job_started", [False, True])
def test_what_the_workers_left_compiles_before_the_release_only(demo, monkeypatch, tmp_path, job_started):
    """Kernels the compile processes left are compiled by the warm-up's real pass while the job waits; once the
    job has been released, by its own first launches instead (a pass beside its GPU work would break its graph
    captures), and no finished marker claims them."""
    import contextlib

    from kevscore.engine import warmup
    from kevscore.kernels import precompile

    passes = []
    monkeypatch.setattr(warmup, "finished_marker", lambda *args: tmp_path / "marker")
    monkeypatch.setattr(warmup, "shape_pass", lambda *args: lambda: passes.append("pass") or {})
    monkeypatch.setattr(warmup, "attention_stubbed", lambda device: contextlib.nullcontext())

    def two_of_three(dry_run, before_fork, ready, released):
        if job_started:
            released()
        return precompile.Precompiled(kernels=3, compiled=2, released_s=1.0 if job_started else None)

    monkeypatch.setattr(precompile, "precompile", two_of_three)
    starts = []
    steps = warmup.compile_kernels(demo.config, torch.device("cuda"), "indexed", torch.float32,
                                   release=lambda: starts.append("job"))
    assert starts == (["job"] if job_started else [])
    assert ("real_pass" in steps, passes, (tmp_path / "marker").exists()) == (
        (False, [], False) if job_started else (True, ["pass"], True))


def test_prefill_writes_the_states_transformers_keeps(tiny):
    """Each document's bank entry after a packed prefill (CPU, fp32) holds what transformers' own cache holds
    after the document: recurrent and conv states per DeltaNet layer, K/V per attention layer."""
    enc = synthetic([1, 5, 70], [4])
    engine = cpu_engine(tiny, docs=enc.prefixes)
    slot_of = engine.prefill_wave(enc, [0, 1, 2], Scores.empty(0).stats)
    bank = engine.runner.bank
    for d, doc in enumerate(enc.prefixes):
        states, convs, kvs = transformers_states(tiny, doc)
        slot, start = slot_of[d], bank.entry_start(slot_of[d])
        for layer, (state, conv) in enumerate(zip(states, convs)):
            torch.testing.assert_close(bank.state[layer, slot], state, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(bank.conv[layer, slot], conv, rtol=1e-5, atol=1e-6)
        for layer, kv in enumerate(kvs):
            torch.testing.assert_close(bank.kv[layer, :, start:start + len(doc)], kv, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_prefill_launch_fits_the_h200(monkeypatch, dtype):
    """The fused prefill kernel's default launch: the chunk loop's tiles 2 chunks ahead in bf16 and 1 in fp32
    (whose tiles would not fit twice in the H200's shared memory at Kev-4B's heads), and blocks of 64 value
    columns at least (Triton 3.6 computes 32 wrong in bf16)."""
    from kevscore.kernels import branch_wy

    launches = []
    monkeypatch.setattr(branch_wy, "_chunks_wy_kernel", type("Launcher", (), {
        "__getitem__": lambda self, grid: lambda *args, **kw: launches.append((grid, kw))})())
    n, h, hv, d = 100, 2, 4, 32
    q = torch.zeros(1, n, h, d, dtype=dtype)
    v = torch.zeros(1, n, hv, d, dtype=dtype)
    g, beta, a_inv = torch.zeros(1, n, hv), torch.zeros(1, n, hv, dtype=dtype), torch.zeros(1, n, hv, 64, dtype=dtype)
    bank, slots = torch.zeros(4, hv, d, d), torch.tensor([3, 1])
    o = branch_wy.chunks_wy(q, q, v, g, beta, a_inv, bank, slots, cu_seqlens=torch.tensor([0, 30, 100]))
    (grid, kw), = launches
    stages = 2 if dtype == torch.bfloat16 else 1
    assert kw["num_stages"] == kw["STAGES"] == stages and kw["BV"] == 64 and kw["PACKED"] and grid == (1, 2 * hv)
    assert o.shape == v.shape
    with pytest.raises(AssertionError):
        branch_wy.chunks_wy(q, q, v, g, beta, a_inv, bank, slots[:1], cu_seqlens=torch.tensor([0, 100]), block_v=32)
    with pytest.raises(AssertionError):  # the final states are fp32
        branch_wy.chunks_wy(q, q, v, g, beta, a_inv, bank.half(), slots[:1], cu_seqlens=torch.tensor([0, 100]))


def test_warm_up_marker_names_everything_that_picks_its_kernels(demo, monkeypatch, tmp_path):
    """The warm-up's finished marker lives in Triton's cache and changes with the shapes, the state path, the
    dtype, a KEVSCORE_ switch, a TRITON_ switch that keys Triton's cache and kevscore's sources; the same inputs
    give the same file."""
    import dataclasses
    import os

    from kevscore import measure
    from kevscore.engine.warmup import finished_marker, small_model

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # an attribute set on the knob would outlive the test
    small, gpu = small_model(demo.config), torch.device("cuda")
    first = finished_marker(small, gpu, "indexed", torch.bfloat16)
    assert first.parent == tmp_path and first == finished_marker(small, gpu, "indexed", torch.bfloat16)
    others = {finished_marker(dataclasses.replace(small, hidden_size=small.hidden_size * 2), gpu, "indexed",
                              torch.bfloat16),
              finished_marker(small, gpu, "gathered", torch.bfloat16),
              finished_marker(small, gpu, "indexed", torch.float32)}
    monkeypatch.setenv("KEVSCORE_FUSED_MLP", "0")  # cuBLAS and swiglu_rows for the MLP: other kernels
    others.add(finished_marker(small, gpu, "indexed", torch.bfloat16))
    monkeypatch.delenv("KEVSCORE_FUSED_MLP")
    line_info = os.environ.get("TRITON_DISABLE_LINE_INFO") != "1"
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1" if line_info else "0")  # the kernels' other build
    others.add(finished_marker(small, gpu, "indexed", torch.bfloat16))
    digests = measure.source_digests()
    monkeypatch.setattr(measure, "source_digests", lambda: {**digests, "kevscore/kernels/gate.py": "changed"})
    others.add(finished_marker(small, gpu, "indexed", torch.bfloat16))
    assert len(others) == 6 and first not in others


def test_the_warm_up_stubs_prefill_attention_on_its_own_thread_only():
    """The warm-up's passes skip cuDNN's build at their small shapes: SDPA gives zeros of its output's shape on
    the warm-up's thread, and runs on any other thread and after the block."""
    import threading

    pytest.importorskip("fla")
    from kevscore.engine.warmup import attention_stubbed
    from kevscore.kernels import fla_ops

    q, k = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16)
    real = fla_ops.sdpa_causal(q, k, k)
    other = []
    with attention_stubbed(torch.device("cuda")):
        ours = fla_ops.sdpa_causal(q, k, k)
        thread = threading.Thread(target=lambda: other.append(fla_ops.sdpa_causal(q, k, k)))
        thread.start()
        thread.join()
    assert ours.shape == real.shape and not ours.any() and real.any()
    assert torch.equal(other[0], real)
    assert torch.equal(fla_ops.sdpa_causal(q, k, k), real)
