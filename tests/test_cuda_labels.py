"""GPU tests (marked `cuda`) of labels of several tokens: graph buckets of several scored positions per row
against eager, both paths to the bit, the bf16 path against transformers in fp32, rows of one-token labels
unchanged by rows of several, and the command line."""
import math

import pytest
import torch
from conftest import gpu_engine, labelled, sequence_reference, synthetic

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
PATHS = ("indexed", "gathered")

CASES = {
    "shared": dict(doc_lens=[40, 90, 130], branch_lens=[5, 9, 17, 30, 40, 64], max_rows=64),
    "padded": dict(doc_lens=[64] * 13, branch_lens=[11], max_rows=16),
    "long-branch": dict(doc_lens=[100, 300], branch_lens=[256, 400, 510], max_rows=8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_graph_replay_equals_eager(tiny, case):
    spec = dict(CASES[case])
    max_rows = spec.pop("max_rows")
    enc = labelled(synthetic(**spec))
    results = {}
    for eager in (True, False):
        engine = gpu_engine(tiny, enc.prefixes, eager=eager, max_rows=max_rows, max_tokens=1 << 16)
        results[eager] = {p: engine.run(enc, p) for p in PATHS}
        if not eager:
            scored = {key[2] for key in engine.runner.graphs}  # (rows, length, scored, path)
            assert 1 in scored and max(scored) > 1, scored  # buckets of one and of several positions per row
    for path in PATHS:  # cuBLAS may pick other GEMM kernels under capture: last-bit rounding
        for a, b in zip(results[True][path].probs, results[False][path].probs):
            assert a == pytest.approx(b, abs=1e-4)
        for a, b in zip(results[True][path].label_mass, results[False][path].label_mass):
            assert a == pytest.approx(b, rel=1e-3)
    for eager in (True, False):  # within a mode, the two paths agree to the bit
        assert results[eager]["indexed"].probs == results[eager]["gathered"].probs
        assert results[eager]["indexed"].label_mass == results[eager]["gathered"].label_mass


def test_bf16_close_to_fp32_reference(tiny):
    """Summed log-probabilities in bf16 are as close to transformers in fp32 as transformers' own bf16: the
    probabilities, and the label mass in log space (masses of random weights are small)."""
    from kevscore.reference import reference_model

    enc = labelled(synthetic([1, 63, 64, 65, 300], [1, 17, 64, 65, 130]))
    fused = gpu_engine(tiny, enc.prefixes, max_rows=8).run(enc, "indexed")
    ref32 = sequence_reference(reference_model(tiny), enc)
    ref16 = sequence_reference(reference_model(tiny, device=DEV, dtype=torch.bfloat16), enc)
    dp = lambda a, b: max(abs(x - y) for x, y in zip(a, b))  # noqa: E731
    ours = max(dp(p32, p) for (p32, _), p in zip(ref32, fused.probs))
    theirs = max(dp(p32, p16) for (p32, _), (p16, _) in zip(ref32, ref16))
    ours_mass = max(abs(math.log(m / m32)) for (_, m32), m in zip(ref32, fused.label_mass))
    theirs_mass = max(abs(math.log(m16 / m32)) for (_, m32), (_, m16) in zip(ref32, ref16))
    print(f"max |p - p_fp32|: kevscore {ours:.4g}, transformers bf16 {theirs:.4g}; max |log(mass / mass_fp32)|: "
          f"kevscore {ours_mass:.4g}, transformers bf16 {theirs_mass:.4g}")
    assert ours <= 2 * theirs + 0.01
    assert ours_mass <= 2 * theirs_mass + 0.05


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_rows_of_one_token_labels_keep_their_bits_beside_rows_of_several(tiny, eager):
    """Rows whose labels are one token each are batched among themselves, in the buckets (and graphs) of a job
    without the others."""
    from kevscore.model.prompt import Encoded

    enc = labelled(synthetic([40, 90, 130], [5, 17, 40, 64]))
    one = [r for r in range(len(enc)) if enc.one_token_labels(r)]
    alone = Encoded(enc.prefixes, [enc.row_prefix[r] for r in one], [enc.branches[r] for r in one],
                    [enc.labels[r] for r in one], [enc.label_ids[r] for r in one])
    mixed = gpu_engine(tiny, enc.prefixes, eager=eager, max_rows=4).run(enc, "indexed")
    single = gpu_engine(tiny, enc.prefixes, eager=eager, max_rows=4).run(alone, "indexed")
    assert [mixed.probs[r] for r in one] == single.probs
    assert [mixed.label_mass[r] for r in one] == single.label_mass


def test_cli_labels_of_several_tokens_on_cuda(tmp_path, example_rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from kevscore.cli import app

    labels = [[["Yes", "No"], ["Yes", "No", "maybe"], ["No way", "Yes"]][i % 3] for i in range(len(example_rows))]
    src = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist(example_rows).append_column("labels", pa.array(labels)), src)
    out = {}
    for device, path in (("cuda", "indexed"), ("cuda", "gathered"), ("cpu", "indexed")):
        result = CliRunner().invoke(app, ["run", str(src), "--device", device, "--state-read", path,
                                          "-o", str(tmp_path / f"{device}-{path}.parquet")])
        assert result.exit_code == 0, result.output
        out[device, path] = pq.read_table(tmp_path / f"{device}-{path}.parquet").column("probs").to_pylist()
    assert out["cuda", "indexed"] == out["cuda", "gathered"]
    for gpu, cpu in zip(out["cuda", "indexed"], out["cpu", "indexed"]):
        assert abs(sum(gpu) - 1) < 1e-9
        assert gpu == pytest.approx(cpu, abs=0.1)  # bf16 against fp32 (the demo model: one row near 0.2)
