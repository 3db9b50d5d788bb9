"""benchmarks/bench_layer.py: kernel classification, the time split, its trace reader, a CPU run."""

import ast
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_layer as B  # noqa: E402

# Names as the H200's profiler reports them (cuBLASLt on Hopper, CUTLASS through cuBLAS, cuDNN's
# flash attention, CUPTI's copies) next to XLA's own kernels.
REAL_NAMES = {
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "gemm",
    "nvjet_qqtst_128x128_128x6_2x1_v_bz_coopB_TNT": "gemm",
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_"
    "execute_segment_k_off_kernel__5x_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_tn_align8>"
    "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_tn_align8::Params)": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, "
    "false, false>(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*)": "gemm",
    "void cublasLt::epilogue::impl::globalKernel<8, 32, float, float, __nv_bfloat16>(int, int)": (
        "gemm"
    ),
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_"
    "kernel0_0": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_"
    "kernel0_0": "attention",
    "MemcpyD2D": "memcpy",
    "MemcpyH2D": "memcpy",
    "Memset": "memcpy",
    "loop_multiply_fusion_3": "other",
    "input_reduce_fusion_12": "other",
    "loop_convert_fusion": "other",
    "wrapped_transpose": "other",
    "copy_fusion_2": "other",
    "triton_softmax_1": "other",
}


@pytest.mark.parametrize("name, category", REAL_NAMES.items())
def test_classify_kernel_on_real_looking_names(name, category):
    assert B.classify_kernel(name) == category


def _pallas_kernel_names(path: Path) -> set[str]:
    """Every kernel name a module gives ``pallas_call``, read from its source.

    The string literals of the ``name=`` argument of each ``pallas_call``, and of the argument
    for ``name`` of the module's functions that hand their ``name`` on to ``pallas_call``
    (directly or through another such function).
    """
    tree = ast.parse(path.read_text())
    calls = lambda node: [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    callee = lambda call: getattr(call.func, "id", None) or getattr(call.func, "attr", None)
    literals = lambda node: {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    forwarders = {"pallas_call": None}  # function -> position of its ``name`` parameter

    def name_argument(call):
        """The expression ``call`` passes for ``name``, if it calls a forwarder."""
        if callee(call) not in forwarders:
            return None
        keyword = [kw.value for kw in call.keywords if kw.arg == "name"]
        position = forwarders[callee(call)]
        if not keyword and position is not None and len(call.args) > position:
            return call.args[position]
        return keyword[0] if keyword else None

    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
    changed = True
    while changed:
        changed = False
        for f in functions:
            params = [a.arg for a in f.args.args]
            if f.name in forwarders or "name" not in params:
                continue
            passed = [name_argument(c) for c in calls(f)]
            if any(isinstance(a, ast.Name) and a.id == "name" for a in passed):
                forwarders[f.name] = params.index("name")
                changed = True
    return {s for c in calls(tree) if (a := name_argument(c)) is not None for s in literals(a)}


@pytest.mark.parametrize(
    "module, category",
    [
        ("fp8_act/pallas_triton.py", "fp8_pallas"),
        ("fp8_quant/pallas_triton.py", "fp8_pallas"),
        ("coat_adam/pallas_triton.py", "optimizer"),
    ],
)
def test_our_pallas_kernels_are_classified_by_their_names(module, category):
    path = REPO / "pallas_kernels" / module
    names = _pallas_kernel_names(path)
    # At least one name per pallas_call site: the reader found them all, not a few.
    assert len(names) >= path.read_text().count("pl.pallas_call("), (module, names)
    assert {n: B.classify_kernel(n) for n in names} == {n: category for n in names}
    # XLA may make a kernel name unique with a suffix.
    assert {B.classify_kernel(f"{n}_1") for n in names} == {category}


def test_kernel_category_precedence():
    hlo = {"fusion.1": "optimizer", "custom-call.2": "optimizer", "fusion.3": "fp8_xla"}
    hlo |= {"loop_convert_fusion_4": "fp8_xla", "fusion.5": None}
    # The optimizer's instruction wins over any name: the optimizer may run any kernel.
    assert B.kernel_category("fp8_quantize_per_group", "custom-call.2", hlo) == "optimizer"
    assert B.kernel_category("loop_add_fusion", "fusion.1", hlo) == "optimizer"
    # A name that says what it is wins over the HLO's other categories.
    assert B.kernel_category("fp8_silu_fwd", "fusion.3", hlo) == "fp8_pallas"
    # Otherwise the HLO decides, by hlo_op, else by the kernel's name read as an instruction.
    assert B.kernel_category("loop_convert_fusion", "fusion.3", hlo) == "fp8_xla"
    assert B.kernel_category("loop_convert_fusion_4", None, hlo) == "fp8_xla"
    assert B.kernel_category("loop_add_fusion", "fusion.5", hlo) == "other"
    assert B.kernel_category("loop_add_fusion", None, {}) == "other"


def _events():
    """Two steps: on one stream a GEMM, an FP8 kernel and an optimizer fusion, with an
    attention kernel overlapping the GEMM on a second stream, and an idle gap in each step."""
    step = [
        ("nvjet_tst_128x256", None, 0.0, 400.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", None, 100.0, 500.0),
        ("fp8_rmsnorm_fwd", "custom-call.1", 600.0, 50.0),
        ("loop_multiply_fusion", "fusion.7", 700.0, 30.0),
        ("MemcpyD2D", None, 730.0, 20.0),
    ]
    period = 1000.0
    return [B.KernelEvent(n, op, s + k * period, d) for k in range(2) for n, op, s, d in step]


def test_time_split_sums_to_the_total():
    events = _events()
    hlo = {"fusion.7": "optimizer", "custom-call.1": "fp8_pallas"}
    split = B.time_split(events, reps=2, hlo_categories=hlo, top=3)
    cats = split["categories"]
    assert set(cats) == set(B.SPLIT_CATEGORIES)
    total_ns = sum(e.duration_ns for e in events)
    assert split["kernel_ms"] == pytest.approx(total_ns / 2 / 1e6)
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(split["kernel_ms"])
    assert sum(c["pct"] for c in cats.values()) == pytest.approx(100.0)
    assert sum(c["kernels"] for c in cats.values()) == split["kernels_per_step"] == len(events) / 2
    by_name = {e.name: e.duration_ns for e in events[:5]}
    expect = {
        "gemm": "nvjet_tst_128x256",
        "attention": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
        "fp8_pallas": "fp8_rmsnorm_fwd",
        "optimizer": "loop_multiply_fusion",
        "memcpy": "MemcpyD2D",
    }
    for category, name in expect.items():
        assert cats[category]["ms"] == pytest.approx(by_name[name] / 1e6)
        assert cats[category]["kernels"] == 1
    assert cats["fp8_xla"]["ms"] == cats["other"]["ms"] == 0
    # Busy: the GEMM and the attention overlap (0..600), then 600..650 and 700..750.
    assert split["busy_ms"] == pytest.approx((600 + 50 + 50) / 1e6)
    assert split["busy_ms"] < split["kernel_ms"]
    top = split["top"]
    assert [t["name"] for t in top] == sorted(by_name, key=by_name.get, reverse=True)[:3]
    assert top[0]["category"] == "attention" and top[0]["kernels"] == 1
    # Which HLO instruction launched each kernel, where the trace says (hlo_op).
    assert top[0]["hlo_ops"] == [None]
    assert [t["hlo_ops"] for t in B.time_split(events, 2, hlo, top=5)["top"]][2:4] == [
        ["custom-call.1"],
        ["fusion.7"],
    ]
    assert split["hlo_matched"] == pytest.approx(2 / 5)


def test_time_split_refuses_to_invent_numbers():
    with pytest.raises(ValueError, match="no kernel events"):
        B.time_split([], reps=3, hlo_categories={})
    with pytest.raises(ValueError, match="reps must be positive"):
        B.time_split(_events(), reps=0, hlo_categories={})


def _xspace(planes: list[tuple[str, list[tuple[str, list[tuple[int, int, int, str | None]]]]]]):
    """A text XSpace: planes of lines of (event metadata id, offset ps, duration ps, hlo_op)."""
    names = {1: "nvjet_tst_128x256", 2: "loop_add_fusion_1", 3: "MemcpyD2D"}
    out = []
    for plane_id, (plane, lines) in enumerate(planes, start=1):
        text = [f'planes {{ id: {plane_id} name: "{plane}"']
        for line_id, (line, events) in enumerate(lines, start=1):
            text.append(f'lines {{ id: {line_id} name: "{line}" timestamp_ns: 1000')
            for meta, offset, duration, hlo_op in events:
                stat = f'stats {{ metadata_id: 1 str_value: "{hlo_op}" }}' if hlo_op else ""
                text.append(
                    f"events {{ metadata_id: {meta} offset_ps: {offset} "
                    f"duration_ps: {duration} {stat} }}"
                )
            text.append("}")
        for key, name in names.items():
            text.append(f'event_metadata {{ key: {key} value {{ id: {key} name: "{name}" }} }}')
        text.append('stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } }')
        out.append("\n".join(text))
    return ProfileData.from_text_proto("\n".join(out))


def test_gpu_kernel_events_reads_the_stream_lines_of_gpu_planes():
    stream = [(1, 0, 4_000_000, "custom-call.3"), (2, 5_000_000, 1_000_000, "fusion.1")]
    profile = _xspace(
        [
            ("/host:CPU", [("python", [(2, 0, 9_000_000, None)])]),
            (
                "/device:GPU:0",
                [
                    ("Stream #7(Compute)", stream),
                    ("Stream #9(MemcpyD2D)", [(3, 7_000_000, 500_000, None)]),
                    ("XLA Ops", [(2, 5_000_000, 1_000_000, None)]),  # derived: a duplicate
                ],
            ),
        ]
    )
    events, info = B.gpu_kernel_events(profile)
    assert info["planes"] == ["/host:CPU", "/device:GPU:0"]
    assert info["lines"] == {
        "/device:GPU:0 Stream #7(Compute)": 2,
        "/device:GPU:0 Stream #9(MemcpyD2D)": 1,
    }
    assert [(e.name, e.hlo_op, e.duration_ns) for e in events] == [
        ("nvjet_tst_128x256", "custom-call.3", 4000.0),
        ("loop_add_fusion_1", "fusion.1", 1000.0),
        ("MemcpyD2D", None, 500.0),
    ]
    assert events[1].start_ns == 1000 + 5000  # line timestamp + offset
    # A plane whose lines are not named by stream: every line but the derived ones.
    events, info = B.gpu_kernel_events(
        _xspace([("/device:GPU:1", [("GPU 1", stream), ("XLA Modules", stream)])])
    )
    assert info["lines"] == {"/device:GPU:1 GPU 1": 2} and len(events) == 2
    events, info = B.gpu_kernel_events(_xspace([("/host:CPU", [("python", stream)])]))
    assert events == [] and info["lines"] == {}


def test_hlo_kernel_categories_on_a_compiled_program():
    """The optimizer's scope and FP8 results as XLA's compiled HLO text shows them."""

    def step(w, g, x):
        codes = (x * 3.0).astype(jnp.float8_e4m3fn)
        y = jnp.tanh(codes.astype(jnp.float32) @ w)
        with jax.named_scope(B.OPTIMIZER_SCOPE):
            w = w - 0.1 * jnp.sign(g) * jnp.sqrt(jnp.abs(g))
        return w, y, codes  # the codes leave the program: some kernel writes them

    w = jnp.ones((64, 64), jnp.float32)
    # As the benchmark's worker compiles (op_name carries the name scope only then).
    full = jax.config.jax_include_full_tracebacks_in_locations
    jax.config.update("jax_include_full_tracebacks_in_locations", True)
    try:
        hlo = jax.jit(step).lower(w, w, w).compile().as_text()
    finally:
        jax.config.update("jax_include_full_tracebacks_in_locations", full)
    categories = B.hlo_kernel_categories(hlo)
    counts = B.hlo_category_counts(hlo)
    assert counts.get("optimizer", 0) >= 1 and counts.get("fp8_xla", 0) >= 1, (counts, hlo)
    kernels = [ins for ins, _ in B._kernels(hlo)]
    assert len(kernels) == B.kernel_counts(hlo)["total"]
    for ins in kernels:
        assert categories[ins.name] == categories[ins.name.replace(".", "_").replace("-", "_")]
        if B.OPTIMIZER_SCOPE in ins.rest:
            assert categories[ins.name] == "optimizer"
    # Without the scope nothing is the optimizer's.
    plain = jax.jit(lambda w, g: w - 0.1 * jnp.sign(g)).lower(w, w).compile().as_text()
    assert "optimizer" not in B.hlo_category_counts(plain)


def _records(split):
    env = {"device": "gpu:test", "jax": jax.__version__, "date": "today", "seq": 64}
    layer = {"kind": "layer", "mode": "coat", "weight_residual": "master", "batch": 2, **env}
    layer |= {"remat": "none", "time": {"median_s": 0.004}, "tflops": 1.0}
    layer |= {"activation_bytes": 10, "activation_U": 1.0, "activation_U_by_dtype": {}}
    layer |= {"compiled_memory": {}, "peak_bytes_in_use": None, "fp8_gemms": 0, "hlo_calls": {}}
    layer |= {"kernels": {"total": 11, "by_opcode": {"fusion": 11}, "fp8_transposes": 0}}
    step = {"kind": "layer_step", "mode": "coat", "weight_residual": "master", "batch": 2, **env}
    step |= {"time": {"median_s": 0.005}, "grad_clip": 1.0, "split": split}
    step |= {"kernels": {"total": 17, "by_opcode": {"fusion": 17}, "fp8_transposes": 0}}
    return [layer, step]


def test_write_docs_shows_a_traced_split():
    split = B.time_split(_events(), reps=2, hlo_categories={"fusion.7": "optimizer"})
    split |= {"program": "layer_step", "reps": 2, "wall_ms": 5.0, "traced": True}
    text = B.write_docs(None, _records(split), "python bench_layer.py")
    row = next(
        line for line in text.splitlines() if line.startswith("| 2 | coat/master | layer_step")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(line for line in text.splitlines() if line.startswith("| batch | mode | program"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(columns)
    at = dict(zip(columns, cells, strict=True))
    assert at["wall (ms)"] == "5.00" and at["kernels traced"] == f"{split['kernels_per_step']:.1f}"
    assert at["gaps (ms)"] == f"{5.0 - split['busy_ms']:.2f}"
    for category, label in B.SPLIT_CATEGORIES.items():
        assert at[label] == B._cell(split["categories"][category])
    for t in split["top"]:
        assert f"{t['category']}: `{t['name']}`" in text
    main = next(line for line in text.splitlines() if line.startswith("| 2 | coat/master | 4.00"))
    assert "| 5.00 |" in main and "| 17 |" in main


@pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the CPU smoke test: it checks the CPU's untraced split"
)
def test_tiny_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The smoke test: both programs per mode, the CPU's 'no GPU kernels', the docs' columns.

    The script's parent runs in this process, with the command line it would have (its workers
    are processes of their own, as always)."""
    out, docs = tmp_path / "layer", tmp_path / "layer.md"
    cmd = [str(REPO / "benchmarks" / "bench_layer.py"), "--tiny"]
    cmd += ["--modes", "bf16,coat", "--reps", "1", "--warmup", "1", "--profile-reps", "1"]
    cmd += ["--out-dir", str(out), "--docs", str(docs), "--no-child-logs"]
    hlo_dir = tmp_path / "hlo"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [*cmd, "--hlo-dir", str(hlo_dir), "--top-kernels", "50"])
    B.main()
    stdout = capsys.readouterr().out
    # Each variant's two compiled programs, as HLO text with the program's entry computation.
    dumps = sorted(p.name for p in hlo_dir.iterdir())
    assert len(dumps) == 4 and all(n.endswith("_b2.hlo.txt") for n in dumps), dumps
    assert {n.split("_")[0] for n in dumps} == {"bf16", "coat"}
    assert all("ENTRY" in (hlo_dir / n).read_text() for n in dumps)
    records = [json.loads(line) for line in (out / "layer.jsonl").read_text().splitlines()]
    layer = {r["mode"]: r for r in records if r["kind"] == "layer"}
    step = {r["mode"]: r for r in records if r["kind"] == "layer_step"}
    assert set(layer) == set(step) == {"bf16", "coat"}
    assert step["coat"]["optimizer"] == "coat_adamw" and step["bf16"]["optimizer"] == "adamw"
    for mode in ("bf16", "coat"):
        # The optimizer adds kernels, and the HLO places some of them in its scope.
        assert step[mode]["kernels"]["total"] > layer[mode]["kernels"]["total"]
        assert step[mode]["hlo_categories"]["optimizer"] > 0
        assert step[mode]["time"]["median_s"] > 0
        split = step[mode]["split"]
        assert split["traced"] is False and "no GPU kernels traced" in split["reason"]
        assert "/host:CPU" in split["planes"] and "categories" not in split
        assert "split" not in layer[mode]
    assert step["coat"]["hlo_categories"].get("fp8_xla", 0) > 0
    assert "fp8_xla" not in step["bf16"]["hlo_categories"]
    text = docs.read_text()
    for column in ("| layer step (ms) |", "| step vs bf16 |", "| step kernels |", "| GEMMs |"):
        assert column in text
    assert text.count("no GPU kernels traced") == 2
    assert "no time split, no GPU kernels traced" in stdout
    # --report-only rewrites the same docs from the records.
    B.main(["--out-dir", str(out), "--docs", str(tmp_path / "again.md"), "--report-only"])
    assert (tmp_path / "again.md").read_text() == text


def test_variant_names_the_fp8_kernels_only_where_set():
    r = {"mode": "coat", "weight_residual": "once"}
    assert B.variant_of(r) == "coat/once"
    assert B.variant_of({**r, "fp8_kernels": "default"}) == "coat/once"
    assert B.variant_of({**r, "fp8_kernels": "xla"}) == "coat/once/xla"
    assert B.variant_of({"mode": "bf16", "fp8_kernels": "default"}) == "bf16"
    # What the option resolved to, where recorded, names the variant.
    resolved = {**r, "fp8_kernels": "default", "fp8_ops_implementation": "xla"}
    assert B.variant_of(resolved) == "coat/once/xla"
    resolved = {**r, "fp8_kernels": "pallas", "fp8_ops_implementation": "pallas"}
    assert B.variant_of(resolved) == "coat/once/pallas"
    with pytest.raises(ValueError, match="--fp8-kernels must be"):
        B.main(["--tiny", "--fp8-kernels", "triton", "--out-dir", "unused"])
    with pytest.raises(ValueError, match="--top-kernels must be >= 1"):
        B.main(["--tiny", "--top-kernels", "0", "--out-dir", "unused"])
