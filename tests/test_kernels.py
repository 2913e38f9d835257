"""Blockwise quantisation of saved activations (bagualu_plugin/kernels/, paper §IV-B): the torch reference against
error bounds derived from the formats, the Triton kernels against the reference (bit for bit
except where the Triton interpreter's casts are known to be wrong; see each test)."""

import os
import subprocess
import sys

import pytest
import torch

from bagualu_plugin import kernels
from bagualu_plugin.kernels import reference as ref
from bagualu_plugin.kernels import triton_quant

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUBNORMAL = 2**-6  # smallest normal e4m3 magnitude; |x| / scale below it falls on the 2^-9 grid


def activation(shape, dtype=torch.float32, seed=0):
    """Magnitudes spread over 8 decades (finite in fp16), so blocks differ in amax and most blocks
    hold elements in the e4m3-subnormal range of their scale."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 10 ** (8 * torch.rand(shape, generator=g) - 4)).to(dtype)


def per_element(q):
    """The scale of each element's block."""
    return q.scales.repeat_interleave(q.block_size)[: q.payload.numel()]


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ---------------------------------------------------------------- reference: error bounds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 128])
def test_int8_error_is_half_a_step(dtype, block_size):
    """|x - deq| <= scale / 2 (rounding to the integer grid), plus < 2^-16 scale for the two fp32
    roundings (x / scale, payload * scale) and eps(dtype) (value + scale) for the final cast."""
    x = activation(7 * block_size + 5, dtype)
    q = ref.quantize(x, block_size, "int8")
    s, xf, eps = per_element(q), x.float(), torch.finfo(dtype).eps
    err = (ref.dequantize(q).float() - xf).abs()
    assert torch.all(err <= s * (0.5 + 2**-16 + eps) + eps * xf.abs())
    assert q.payload.abs().amax() == 127


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_fp8_error_is_half_an_ulp(dtype, block_size):
    """Where |x| >= 2^-6 * scale of its block (x / scale is an e4m3 normal): relative error
    <= 2^-4 (half an ulp of 3 mantissa bits) + 2^-20 (fp32 roundings) + eps(dtype) (final cast).
    Below it (e4m3 subnormals, step 2^-9): |x - deq| <= (2^-10 + 2^-20) * scale + eps(dtype) * |x|."""
    x = activation(9 * block_size + 3, dtype, seed=1)
    q = ref.quantize(x, block_size, "fp8_e4m3")
    s, xf, eps = per_element(q), x.float(), torch.finfo(dtype).eps
    err = (ref.dequantize(q).float() - xf).abs()
    normal = xf.abs() >= SUBNORMAL * s
    assert normal.any() and (~normal).any()
    assert torch.all(err[normal] <= (2**-4 + 2**-20 + eps) * xf.abs()[normal])
    assert torch.all(err[~normal] <= (2**-10 + 2**-20) * s[~normal] + eps * xf.abs()[~normal])
    assert q.payload.float().abs().amax() == 448


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_zero_blocks_have_scale_one_and_come_back_exactly(fmt):
    x = activation(64)
    x[16:48] = 0.0
    x[20] = -0.0
    q = ref.quantize(x, 16, fmt)
    assert q.scales[1:3].tolist() == [1.0, 1.0]
    deq = ref.dequantize(q)
    assert torch.equal(deq[16:48], x[16:48])


def nonfinite(n=100, seed=3):
    """An activation with +inf (SDPA's padded log-sum-exp), -inf (masks) and a NaN in some blocks."""
    x = activation(n, seed=seed)
    x[[5, 99]], x[7], x[40] = torch.inf, -torch.inf, torch.nan
    return x


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_non_finite_values_come_back_exactly_and_spare_their_blocks(fmt):
    """A scale over an inf would be inf and every value of its block would come back NaN
    (0 * inf): the scale is taken over finite values, the block marked by its sign."""
    x = nonfinite()
    q = ref.quantize(x, 16, fmt)
    assert torch.all(q.scales.isfinite())
    assert (q.scales < 0).tolist() == [True, False, True, False, False, False, True]
    deq = ref.dequantize(q)
    special = ~x.isfinite()
    torch.testing.assert_close(deq[special], x[special], rtol=0, atol=0, equal_nan=True)
    finite = ~special
    assert deq[finite].isfinite().all()
    s = per_element(q).abs()[finite]
    bound = s * 0.5 if fmt == "int8" else torch.maximum(x[finite].abs() * 2**-4, s * 2**-10)
    assert torch.all((deq[finite] - x[finite]).abs() <= bound * (1 + 2**-16))
    plain = x.clone()
    plain[special] = 0
    unmarked = ref.quantize(plain, 16, fmt)  # blocks without a special value are unchanged
    keep = (q.scales > 0).repeat_interleave(16)[:100]
    assert torch.equal(bits(q.payload)[keep], bits(unmarked.payload)[keep])


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_partial_last_block_has_its_own_scale(fmt):
    x = activation(3 * 32 + 5)
    x[-5:] = torch.tensor([0.5, -2.0, 1.0, 0.25, 0.0])
    q = ref.quantize(x, 32, fmt)
    assert q.scales.shape == (4,) and q.payload.shape == (101,)
    assert q.scales[-1] == torch.tensor(2.0) / ref.QMAX[fmt]
    assert ref.dequantize(q).shape == x.shape


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_non_contiguous_input_is_quantised_in_logical_order(fmt):
    x = activation((40, 24)).t()[:, ::3]
    assert not x.is_contiguous()
    q, qc = ref.quantize(x, 16, fmt), ref.quantize(x.contiguous(), 16, fmt)
    assert torch.equal(bits(q.payload), bits(qc.payload)) and torch.equal(q.scales, qc.scales)
    assert torch.equal(ref.dequantize(q), ref.dequantize(qc))


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_and_shape_come_back(fmt, dtype):
    x = activation((2, 3, 37), dtype)
    q = ref.quantize(x, 16, fmt)
    assert (q.shape, q.dtype, q.block_size, q.fmt) == (x.shape, dtype, 16, fmt)
    assert q.payload.dtype == ref.STORAGE[fmt] and q.scales.dtype == torch.float32
    deq = ref.dequantize(q)
    assert deq.dtype == dtype and deq.shape == x.shape


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("numel", [0, 1, 16, 1000])
def test_nbytes_is_the_cost_model_formula(fmt, numel):
    q = kernels.quantize(activation(numel), 64, fmt)
    assert q.nbytes == kernels.stored_nbytes(numel, 64) == numel + 4 * -(-numel // 64)


def test_dispatch_on_cpu_is_the_reference():
    x = activation(100, torch.bfloat16)
    q = kernels.quantize(x, 32, "fp8_e4m3")
    r = ref.quantize(x, 32, "fp8_e4m3")
    assert torch.equal(bits(q.payload), bits(r.payload)) and torch.equal(q.scales, r.scales)
    assert torch.equal(kernels.dequantize(q), ref.dequantize(r))
    assert kernels.FORMATS == ("fp8_e4m3", "int8")


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: kernels.quantize(torch.ones(4), 24), ValueError, "block_size"),
        (lambda: kernels.quantize(torch.ones(4), 8), ValueError, "block_size"),
        (lambda: kernels.quantize(torch.ones(4), 2**17), ValueError, "block_size"),
        (lambda: kernels.quantize(torch.ones(4), 16.0), TypeError, "block_size"),
        (lambda: kernels.quantize(torch.ones(4), True), TypeError, "block_size"),
        (lambda: kernels.quantize(torch.ones(4), 16, "e4m3"), ValueError, "fmt"),
        (lambda: kernels.quantize(torch.ones(4, dtype=torch.int32), 16), TypeError, "x must"),
        (lambda: kernels.quantize(torch.ones(4, dtype=torch.float64), 16), TypeError, "x must"),
        (lambda: kernels.quantize([1.0, 2.0], 16), TypeError, "x must"),
        (lambda: kernels.dequantize(torch.ones(4)), TypeError, "q must"),
        (lambda: kernels.stored_nbytes(-1, 16), ValueError, "numel"),
        (lambda: kernels.stored_nbytes(10, 12), ValueError, "block_size"),
    ],
)
def test_bad_arguments_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- Triton wrappers


def test_triton_wrapper_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_quant, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_quant.quantize(torch.ones(16), 16, "int8")


def test_triton_wrapper_without_triton_says_so(monkeypatch):
    monkeypatch.setattr(triton_quant, "HAVE_TRITON", False)
    with pytest.raises(ImportError, match="triton"):
        triton_quant.dequantize(ref.quantize(torch.ones(16), 16, "int8"))


# ---------------------------------------------------------------- Triton kernels, interpreted

# triton decides between compiling and interpreting when a kernel is defined, so the kernels run in
# a subprocess that imports them with TRITON_INTERPRET=1; the comparisons stay in this process.
_INTERPRET = """
import sys, torch
from bagualu_plugin.kernels import triton_quant
out = {}
for name, (x, block_size, fmt, ref_q) in torch.load(sys.argv[1], weights_only=False).items():
    q = triton_quant.quantize(x, block_size, fmt)
    out[name] = (q, triton_quant.dequantize(ref_q))
torch.save(out, sys.argv[2])
"""


def _e4m3_cast_edges():
    """One block with amax 448 (scale exactly 1): every e4m3 value, the midpoints between
    neighbours (ties) and just above them (rounding up, into the next binade at mantissa 111)."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[:-1] + grid[1:]) / 2
    values = torch.cat([grid, mid, torch.nextafter(mid, grid[1:])])
    return torch.cat([values, -values, torch.zeros(1024 - 2 * values.numel())])


def _cases():
    cases = {}
    shapes = [((7,), 16), ((3, 45), 16), ((5, 129), 128), ((2, 1000), 256), ((9001,), 32), ((3, 4097), 4096)]
    for fmt in ref.FORMATS:
        for dtype in DTYPES:
            for i, (shape, block_size) in enumerate(shapes):
                x = activation(shape, dtype, seed=i)
                cases[f"{fmt}-{str(dtype)[6:]}-{'x'.join(map(str, shape))}-b{block_size}"] = (x, block_size, fmt)
        cases[f"{fmt}-noncontiguous"] = (activation((40, 24)).t()[:, ::3], 16, fmt)
        cases[f"{fmt}-zeros"] = (torch.zeros(50), 16, fmt)
        cases[f"{fmt}-empty"] = (torch.zeros(0, 3), 16, fmt)
        cases[f"{fmt}-cast-edges"] = (_e4m3_cast_edges(), 1024, fmt)
    ties = torch.cat([torch.arange(-127, 127) + 0.5, torch.tensor([127.0])])  # scale exactly 1
    cases["int8-ties"] = (ties, 256, "int8")
    cases["int8-nonfinite"] = (nonfinite(), 16, "int8")
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """name -> (Quantized from the quantize kernel, dequantize kernel applied to the reference's payload)."""
    tmp = tmp_path_factory.mktemp("interpret")
    torch.save({k: (x, b, f, ref.quantize(x, b, f)) for k, (x, b, f) in CASES.items()}, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRET, tmp / "in.pt", tmp / "out.pt"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [k for k in CASES if k.startswith("int8")])
def test_interpreted_int8_quantize_is_bit_exact(interpreted, name):
    x, block_size, fmt = CASES[name]
    q, r = interpreted[name][0], ref.quantize(x, block_size, fmt)
    assert torch.equal(q.payload, r.payload) and torch.equal(q.scales, r.scales)
    assert (q.shape, q.dtype, q.block_size, q.fmt) == (r.shape, r.dtype, r.block_size, r.fmt)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [k for k in CASES if k.startswith("fp8")])
def test_interpreted_fp8_quantize_within_the_interpreter_cast_error(interpreted, name):
    """Scales are bit-exact. Payloads p (in units of x / scale) can differ from the reference's r
    because the interpreter's fp32 -> e4m3 cast (triton 3.9 `_convert_float`) rounds ties up, drops
    the carry of a mantissa 111 rounding up when the exponent is odd (giving 2^e for 2^(e+1)) and
    truncates into the subnormal range. Asserted: where |x / scale| >= 2^-6 every mismatch is one
    of the first two (p = r / 2 with r a power of two, or x / scale a tie between p and r); always
    |p - r| <= |r| / 2 + 2^-10. Measured over a sweep (every e4m3 value and midpoint, 12 leading mantissa
    bits of every normal binade, a 2^-22 grid below 2^-5): max |p - r| / |r| = 0.5 in the normal range, max
    |p - r| - |r| / 2 = 2^-10 (max |p - r| = 2^-7) below 2^-6. The cases here reach both maxima;
    9% of their random payloads differ, 2.3% of those in the normal range (no carry needs the four
    mantissa bits after the leading one at 1111 and an odd exponent).
    On a GPU the cast rounds correctly and test_cuda_kernels_match_the_reference is exact."""
    x, block_size, fmt = CASES[name]
    q, r = interpreted[name][0], ref.quantize(x, block_size, fmt)
    assert torch.equal(q.scales, r.scales)
    if x.numel() == 0:
        return
    s = per_element(r)
    p, rp = q.payload.float(), r.payload.float()
    v = x.contiguous().view(-1).float() / s
    assert torch.all((p - rp).abs() <= rp.abs() / 2 + 2**-10)
    differ = (p != rp) & (v.abs() >= SUBNORMAL)
    no_carry = (2 * p == rp) & (torch.frexp(rp).mantissa.abs() == 0.5)
    assert torch.all(no_carry[differ] | (v == (p + rp) / 2)[differ])
    deq, rdeq = p * s, rp * s  # dequantised in fp32, before the cast back to x.dtype
    assert torch.all((deq - rdeq).abs() <= (rdeq.abs() / 2 + 2**-10 * s) * (1 + 2**-20))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_dequantize_of_the_reference_payload_is_bit_exact(interpreted, name):
    """Bit-exact for fp32 and fp16 outputs. The interpreter casts fp32 -> bf16 by truncation
    (`cast_impl` passes no rounding mode), a GPU rounds to nearest even: for bf16 the kernel must
    equal the reference's fp32 product truncated to bf16, and on a GPU the reference itself."""
    x, block_size, fmt = CASES[name]
    r = ref.quantize(x, block_size, fmt)
    out = interpreted[name][1]
    if x.dtype == torch.bfloat16:
        product = r.payload.float() * per_element(r)
        expected = (product.view(torch.int32) & -(2**16)).view(torch.float32).to(torch.bfloat16).view(x.shape)
    else:
        expected = ref.dequantize(r)
    assert out.dtype == x.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------- Triton kernels on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_quant.HAVE_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, block_size", [((3, 45), 16), (((1 << 20) + 3,), 128), ((5, 70001), 2**16)])
def test_cuda_kernels_match_the_reference(fmt, dtype, shape, block_size):
    x = activation(shape, dtype).cuda()
    q, r = kernels.quantize(x, block_size, fmt), ref.quantize(x, block_size, fmt)
    assert torch.equal(bits(q.payload), bits(r.payload)) and torch.equal(q.scales, r.scales)
    assert torch.equal(kernels.dequantize(r), ref.dequantize(r))
    assert torch.equal(kernels.dequantize(q), ref.dequantize(r))
