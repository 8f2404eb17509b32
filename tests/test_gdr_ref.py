"""The torch reference of the chunked gated delta rule and of the fused kernel's indexed state read."""
import pytest
import torch
import torch.nn.functional as F

from kevscore.kernels import gdr_ref


def recurrent(q, k, v, g, beta, h0):
    """Token-by-token gated delta rule in float64: S <- S exp(g); S += k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, g, beta, h = (x.double() for x in (q, k, v, g, beta, h0))
    rep = v.shape[2] // q.shape[2]
    q = F.normalize(q, dim=-1).repeat_interleave(rep, 2) * q.shape[-1] ** -0.5
    k = F.normalize(k, dim=-1).repeat_interleave(rep, 2)
    outs = []
    for t in range(q.shape[1]):
        h = h * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("rhkv,rhk->rhv", h, k[:, t]))
        h = h + torch.einsum("rhk,rhv->rhkv", k[:, t], delta)
        outs.append(torch.einsum("rhkv,rhk->rhv", h, q[:, t]))
    return torch.stack(outs, 1), h


def inputs(rows, t, h=2, hv=4, dk=32, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, t, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(rows, t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(rows, t, hv, generator=gen)) * 2
    beta = torch.rand(rows, t, hv, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("t", [1, 17, 64, 65, 130])
def test_chunked_matches_token_recurrence(t):
    q, k, v, g, beta = inputs(3, t, seed=t)
    h0 = torch.randn(3, 4, 32, 16)
    o, final = gdr_ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, final_ref = recurrent(q, k, v, g, beta, h0)
    assert torch.allclose(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    assert torch.allclose(final.double(), final_ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 17, 40, 64])
def test_a_short_sequence_as_one_chunk_of_its_length_matches_the_recurrence(t):
    """The CPU path's chunk_size(t): the same rule without the padding of a 64-token chunk."""
    q, k, v, g, beta = inputs(3, t, seed=t)
    h0 = torch.randn(3, 4, 32, 16)
    assert gdr_ref.chunk_size(t) == t
    o, final = gdr_ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              chunk=gdr_ref.chunk_size(t))
    o_ref, final_ref = recurrent(q, k, v, g, beta, h0)
    assert torch.allclose(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    assert torch.allclose(final.double(), final_ref, atol=2e-5, rtol=1e-5)


def test_strong_decay_stays_finite():
    q, k, v, g, beta = inputs(2, 130)
    o, final = gdr_ref.chunk_gated_delta_rule(q, k, v, g * 200, beta, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()


@pytest.mark.parametrize("t", [1, 17, 64, 129])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_indexed_read_equals_gathered_read(rows, t):
    """`branch_wy` reading row r's state from `bank[index[r * index_stride]]` gives, to the bit, what it gives from
    the rows' states copied out (row r: entry r), so each row starts from its own entry; the bank is never written."""
    q, k, v, g, beta = inputs(rows, t, seed=rows * 1000 + t)
    q, k = gdr_ref.l2norm(q), gdr_ref.l2norm(k)
    gc = gdr_ref.chunk_cumsum(g)
    a_inv = gdr_ref.chunk_inverse(k, gc, beta)
    bank = torch.randn(5, 4, 32, 16)
    snapshot = bank.clone()
    # the indices are one column of an upload buffer [rows, 7], repeated entries included
    upload = torch.randint(0, 100, (rows, 7))
    upload[:, 4] = torch.tensor([(3 * r) % 5 if r % 3 else 2 for r in range(rows)])
    index = upload[:, 4]
    assert index.stride(0) == 7
    out = gdr_ref.branch_wy(q, k, v, gc, beta, a_inv, bank, index, index.stride(0))
    gathered = gdr_ref.branch_wy(q, k, v, gc, beta, a_inv, bank.index_select(0, index), torch.arange(rows))
    assert torch.equal(out, gathered)
    assert torch.equal(bank, snapshot)


def test_bank_rows_reads_through_the_stride():
    flat = torch.arange(30)
    assert gdr_ref.bank_rows(flat[2:], 4, index_stride=7).tolist() == [2, 9, 16, 23]


@pytest.mark.parametrize("t", [1, 17, 64, 85, 128])
def test_stages_after_the_inverse_equal_the_branch_stages(t):
    """branch_wy (w, u from the chunks' inverses, the fused WY kernel's reference) gives the four stages'
    output (torch_ops.gdr_branch, the CPU path's branches)."""
    from kevscore.kernels import torch_ops

    q, k, v, g, beta = inputs(3, t, seed=t)
    a = torch.randn(3, t, 4)
    gate = (a, torch.randn(4) * 0.5, torch.randn(4))
    bank = torch.randn(5, 4, 32, 16) * 0.3
    index = torch.tensor([2, 0, 2])
    q, k = gdr_ref.l2norm(q), gdr_ref.l2norm(k)  # as the fronts leave them
    ref = torch_ops.gdr_branch(q, k, v, gate, beta, bank, index, "indexed")
    gc = gdr_ref.chunk_cumsum(gdr_ref.gate_decay(*gate))
    a_inv = gdr_ref.chunk_inverse(k, gc, beta)
    own = torch.arange(t) % 64  # each row's position in its chunk: the inverse is unit lower triangular
    assert a_inv.shape == (3, t, 4, 64)
    assert (a_inv[:, torch.arange(t), :, own] == 1).all()
    assert not a_inv.masked_fill((torch.arange(64) <= own[:, None])[None, :, None, :], 0).any()
    out = gdr_ref.branch_wy(q, k, v, gc, beta, a_inv, bank, index)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
