"""The fused Triton kernel against the torch path, and the engines' dispatcher.

Without a CUDA device the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
set by conftest.py before the kernel module is imported), on tiny shapes only: the
interpreter executes each program in numpy, about a second per case here. Float32
results agree with the torch path to 2e-6 relative (both round scores in float32, in
different orders, and with different maths libraries: numpy's in the interpreter,
libdevice and the GPU's approximate exp and division on CUDA); float64 to 1e-12. Where the
two paths share no arithmetic nothing is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from equivariance_probe.errors import InputError  # noqa: E402
from equivariance_probe.statistics import engines  # noqa: E402
from equivariance_probe.statistics.engines import triton as fused  # noqa: E402
from equivariance_probe.statistics.engines.spec import ReductionSpec  # noqa: E402
from equivariance_probe.statistics.engines.torch_blocks import attention_sums_from_qk  # noqa: E402
from equivariance_probe.statistics.masks import visible_key_counts  # noqa: E402

import attention_reference as reference  # noqa: E402

needs_triton = pytest.mark.skipif(not fused.triton_available(), reason="triton is not importable")
runnable = pytest.mark.skipif(
    not (torch.cuda.is_available() or fused._interpreting()),
    reason="no CUDA device and TRITON_INTERPRET is not set",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Relative size of one float32 ulp (the spacing just above 1, the widest relative spacing).
FLOAT32_ULP = torch.finfo(torch.float32).eps


def make_qk(n_positions, dtype, seed=0, batch=2, heads=4, kv_heads=2, dim=16):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, n_positions, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, n_positions, dim, generator=generator, dtype=torch.float64)
    return query.to(dtype).to(DEVICE), key.to(dtype).to(DEVICE)


def assert_same_sums(out, ref, dtype):
    tolerance = {"rtol": 1e-12, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 1e-10}
    assert set(out) == set(ref)
    for name in ref:
        if name == "floored":
            continue
        assert out[name].dtype == torch.float64 and out[name].shape == ref[name].shape, name
        torch.testing.assert_close(out[name], ref[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")


CASES = [
    # (T, window, softcap, excluded keys, key bins, dtype)
    (16, None, None, (), "per_key", torch.float32),
    (37, None, None, (), "width5", torch.float32),
    (37, 7, None, (0, 5), "width16", torch.float32),
    (37, None, 3.0, (0,), "width5", torch.float32),
    (37, 20, 3.0, (), "per_key", torch.bfloat16),
    (37, 9, None, (2,), "width5", torch.float64),
]


@needs_triton
@runnable
@pytest.mark.parametrize("n_positions, window, softcap, excluded, bins, dtype", CASES)
def test_kernel_matches_torch_path(n_positions, window, softcap, excluded, bins, dtype):
    query, key = make_qk(n_positions, dtype)
    # Bins of width 16 line up with the 16-key tiles (one bin per tile: the column-sum
    # branch); widths 1 and 5 straddle tiles (the per-entry branch).
    width = {"per_key": 1, "width5": 5, "width16": 16}[bins]
    options = dict(
        softcap=softcap, window=window, lengths=torch.tensor([n_positions, n_positions - 9]),
        excluded_keys=excluded, log_floor=1e-2, key_bin=torch.arange(n_positions, device=DEVICE) // width,
    )
    ref = attention_sums_from_qk(query, key, **options)
    out = fused.attention_sums_triton(query, key, block_size=16, **options)
    assert_same_sums(out, ref, dtype)
    # Floored counts: identical unless a weight sits on the floor to rounding.
    log_pattern = reference.float64_log_pattern(query.cpu(), key.cpu(), softcap=softcap, window=window)
    near = reference.sums_from_log_pattern(
        log_pattern, window=window, lengths=options["lengths"], excluded_keys=excluded, log_floor=1e-2,
        key_bin=options["key_bin"].cpu(), n_key_bins=int(options["key_bin"].max()) + 1,
    )["near_floor"]
    assert bool(((out["floored"].cpu() - ref["floored"].cpu()).abs() <= near).all())
    assert ref["floored"].sum() > 0


@needs_triton
@runnable
@pytest.mark.parametrize(
    "dtype, n_positions, window",
    # T = 40 without a window has rows of 37 keys: numpy's float32 log(37) (the interpreter's) is
    # 3.610918 and torch's 3.6109178 on the machine this was written on (log(7) differs on others).
    [(torch.float32, 37, 11), (torch.float32, 40, None), (torch.float64, 37, 11)],
)
def test_kernel_keeps_identical_rows_exact(dtype, n_positions, window):
    """Uniform attention (all-zero queries): the kernel's Σa² = count·mean² bit for bit; the torch path to an ulp."""
    query, key = make_qk(n_positions, dtype, seed=1)
    query = torch.zeros_like(query)
    lengths = torch.tensor([n_positions, 20])
    out = fused.attention_sums_triton(query, key, window=window, lengths=lengths, excluded_keys=[0, 3], block_size=16)
    ref = attention_sums_from_qk(query, key, window=window, lengths=lengths, excluded_keys=[0, 3])
    count = visible_key_counts(n_positions, window, [0, 3], DEVICE).expand(2, -1).clone()
    count[torch.arange(n_positions, device=DEVICE).view(1, -1) >= lengths.to(DEVICE).view(-1, 1)] = 0
    count = count.unsqueeze(1)
    for total_name, square_name in (("raw_sum", "raw_sq"), ("log_sum", "log_sq")):
        mean = out[total_name] / count.clamp_min(1)
        if dtype == torch.float64:
            # n·c of a float64 c rounds, so mean = (n·c)/n only to rounding.
            torch.testing.assert_close(out[square_name], count * mean * mean, rtol=1e-15, atol=0)
            torch.testing.assert_close(out[total_name], ref[total_name], rtol=1e-15, atol=0)
        else:
            # The kernel's own arithmetic: n·c and (n·c)·c of one float32 c are exact in float64.
            assert torch.equal(out[square_name], count * mean * mean), square_name
            # Across paths c = exp(0)/l and max(-log l, log eps) come from different maths libraries
            # (numpy in the interpreter, libdevice on a GPU, torch's own on the torch path), whose
            # float32 exp, log and division may differ by an ulp: n·c to 1 float32 ulp, (n·c)·c to 2.
            torch.testing.assert_close(out[total_name], ref[total_name], rtol=FLOAT32_ULP, atol=0)
            torch.testing.assert_close(out[square_name], ref[square_name], rtol=2 * FLOAT32_ULP, atol=0)


#: Awkward shapes: (T, H, H_kv, head_dim, window, softcap, dtype, key-bin width). T = 1 and
#: T = 130 (nine 16-row tiles, the last holding 2 rows); grouped-query 8/2 and 4/1; windows
#: 1 and 5; soft caps 5 and 30; head_dim 80 and 96 (padded to 128 in the tiles); bins of one
#: key, of widths 3, 5 and 40 (edges inside tiles; at T = 10 the one tile runs past the last
#: key) and 16 (one bin per tile).
AWKWARD = [
    (1, 4, 1, 16, None, None, torch.float32, 1),
    (23, 8, 2, 16, 5, None, torch.bfloat16, 1),
    (70, 4, 1, 80, None, 30.0, torch.float16, 5),
    (130, 2, 1, 96, 1, None, torch.float32, 16),
    (70, 8, 2, 32, None, 5.0, torch.bfloat16, 16),
    (23, 4, 1, 16, 5, 5.0, torch.float64, 5),
    (130, 2, 1, 16, None, 30.0, torch.float16, 40),
    (130, 2, 2, 16, 5, None, torch.bfloat16, 1),
    (10, 2, 1, 16, None, None, torch.float32, 3),
]


@needs_triton
@runnable
@pytest.mark.parametrize("n_positions, heads, kv_heads, dim, window, softcap, dtype, width", AWKWARD)
def test_kernel_matches_a_float64_softmax_on_awkward_shapes(n_positions, heads, kv_heads, dim, window, softcap, dtype, width):
    """Every sum against a float64 softmax of the same (model-dtype) queries and keys.

    bf16 and fp16 scores come from ``tl.dot`` of the half-precision tiles with float32
    accumulation (in the interpreter bf16 tiles are upcast first; fp16 tiles are not), float32
    from IEEE float32 products. The products of half-precision inputs are exact in float32, so
    against float64 every non-float64 path carries the same error: each score rounded in
    float32, and the weights ``exp(s - m)/l`` and log weights ``(s - m) - log l`` in float32,
    an absolute error of a few float32 ulps of the scores' size (here up to ~20) per entry.
    Summed in float64 that came to at most 5e-6 relative (``log_sq`` of a soft-capped fp16
    case); the bound is 2e-5. Float64 inputs stay float64: 1e-12.
    """
    generator = torch.Generator().manual_seed(n_positions + dim)
    query = torch.randn(2, heads, n_positions, dim, generator=generator, dtype=torch.float64) * 1.5
    key = torch.randn(2, kv_heads, n_positions, dim, generator=generator, dtype=torch.float64) * 1.5
    query, key = query.to(dtype), key.to(dtype)
    lengths = torch.tensor([n_positions, max(n_positions - 9, 1)])
    key_bin = torch.arange(n_positions) // width
    excluded = (0,) if n_positions > 1 else ()
    options = dict(softcap=softcap, window=window, lengths=lengths, excluded_keys=excluded, log_floor=1e-3)
    # Head dims above 64 run with the default tile (32 rows; 128 padded dims); the others with 16.
    out = fused.attention_sums_triton(
        query.to(DEVICE), key.to(DEVICE), key_bin=key_bin.to(DEVICE), block_size=None if dim > 64 else 16, **options
    )
    log_pattern = reference.float64_log_pattern(query, key, softcap=softcap, window=window)
    ref = reference.sums_from_log_pattern(
        log_pattern, key_bin=key_bin, n_key_bins=int(key_bin.max()) + 1, **{k: v for k, v in options.items() if k != "softcap"}
    )
    tolerance = {"rtol": 1e-12, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 1e-9}
    for name in ("raw_sum", "raw_sq", "log_sum", "log_sq", "lag_sum", "key_lag_sum"):
        torch.testing.assert_close(out[name].cpu(), ref[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")
    # Floored counts: exact but for entries within rounding of the floor.
    assert bool(((out["floored"].cpu() - ref["floored"]).abs() <= ref["near_floor"]).all())


@needs_triton
@runnable
def test_kernel_with_kept_pattern_and_single_key_head():
    query, key = make_qk(20, torch.float32, seed=2, kv_heads=1)
    options = dict(window=6, lengths=torch.tensor([20, 13]), excluded_keys=[1], keep_pattern=True)
    out = fused.attention_sums_triton(query, key, **options)
    ref = attention_sums_from_qk(query, key, **options)
    assert_same_sums(out, ref, torch.float32)


@needs_triton
@runnable
def test_tanh_in_the_kernel_is_accurate():
    """The kernel's exp-based tanh against float64 tanh, near 0, at the switch and far out."""
    import triton
    import triton.language as tl

    @triton.jit
    def tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, fused._tanh64(x), mask=offs < n)

    x = torch.cat(
        [
            torch.tensor([0.0, 1e-300, -1e-8, 1e-4, 0.2999999, 0.3, -0.3000001, 0.7, 3.0, -20.0, 400.0]),
            torch.linspace(-2, 2, 53, dtype=torch.float64),
        ]
    ).to(torch.float64).to(DEVICE)
    out = torch.empty_like(x)
    tanh_kernel[(1,)](x, out, x.numel(), BLOCK=64)
    torch.testing.assert_close(out, torch.tanh(x), rtol=2e-15, atol=0)


def test_dispatcher_picks_the_torch_path_without_cuda():
    query, key = make_qk(12, torch.float32, seed=3)
    if query.is_cuda:
        pytest.skip("this test is about the CPU path")
    sums, path = engines.reduce_scores(query, key, ReductionSpec(window=4))
    assert path == "torch"
    ref = attention_sums_from_qk(query, key, window=4)
    for name in ref:
        assert torch.equal(sums[name], ref[name])


@needs_triton
@runnable
def test_dispatcher_runs_triton_when_asked():
    query, key = make_qk(16, torch.float32, seed=4)
    sums, path = engines.reduce_scores(query, key, ReductionSpec(block_size=16), engine="triton")
    assert path == "triton"
    assert_same_sums(sums, attention_sums_from_qk(query, key), torch.float32)
    with pytest.raises(ValueError, match="engine"):
        engines.reduce_scores(query, key, ReductionSpec(), engine="cuda")


def test_triton_wrapper_explains_what_is_missing(monkeypatch):
    query, key = make_qk(8, torch.float32)
    monkeypatch.setattr(fused, "triton", None)
    monkeypatch.setattr(fused, "_TRITON_IMPORT_ERROR", ImportError("No module named 'triton'"))
    with pytest.raises(InputError, match="needs Triton"):
        fused.attention_sums_triton(query, key)
    if not query.is_cuda:
        _, path = engines.reduce_scores(query, key, ReductionSpec())
        assert path == "torch"


@needs_triton
def test_triton_wrapper_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query, key = make_qk(8, torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        fused.attention_sums_triton(query.cpu(), key.cpu())


def test_pinned_triton_lower_bound_is_the_one_the_kernel_checks(monkeypatch):
    """pyproject's ``triton>=`` bound is MIN_TRITON_VERSION, below which the module refuses Triton by name."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    pins = [
        Requirement(line)
        for group in project["project"]["optional-dependencies"].values()
        for line in group
        if Requirement(line).name == "triton"
    ]
    assert pins, "pyproject.toml names no triton requirement"
    needed = ".".join(map(str, fused.MIN_TRITON_VERSION))
    for pin in pins:
        lower = [spec for spec in pin.specifier if spec.operator == ">="]
        assert [Version(spec.version) for spec in lower] == [Version(needed)], str(pin)
    # One minor version below the bound is refused with the version needed; the bound itself is not.
    major, minor = fused.MIN_TRITON_VERSION
    older = f"{major}.{minor - 1}.0"
    assert f">= {needed}" in fused._triton_version_problem(older)
    assert fused._triton_version_problem(f"{needed}.0") is None
    assert fused._triton_version_problem(f"{major}.{minor + 6}.0+git1234") is None
    if fused.triton_available():
        import triton
        import triton.language as tl

        # The feature the bound is for, on the installed Triton; and an older one is refused at import.
        assert hasattr(tl, "gather")
        monkeypatch.setattr(triton, "__version__", older)
        module, language, error = fused._import_triton()
        assert module is None and language is None
        assert f"Triton {older} is installed" in str(error) and f"triton>={needed}" in str(error)


#: Compiles the kernel for an H100 (sm_90) in a fresh process outside the interpreter (which
#: the test session runs in): Triton lowers it through its CUDA backend and ptxas to a cubin
#: without a GPU. Prints, per input dtype, whether a cubin came out and the PTX's tensor-core
#: instructions (``mma``/``wgmma``).
_COMPILE_FOR_H100 = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from equivariance_probe.statistics.engines import triton as fused

kernel = fused._attention_sums_kernel
names = list(kernel.arg_names)
element = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32, "fp64": tl.float64}
report = {}
for name, dot in element.items():
    signature = {}
    for arg in names:
        if arg in ("q_ptr", "k_ptr"):
            signature[arg] = "*" + name
        elif arg in ("lengths_ptr", "key_bin_ptr"):
            signature[arg] = "*i64"
        elif arg == "keep_ptr":
            signature[arg] = "*i8"
        elif arg.endswith("_ptr"):
            signature[arg] = "*fp64"
        elif arg.isupper():
            signature[arg] = "constexpr"
        else:
            signature[arg] = "i32"
    constants = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK=fused.DEFAULT_TILE, DTYPE=tl.float64 if name == "fp64" else tl.float32,
                     DOT_DTYPE=dot, HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_EXCLUDED=True)
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": fused.WARPS})
    ptx = compiled.asm["ptx"]
    report[name] = {"cubin": len(compiled.asm.get("cubin", b"")) > 0, "mma": ptx.count("mma.sync") + ptx.count("wgmma.mma_async")}
print(json.dumps(report))
"""


@needs_triton
def test_kernel_compiles_for_an_h100_with_tensor_cores_for_half_precision_only():
    """The CUDA path the interpreter never takes: every dtype compiles to a cubin for sm_90; bf16
    and fp16 scores use the tensor cores, float32 ones do not (IEEE products, never TF32)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    environment.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_H100], capture_output=True, text=True, env=environment, timeout=600
    )
    if done.returncode != 0 and "nvidia" in done.stderr and "backend" in done.stderr.lower():
        pytest.skip(f"this Triton has no CUDA backend to compile with: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(entry["cubin"] for entry in report.values()), report
    assert report["bf16"]["mma"] > 0 and report["fp16"]["mma"] > 0, report
    assert report["fp32"]["mma"] == 0, report


@needs_triton
def test_half_precision_tiles_enter_the_dot_in_the_models_dtype(monkeypatch):
    """On CUDA bf16/fp16 tiles go to ``tl.dot`` as they are (tensor cores); the interpreter, whose dot
    multiplies bf16 as raw 16-bit integers, gets bf16 upcast to float32 (exact products either way)."""
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32, torch.float64: tl.float64}
    assert {dtype: fused._dot_dtype(dtype) for dtype in expected} == expected
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused._dot_dtype(torch.bfloat16) == tl.float32 and fused._dot_dtype(torch.float16) == tl.float16
    # Keys of another dtype are not rounded to the queries' half precision.
    assert fused._dot_dtype(torch.float16, torch.float32) == tl.float32


@needs_triton
@runnable
def test_kernel_with_half_precision_queries_and_float32_keys():
    """Mixed dtypes: the keys keep their float32 values, as on the torch path (which upcasts both)."""
    query, key = make_qk(20, torch.float32, seed=5)
    query = query.to(torch.float16)
    options = dict(window=7, lengths=torch.tensor([20, 15]))
    out = fused.attention_sums_triton(query, key, block_size=16, **options)
    assert_same_sums(out, attention_sums_from_qk(query, key, **options), torch.float32)
