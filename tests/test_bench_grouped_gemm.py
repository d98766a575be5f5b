"""The grouped-GEMM peer benchmark's pure parts (CPU): FLOP and byte counts, result rows and
their speed-ups, the markdown report, the configuration sweep's list, torchao's call, the
group sizes, the report merge, and the incl.-quantization pass on CPU tensors."""

from __future__ import annotations

import functools
import inspect
import json

import pytest
import torch
from moe_mxfp8.kernels.grouped_gemm.sm90_config import (
    TUNING_FIELDS,
    GroupedGemmSm90Config,
    GroupedGemmSm90Host,
)

from benchmarks import bench_grouped_gemm as B
from benchmarks import gemm_peers as GP

SMALL = GP.GemmShape(e=2, t=256, k=64, n=96)


# ------------------------------------------------------------------------------- counting


def test_flops_per_gemm_and_pass():
    dsv3 = GP.GEMM_SHAPES["dsv3"]
    assert GP.gemm_flops(dsv3) == 2 * 131072 * 4096 * 7168
    assert GP.pass_flops(dsv3, "fwd") == GP.gemm_flops(dsv3)
    assert GP.pass_flops(dsv3, "fwd+bwd") == 3 * GP.gemm_flops(dsv3)


def test_issue_shapes():
    """The shapes the issue names: dsv3 up-projection, mixtral both GEMMs, qwen3 16384 x top-8."""
    assert GP.GEMM_SHAPES["dsv3"] == GP.GemmShape(8, 131072, 7168, 4096)
    assert GP.GEMM_SHAPES["mixtral"] == GP.GemmShape(8, 32768, 4096, 28672)
    assert GP.GEMM_SHAPES["mixtral_down"] == GP.GemmShape(8, 32768, 14336, 4096)
    assert GP.GEMM_SHAPES["qwen3"] == GP.GemmShape(128, 16384 * 8, 2048, 2 * 768)
    # the legacy (E, T, d, f) view: N = 2f
    for name, s in GP.GEMM_SHAPES.items():
        e, t, d, f = B.SHAPES[name]
        assert (e, t, d, 2 * f) == (s.e, s.t, s.k, s.n)


def test_stored_bytes_per_format():
    assert GP.stored_bytes("bf16", 3, 64) == 2 * 3 * 64
    assert GP.stored_bytes("fp8row", 3, 64) == 3 * 64 + 4 * 3
    assert GP.stored_bytes("fp8row", 3, 64, scale_sets=5) == 3 * 64 + 4 * 3 * 5
    assert GP.stored_bytes("mxfp8", 3, 64) == 3 * 64 + 3 * 2
    assert GP.stored_bytes("mxfp8", 3, 65) == 3 * 65 + 3 * 3  # a partial block has a scale
    with pytest.raises(ValueError, match="fmt"):
        GP.stored_bytes("fp4", 3, 64)


def test_kernel_operands_per_op():
    t, k, n, e = SMALL.t, SMALL.k, SMALL.n, SMALL.e
    assert GP.kernel_operands("fprop", SMALL) == ((t, k), (e * n, k), t * n)
    assert GP.kernel_operands("dgrad", SMALL) == ((t, n), (e * k, n), t * k)
    assert GP.kernel_operands("wgrad", SMALL) == ((n, t), (k, t), e * n * k)
    assert GP.kernel_operands("wgrad16", SMALL) == GP.kernel_operands("wgrad", SMALL)
    with pytest.raises(ValueError, match="op"):
        GP.kernel_operands("xgrad", SMALL)


def test_kernel_bytes():
    t, k, n, e = SMALL.t, SMALL.k, SMALL.n, SMALL.e
    assert GP.kernel_bytes("fprop", SMALL, "bf16") == 2 * (t * k + e * n * k + t * n)
    assert GP.kernel_bytes("fprop", SMALL, "mxfp8") == (
        t * k + t * (k // 32) + e * n * k + e * n * (k // 32) + 2 * t * n)
    # fp8 rowwise wgrad: one scale per row per group
    assert GP.kernel_bytes("wgrad16", SMALL, "fp8row") == (
        n * t + 4 * n * e + k * t + 4 * k * e + 2 * e * n * k)


def test_op_bytes():
    t, k, n, e = SMALL.t, SMALL.k, SMALL.n, SMALL.e
    fwd = 2 * (t * k + e * n * k + t * n)
    assert GP.op_bytes(SMALL, "fwd") == fwd
    # backward: read dy, x, w; write dx (t, k) and dw (e, n, k)
    assert GP.op_bytes(SMALL, "fwd+bwd") == fwd + 2 * (t * n + t * k + e * n * k
                                                       + t * k + e * n * k)
    with pytest.raises(ValueError, match="pass"):
        GP.op_bytes(SMALL, "bwd")


# ------------------------------------------------------------------------------- rows


def test_make_row_rates():
    r = GP.make_row("kernel", "s", "fprop", "bf16", 2.0, flops=4e6, nbytes=6000)
    assert r["tflops"] == pytest.approx(4e6 / 2.0 / 1e6)
    assert r["gbps"] == pytest.approx(6000 / 2.0 / 1e3)
    failed = GP.make_row("kernel", "s", "fprop", "bf16", None, 4e6, 6000, error="boom")
    assert "tflops" not in failed and failed["error"] == "boom"


def _rows():
    mk = GP.make_row
    return [
        mk("op", "a", "fwd", "bf16", 100.0, 1e9, 1000),
        mk("op", "a", "fwd", "torchao", 80.0, 1e9, 1000),
        mk("op", "a", "fwd", "mx_1x128", 50.0, 1e9, 1000),
        mk("kernel", "a", "fprop", "bf16", 30.0, 1e9, 1000),
        mk("kernel", "a", "fprop", "mx_1x128", 20.0, 1e9, 1000),
        mk("kernel", "a", "fprop", "mx_1x32", None, 1e9, 1000, error="compile failed"),
    ]


def test_ratios_per_section_and_gemm():
    rows = GP.add_ratios(_rows())
    by = {(r["section"], r["gemm"], r["impl"]): r for r in rows}
    assert by["op", "fwd", "mx_1x128"]["x_bf16"] == pytest.approx(2.0)
    assert by["op", "fwd", "mx_1x128"]["x_torchao"] == pytest.approx(1.6)
    assert by["op", "fwd", "torchao"]["x_bf16"] == pytest.approx(1.25)
    # the kernel section has its own bf16 and no torchao row
    assert by["kernel", "fprop", "mx_1x128"]["x_bf16"] == pytest.approx(1.5)
    assert "x_torchao" not in by["kernel", "fprop", "mx_1x128"]
    assert "x_bf16" not in by["kernel", "fprop", "mx_1x32"]


def test_kernel_rows_from_bench_op_result():
    res = {"op": "wgrad16", "bf16_us": 10.0, "fp8_rowwise_us": 8.0, "fp8_rowwise_fast_us": 7.0,
           "mx_1x128_us": 5.0, "mx_1x128c1_err": "RuntimeError('x')", "sqnr_1x128": 28.5,
           "fp8_sqnr": 27.0, "rel_err_1x128": 1e-3}
    recipe_of = {m: B.MODES[m][0] for m in B.MODES}
    rows = {r["impl"]: r for r in GP.kernel_rows(res, "qwen3", SMALL, recipe_of)}
    assert set(rows) == {"bf16", "fp8row", "torchao", "mx_1x128", "mx_1x128c1"}
    assert rows["mx_1x128"]["sqnr"] == 28.5 and rows["mx_1x128c1"]["sqnr"] == 28.5
    assert rows["torchao"]["sqnr"] == 27.0 and "sqnr" not in rows["bf16"]
    assert rows["mx_1x128c1"]["us"] is None and "RuntimeError" in rows["mx_1x128c1"]["error"]
    assert rows["mx_1x128"]["bytes"] == GP.kernel_bytes("wgrad", SMALL, "mxfp8")
    assert rows["torchao"]["bytes"] == GP.kernel_bytes("wgrad", SMALL, "fp8row")
    assert all(r["gemm"] == "wgrad16" and r["section"] == "kernel" for r in rows.values())


def test_kernel_rows_fp8_failure():
    res = {"op": "fprop", "bf16_us": 10.0, "fp8_err": "ValueError('align')"}
    rows = {r["impl"]: r for r in GP.kernel_rows(res, "s", SMALL, {})}
    assert rows["fp8row"]["us"] is None and "align" in rows["fp8row"]["error"]


# ------------------------------------------------------------------------------- report


CEIL = {"bf16_matmul_TFLOPs": 800.0, "fp8_matmul_TFLOPs": 1600.0, "copy_TBps": 3.0}


def test_markdown_report():
    rows = _rows()
    text = GP.markdown(rows, CEIL, {"gpu": "H100", "torch": "2.11", "date": "2026-11-26"},
                       "balanced")
    assert "H100" in text and "800 TFLOP/s" in text and "1600 TFLOP/s" in text
    lines = text.splitlines()
    # summary: x bf16 per impl, one column per pass and kernel GEMM
    summary = next(ln for ln in lines if ln.startswith("| a | moe_mxfp8 1x128 |"))
    assert summary.split("|")[3].strip() == "2.00"  # fwd incl. quantization
    assert summary.split("|")[5].strip() == "1.50"  # fprop kernel only
    # detail: us, TFLOP/s, GB/s, x bf16, x torchao, % of the fp8 peak
    mx = next(ln for ln in lines if ln.startswith("| fwd, incl. quantization | moe_mxfp8 1x128"))
    cells = [c.strip() for c in mx.split("|")[1:-1]]
    assert cells[2:8] == ["50", f"{1e9 / 50 / 1e6:.0f}", f"{1000 / 50 / 1e3:.0f}", "2.00",
                          "1.60", f"{100 * (1e9 / 50 / 1e6) / 1600:.0f}"]
    bf = next(ln for ln in lines if ln.startswith("| fwd, incl. quantization | bf16"))
    assert bf.split("|")[8].strip() == f"{100 * (1e9 / 100 / 1e6) / 800:.0f}"  # bf16 peak
    assert any("failed: compile failed" in ln for ln in lines)
    # every table line has its header's column count
    for block in text.split("\n\n"):
        tbl = [ln for ln in block.splitlines() if ln.startswith("|")]
        assert len({ln.count("|") for ln in tbl}) <= 1, tbl


def test_markdown_marks_eager_rows_and_missing_ceilings():
    rows = [GP.make_row("op", "a", "fwd", "bf16", 100.0, 1e9, 1000, graphed=False)]
    text = GP.markdown(rows)
    assert "(eager)" in text and "not measured" in text


def test_sweep_table_marks_default_and_best():
    cfg = {"name": "128x256 band 16 cluster 2", "tuning": {}, "default": True}
    other = {"name": "128x128 seq band 1 cluster 1", "tuning": {}, "default": False}
    bad = {"name": "128x128 overlap band 1 cluster 1", "tuning": {}, "default": False}
    wrong = {"name": "128x256 band 1 cluster 1", "tuning": {}, "default": False}
    rows = [GP.sweep_row("qwen3", "wgrad16", SMALL, cfg, us=20.0, bf16_us=15.0, rel_err=1e-3),
            GP.sweep_row("qwen3", "wgrad16", SMALL, other, us=10.0, bf16_us=15.0, rel_err=1e-3),
            GP.sweep_row("qwen3", "wgrad16", SMALL, bad, bf16_us=15.0, error="boom"),
            GP.sweep_row("qwen3", "wgrad16", SMALL, wrong, us=5.0, bf16_us=15.0, rel_err=0.7)]
    lines = GP.sweep_table(rows)
    assert "(default)" in lines[2] and "| 20 |" in lines[2]
    assert "**10**" in lines[3] and "| 2.00 | 1.50 |" in lines[3]  # fastest correct one
    assert "failed: boom" in lines[4]
    assert "WRONG" in lines[5] and "**" not in lines[5] and "WRONG" not in lines[3]
    assert len({ln.count("|") for ln in lines}) == 1


# ------------------------------------------------------------------------------- config sweep


@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad16"])
def test_sweep_tunings_cover_distinct_configs(op):
    s = GP.GEMM_SHAPES["qwen3"]
    prob = GP.kernel_problem(op, s)
    configs = GP.sweep_tunings(op, s)
    assert configs[0]["default"] and sum(c["default"] for c in configs) == 1
    assert GP.effective(GroupedGemmSm90Host.select_config(prob)) == GP.effective(
        GroupedGemmSm90Host.select_config(prob, configs[0]["tuning"]))
    keys = set()
    for c in configs:
        assert set(c["tuning"]) <= set(TUNING_FIELDS)
        cfg = GroupedGemmSm90Host.select_config(prob, c["tuning"])
        assert isinstance(cfg, GroupedGemmSm90Config) and cfg.scale_blocks == "1x128"
        assert c["name"] == GP.config_name(cfg)
        keys.add(GP.effective(cfg))
    assert len(keys) == len(configs)
    # 2 tile widths (128: promotion overlapped or not) x 2 bands x 2 cluster sizes
    assert len(configs) == (2 + 1) * 2 * 2
    assert {GP.effective(GroupedGemmSm90Host.select_config(prob, c["tuning"]))[0]
            for c in configs} == {128, 256}


def test_sweep_problem_per_op():
    s = GP.GEMM_SHAPES["qwen3"]
    assert (GP.kernel_problem("fprop", s).mode, GP.kernel_problem("fprop", s).n,
            GP.kernel_problem("fprop", s).k) == ("m", s.n, s.k)
    assert (GP.kernel_problem("dgrad", s).n, GP.kernel_problem("dgrad", s).k) == (s.k, s.n)
    assert (GP.kernel_problem("wgrad16", s).mode, GP.kernel_problem("wgrad16", s).n,
            GP.kernel_problem("wgrad16", s).k) == ("k", s.n, s.k)


def test_sweep_tunings_small_output_and_odd_tiles():
    # 128 output columns: no 256-column tiles; 3 column tiles of 128 cannot pair into clusters
    narrow = GP.GemmShape(e=2, t=256, k=256, n=128)
    assert all(GP.effective(GroupedGemmSm90Host.select_config(
        GP.kernel_problem("fprop", narrow), c["tuning"]))[0] == 128
        for c in GP.sweep_tunings("fprop", narrow))
    odd = GP.GemmShape(e=2, t=256, k=256, n=384)
    clusters = {GP.effective(GroupedGemmSm90Host.select_config(
        GP.kernel_problem("fprop", odd), c["tuning"]))[1:4]
        for c in GP.sweep_tunings("fprop", odd) if c["tuning"]["tile_n"] == 128}
    assert {c[2] for c in clusters} == {1}  # cluster 2 fell back and was deduplicated


def test_sweep_tunings_bands_and_stages():
    s = GP.GEMM_SHAPES["qwen3"]
    configs = GP.sweep_tunings("wgrad16", s, bands=(1, 8, 16), stages=(0, 3))
    assert len(configs) == 3 * 3 * 2 * 2
    assert any("stages 3" in c["name"] for c in configs)


# ------------------------------------------------------------------------------- torchao call


def test_bind_torchao_turns_padding_off():
    seen = {}

    def op(A, B_t, offs, out_dtype=None, float8_dtype=None,
           pad_token_groups_for_grouped_mm=True):
        seen.update(out_dtype=out_dtype, pad=pad_token_groups_for_grouped_mm)
        return "y"

    assert GP.bind_torchao(op)("x", "w", "o") == "y"
    assert seen == {"out_dtype": torch.bfloat16, "pad": False}


def test_bind_torchao_without_padding_switch():
    def op(A, B_t, offs, out_dtype=None):
        return out_dtype

    bound = GP.bind_torchao(op)
    assert bound("x", "w", "o") is torch.bfloat16
    assert "pad_token_groups_for_grouped_mm" not in bound.keywords


def test_torchao_missing_is_reported(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    op, why = GP.torchao_fp8_rowwise()
    assert op is None and "torchao" in why


# ------------------------------------------------------------------------------- groups, merge


def test_group_sizes_balanced_and_random():
    assert B.group_sizes(8, 131072, align=16, balanced=True) == [16384] * 8
    sizes = B.group_sizes(128, 131072, align=16)
    assert sum(sizes) == 131072 and all(n % 16 == 0 for n in sizes[:-1])
    assert len(set(sizes)) > 1
    # the legacy call is unchanged: random around T/E, any multiple
    assert B.group_sizes(8, 1000) == B.group_sizes(8, 1000, seed=0, align=1, balanced=False)
    assert B.peer_sizes("qwen3", True) == [1024] * 128


def test_merge_and_write_report(tmp_path):
    one = {"device": {"gpu": "H100"}, "ceilings": CEIL, "routing": "balanced",
           "rows": _rows()[:3], "sweep": []}
    two = {"device": {"gpu": "H100"}, "rows": _rows()[3:],
           "sweep": [GP.sweep_row("qwen3", "fprop", SMALL,
                                  {"name": "n", "tuning": {}, "default": True}, us=1.0)]}
    paths = []
    for i, rep in enumerate((one, two)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(rep))
    merged = B.merge([str(p) for p in paths])
    assert len(merged["rows"]) == 6 and len(merged["sweep"]) == 1
    assert merged["ceilings"] == CEIL and merged["routing"] == "balanced"
    md = tmp_path / "r.md"
    text = B.write_report(merged, str(tmp_path / "r.json"), str(md))
    assert md.read_text().strip() == text.strip()
    assert "Hopper kernel configurations" in text
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["impl"] == "bf16"


# ------------------------------------------------------------------------------- incl. quantization


def _fake_timer(fn, use_graph=True, **_):
    if use_graph:
        raise RuntimeError("capture unsupported")
    fn()
    return 42.0


def test_bench_passes_rows_on_cpu():
    """The incl.-quantization pass on CPU tensors: SQNR against bf16 (a perturbed peer is
    finite, an exact one infinite), the eager fallback, failing impls as error rows."""
    s = GP.GemmShape(e=2, t=64, k=32, n=48)

    def perturbed(x, w_t, offs):
        return torch._grouped_mm(x, w_t, offs=offs) * 1.01

    def broken(x, w_t, offs):
        raise RuntimeError("no kernel")

    impls = {"bf16": lambda x, w_t, offs: torch._grouped_mm(x, w_t, offs=offs),
             "torchao": perturbed, "mx_1x128": broken}
    rows = list(GP.bench_passes("tiny", s, [32, 32], impls, _fake_timer, dev="cpu"))
    by = {(r["gemm"], r["impl"]): r for r in rows}
    assert set(by) == {(p, i) for p in GP.OP_PASSES for i in impls}
    assert 35 < by["fwd", "torchao"]["sqnr"] < 45  # 1 % error: 40 dB
    assert by["fwd+bwd", "mx_1x128"]["us"] is None
    assert "no kernel" in by["fwd+bwd", "mx_1x128"]["error"]
    assert by["fwd", "bf16"]["us"] == 42.0 and by["fwd", "bf16"]["graphed"] is False
    assert by["fwd+bwd", "bf16"]["flops"] == 3 * GP.gemm_flops(s)
    assert by["fwd+bwd", "bf16"]["bytes"] == GP.op_bytes(s, "fwd+bwd")


def test_run_pass_gradients_match_autograd():
    s = GP.GemmShape(e=2, t=64, k=32, n=48)
    x, w, dy = GP._inputs(s, 0, "cpu")
    offs = torch.tensor([16, 64], dtype=torch.int32)
    fn = functools.partial(torch._grouped_mm)
    y, dx, dw = GP.run_pass(lambda x, w_t, o: fn(x, w_t, offs=o), "fwd+bwd", x, w, dy, offs)
    xf, wf = x.detach().float(), w.detach().float()
    ref_y = torch.cat([xf[:16] @ wf[0].t(), xf[16:] @ wf[1].t()])
    assert torch.allclose(y.float(), ref_y, rtol=2e-2, atol=2e-2)
    ref_dw = torch.stack([dy[:16].float().t() @ xf[:16], dy[16:].float().t() @ xf[16:]])
    assert dw.shape == w.shape and torch.allclose(dw.float(), ref_dw, rtol=2e-2, atol=5e-2)
    assert dx.shape == x.shape
    assert len(GP.run_pass(lambda x, w_t, o: fn(x, w_t, offs=o), "fwd", x, w, dy, offs)) == 1


def test_peer_defaults_leave_legacy_options():
    """--peers defaults are separate; the legacy run's defaults are what they were."""
    assert B.LEGACY_SHAPES == "dsv3,qwen3,mixtral"
    assert B.DEFAULT_MODES == "1x32,32x32,1x128,1x128o"
    assert B.PEER_OPS == "fprop,dgrad,wgrad16" and B.PEER_MODES == "1x128"
    assert "fast_accum" in inspect.signature(B.bench_op).parameters


@pytest.mark.filterwarnings("ignore:moe_mxfp8. tensors on cpu")
def test_op_impls_mxfp8_on_the_reference_backend():
    """`op_impls`' moe_mxfp8 entry is the public op with its recipe (here on the CPU reference
    backend): forward and both gradients at MXFP8's SQNR against bf16, none exact."""
    s = GP.GemmShape(e=2, t=256, k=128, n=128)
    impls = GP.op_impls(["1x128"], None)
    assert set(impls) == {"bf16", "mx_1x128"}
    rows = list(GP.bench_passes("tiny", s, [128, 128], impls, _fake_timer, dev="cpu"))
    mx = [r for r in rows if r["impl"] == "mx_1x128"]
    assert len(mx) == 2 and all(25 < r["sqnr"] < 40 for r in mx), mx


@pytest.mark.gpu
def test_peers_time_and_match_bf16_on_gpu():
    """On the device: every op-level peer (torchao where importable) runs under CUDA-graph
    replays and agrees with bf16 to MXFP8 / FP8 precision, at a small shape."""
    from benchmarks.timing import bench_us

    s = GP.GemmShape(e=4, t=1024, k=256, n=512)
    torchao_op, _ = GP.torchao_fp8_rowwise()
    impls = GP.op_impls(["1x128"], torchao_op)
    timer = functools.partial(bench_us, warmup=2, reps=2, rounds=1)
    rows = list(GP.bench_passes("small", s, [256] * 4, impls, timer))
    assert len(rows) == 2 * len(impls)
    for r in rows:
        assert r["us"] and r["graphed"], r
        if r["impl"] != "bf16":
            assert 20 < r["sqnr"] < 45, r
