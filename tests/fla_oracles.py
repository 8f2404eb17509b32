"""flash-linear-attention's own ops, which kevscore's fused kernels replace: the cuda tests' oracles and the
benchmarks' A/B of `kevscore.kernels.fla_ops`.

FLA's norms, SwiGLU, conv and l2 norm, its kkt + solve (`solve_chunks`), its w/u, state scan and output stages
(`wy_repr`, `gdr_branch`,
`gdr_prefill`) and its whole `chunk_gated_delta_rule` (`whole_gdr_prefill`). The functions SWAPS names have the
signatures of the fla_ops functions they replace, so `swapped` can run the GPU model on them (an A/B). Tests
import this module (tests/ is on pytest's path); benchmarks/*.py and tests/interpret/*.py put tests/ on sys.path
first. FLA's modules and its gated delta rule package are imported where they are called (several seconds).

FLA autotunes each kernel per key (head counts and dims, not token counts) the first time it runs; `pin_for`
leaves one configuration in each kernel's own list on the GPUs we measured (PINS), the autotuner's choice at a
prefill's shapes, so the oracles never time configurations (run on importing this module where there is a GPU;
`KEVSCORE_AUTOTUNE=1` keeps FLA's autotuning, to measure new pins with `TRITON_PRINT_AUTOTUNING=1`)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

from kevscore.kernels import fla_ops
from kevscore.kernels.gdr_ref import CHUNK
from kevscore.kernels.torch_ops import split_front

# GPU name (as torch reports it, matched by substring) -> (module, kernel) -> the configuration's constexprs and
# launch options; the state scan keeps 2 stages where the autotuner took 4: an fp32 model's would overflow the
# shared memory
PINS: dict[str, dict[tuple[str, str], dict]] = {
    "H200": {
        ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel"):
            {"BK": 64, "num_warps": 1, "num_stages": 3},
        ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"): {"num_warps": 4, "num_stages": 3},
        ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"):
            {"BV": 64, "num_warps": 4, "num_stages": 2},
        ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"): {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3},
    },
}


def autotuner(kernel):
    """The Triton autotuner wrapping `kernel` (through heuristics and other wrappers), or None."""
    while kernel is not None and not hasattr(kernel, "configs"):
        kernel = getattr(kernel, "fn", None)
    return kernel


def matches(config, wanted: dict) -> bool:
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return all((config.kwargs | launch).get(k) == v for k, v in wanted.items())


def pin_for(device_name: str) -> list[str]:
    """Pin the kernels measured on this GPU; returns their names (none under KEVSCORE_AUTOTUNE=1, on an
    unmeasured GPU, or where FLA's own list no longer has the configuration)."""
    if os.environ.get("KEVSCORE_AUTOTUNE") == "1":
        return []
    pins = next((p for gpu, p in PINS.items() if gpu in device_name), {})
    pinned = []
    for (module, name), wanted in pins.items():
        tuner = autotuner(getattr(importlib.import_module(module), name, None))
        chosen = [c for c in getattr(tuner, "configs", []) if matches(c, wanted)]
        if chosen:
            tuner.configs = chosen[:1]
            pinned.append(name)
    return pinned


if torch.cuda.is_available():
    pin_for(torch.cuda.get_device_name())

# A/B name -> {fla_ops function: this module's function that replaces it}
SWAPS = {
    # branches: FLA's conv and l2 norm on the gathered conv states, then its stages
    "conv": {"branch_front": "branch_front", "gdr_branch": "gdr_branch"},
    "solve": {"solve_chunks": "solve_chunks"},  # FLA's kkt + solve kernel for ours, branches and prefill
    "wy": {"gdr_branch": "gdr_branch"},  # branches: FLA's w/u, state scan and output kernels on the gathered states
    "prefill-stages": {"gdr_prefill": "gdr_prefill"},  # prefill after our packed conv: FLA's w/u, scan and output
    # prefill: FLA's varlen conv and `chunk_gated_delta_rule`, l2 norm included (last: with "prefill-stages"
    # too, this one's whole op takes what its conv leaves)
    "prefill": {"prefill_front": "prefill_front", "gdr_prefill": "whole_gdr_prefill"},
}


@contextlib.contextmanager
def swapped(*names: str) -> Iterator[None]:
    """fla_ops with the functions of the A/Bs `names` (SWAPS) replaced by FLA's own, until the block ends."""
    oracles = {f: oracle for name in sorted(names, key=list(SWAPS).index) for f, oracle in SWAPS[name].items()}
    saved = {f: getattr(fla_ops, f) for f in oracles}
    for f, oracle in oracles.items():
        setattr(fla_ops, f, globals()[oracle])
    try:
        yield
    finally:
        for f, fn in saved.items():
            setattr(fla_ops, f, fn)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float):
    """FLA's kernel: `fla_ops.rms_norm`."""
    from fla.modules.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, scale, None, eps=eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """FLA's `swiglu_fwd` (flat indexing), whose arithmetic `elementwise.swiglu_rows` does in a row-tiled kernel."""
    from fla.modules.activations import swiglu_fwd

    gate, up = gate_up.chunk(2, -1)
    return swiglu_fwd(gate, up, output_contiguous=True)


def conv_branch(x: torch.Tensor, weight: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """FLA's causal conv: x [R, T, C] (may be a strided slice), init [R, C, k-1] -> silu(causal conv) [R, T, C]."""
    from fla.modules.conv.causal_conv1d import causal_conv1d

    state = F.pad(init.to(x.dtype), (1, 0))  # FLA's conv state is [N, C, k]; its first column is unused
    y, _ = causal_conv1d(x, weight, activation="silu", initial_state=state)
    return y


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """FLA's causal conv of packed documents (`cu_seqlens`), each from zeros."""
    from fla.modules.conv.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(x.contiguous(), weight, activation="silu", cu_seqlens=cu_seqlens.long())
    return y


def branch_front(x, weight, bank_conv, slots, hk, dk, hv, dv, b) -> tuple[torch.Tensor, ...]:
    """FLA's conv on the rows' gathered conv states, split, FLA's l2 norm of q and k, torch's sigmoid."""
    from fla.modules.l2norm import l2norm_fwd

    y = conv_branch(x, weight, bank_conv.index_select(0, slots.long()))
    return split_front(y, hk, dk, hv, dv, b, l2norm=lambda t: l2norm_fwd(t.contiguous())[0])


def prefill_front(x, weight, ctx, hk, dk, hv, dv, b) -> tuple[torch.Tensor, ...]:
    """FLA's varlen conv of packed documents, split; q and k as they are, for `whole_gdr_prefill` (FLA's
    whole op l2-normalizes them)."""
    return split_front(conv_prefill(x, weight, ctx.cu_seqlens), hk, dk, hv, dv, b, l2norm=lambda t: t)


def solve_chunks(k: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor, a: torch.Tensor | None = None,
                 cu_seqlens=None, chunk_indices=None) -> torch.Tensor:
    """FLA's kkt + solve kernel with `kevscore.kernels.kkt_solve.solve_chunks`' interface and output (its autotuner's
    choice, or its pin); in fp32 its copy with 3xTF32 merges (`kkt_solve_fp32`)."""
    b, t, h, kd = k.shape
    hv = beta.shape[2]
    a = torch.empty(b, t, hv, CHUNK, device=k.device, dtype=k.dtype) if a is None else a
    grid = (-(-t // CHUNK) if cu_seqlens is None else chunk_indices.shape[0], b * hv)
    args = dict(k=k, g=gc, beta=beta, A=a, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=t, H=h, HV=hv,
                K=kd, BT=CHUNK, BC=16)
    if k.dtype == torch.float32:  # at FLA's H200 pin
        kkt_solve_fp32()[grid](**args, USE_G=True, IS_VARLEN=cu_seqlens is not None, BK=64, num_warps=1, num_stages=3)
    else:
        chunk_gated_delta_rule_fwd_kkt_solve_kernel[grid](**args)
    return a


@functools.cache
def kkt_solve_fp32():
    """FLA's kkt + solve kernel with its block merges' dots in 3xTF32, as an fp32 model's: FLA names TF32 for them
    in a module constant (SOLVE_TRIL_DOT_PRECISION) on GPUs that have it, so this is its function over a copy of
    its module's globals with the constant changed, compiled as a kernel of its own."""
    import triton

    jit, fn = None, chunk_gated_delta_rule_fwd_kkt_solve_kernel
    while hasattr(fn, "fn"):  # through FLA's heuristics, autotuner and jit (or the interpreter's) to its function
        jit, fn = fn, fn.fn
    scope = {**fn.__globals__, "SOLVE_TRIL_DOT_PRECISION": triton.language.constexpr("tf32x3")}
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__annotations__, clone.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__  # its constexprs
    return triton.jit(do_not_specialize=getattr(jit, "do_not_specialize", ["T"]))(clone)


def lower_distance(ours: torch.Tensor, want: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> float:
    """Relative distance of two solves' [R, T, HV, 64] outputs on what they write and `branch_wy` reads: each
    row's entries on and below its own token (its place in its 64-token chunk; chunks start at each document's
    first token)."""
    rows = torch.arange(ours.shape[1], device=ours.device)
    if cu_seqlens is not None:
        rows = rows - cu_seqlens[torch.searchsorted(cu_seqlens, rows, right=True) - 1]
    lower = (torch.arange(CHUNK, device=ours.device)[None, :] <= (rows % CHUNK)[:, None])[None, :, None, :]
    diff = torch.where(lower, ours.float() - want.float(), 0.0)
    return (diff.norm() / torch.where(lower, want.float(), 0.0).norm()).item()


def wy_repr(k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor, cu_seqlens=None,
            chunk_indices=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, u): FLA 0.5.2's `chunk_gated_delta_rule_fwd_intra` for 64-token chunks (of equal-length rows, or
    packed documents: `cu_seqlens`, `chunk_indices`), its two kernels called as it calls them (the solve as
    `solve_chunks` launches it, in fp32 its 3xTF32 copy), the buffer of the solved (I + A)^-1 blocks
    zero-filled as FLA fills it (its kernel writes only the blocks on and below the diagonal)."""
    a = torch.zeros(*k.shape[:2], beta.shape[2], CHUNK, device=k.device, dtype=k.dtype)
    solve_chunks(k, gc, beta, a, cu_seqlens, chunk_indices)
    return recompute_w_u_fwd(k=k, v=v, beta=beta, A=a, g=gc, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def whole_gdr_prefill(q, k, v, gate, beta, ctx, bank: torch.Tensor) -> torch.Tensor:
    """Packed documents from zero states, q and k not l2-normalized (FLA's conv, `prefill_front`): FLA's whole
    `chunk_gated_delta_rule` (its l2 norm, its gate kernel computing the decay), each final state copied into
    its bank entry `bank[ctx.slots[d]]`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    a, A_log, dt_bias = gate
    o, final = chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(),
                                      beta.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                      cu_seqlens=ctx.cu_seqlens_long)
    bank.index_copy_(0, ctx.slots, final)
    return o


def gdr_prefill(q, k, v, gate, beta, ctx, bank: torch.Tensor) -> torch.Tensor:
    """Packed documents from zero states (q and k l2-normalized, as our packed conv leaves them), each final
    state copied into its bank entry `bank[ctx.slots[d]]`: our gate cumsum and FLA's solve, w/u, state scan
    and output kernels."""
    a, A_log, dt_bias = gate
    cu, chunks = ctx.cu_seqlens_long, ctx.chunk_indices
    gc = fla_ops.decay_cumsum(a, A_log, dt_bias, CHUNK, fla_ops.RCP_LN2, cu, chunks)
    w, u = wy_repr(k, v, gc, beta, cu, chunks)  # FLA's chunk_gated_delta_rule_fwd_intra, its launches as they are
    h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, output_final_state=True, chunk_size=CHUNK,
                                                   cu_seqlens=cu, chunk_indices=chunks)
    bank.index_copy_(0, ctx.slots, final)
    return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=k.shape[-1] ** -0.5, cu_seqlens=cu, chunk_size=CHUNK,
                       chunk_indices=chunks)


def gdr_branch(q, k, v, gate, beta, bank: torch.Tensor, slots: torch.Tensor, path: str) -> torch.Tensor:
    """Branch rows (q and k l2-normalized) from their states gathered out of the bank, for either path: our
    gate cumsum, then FLA's stages (solve and w/u, state scan, output)."""
    gc = fla_ops.gate_cumsum(gate)
    w, u = wy_repr(k.contiguous(), v.contiguous(), gc, beta.contiguous())
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gc, initial_state=bank.index_select(0, slots),
                                               chunk_size=CHUNK)
    return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=q.shape[-1] ** -0.5, chunk_size=CHUNK)
