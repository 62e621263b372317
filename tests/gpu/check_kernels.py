"""GPU check: the CUDA codec kernels give the CPU codec's bits, and their throughput.

    python tests/gpu/check_kernels.py OUT_DIR [bits|speed|all]

bits: every codec op on random bit patterns (NaNs with payloads, denormals, infinities, ties,
the bf16 overflow boundary), aligned and unaligned, n % 4 != 0, in-place aliases; CUDA result
bits == CPU (xirang._C._codec_* on CPU tensors) bits. Inputs keep at most one NaN operand per
add/multiply (the codec's contract). Writes OUT_DIR/kernel_bits.json.
speed: effective bytes read + written per second of each kernel at 256 MiB of fp32 against a
device-to-device copy (2 x bytes / time); target >= 0.8 for the EF kernels.
Writes OUT_DIR/kernel_speed.json. Exit status 1 if a check fails.
"""
import json
import os
import sys

import torch

import xirang  # noqa: F401
from xirang import _C

OUT = sys.argv[1] if len(sys.argv) > 1 else "gpu-results"
WHAT = sys.argv[2] if len(sys.argv) > 2 else "all"
os.makedirs(OUT, exist_ok=True)
dev = torch.device("cuda", 0)


def i32(v):
    return v - (1 << 32) if v >= (1 << 31) else v


def is_nan_bits(u):
    """u: int32 tensor of fp32 bit patterns."""
    return (u & 0x7FFFFFFF) > 0x7F800000


def f32_from_bits(u):
    return u.clone().view(torch.float32)


SPECIALS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345,
            0x7FBFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000,
            0x3F807FFF, 0x3F808001, 0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x7F7FFFFF, 0x00800000, 0x0000FFFF]


def special_bits(n, g):
    """n random fp32 bit patterns (int32), an eighth replaced by specials, an eighth made ties."""
    u = torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    k = max(1, n // 8)
    sp = torch.tensor([i32(v) for v in SPECIALS], dtype=torch.int32)
    idx = torch.randint(0, n, (k,), generator=g)
    u[idx] = sp[torch.randint(0, len(SPECIALS), (k,), generator=g)]
    idx2 = torch.randint(0, n, (k,), generator=g)
    u[idx2] = (u[idx2] & i32(0xFFFF0000)) | 0x8000
    return u


def finite_like(u, g):
    """Replace NaN patterns by finite values (infinities stay)."""
    out = u.clone()
    m = is_nan_bits(out)
    out[m] = torch.randint(0, 0x7F000000, (int(m.sum()),), generator=g, dtype=torch.int64).to(torch.int32)
    return out


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def compare(name, cpu, gpu, results):
    ok = True
    detail = {}
    for k, (a, b) in enumerate(zip(cpu, gpu)):
        ba, bb = bits(a), bits(b)
        diff = (ba != bb).nonzero().flatten()
        detail[f"out{k}_mismatches"] = int(diff.numel())
        if diff.numel():
            ok = False
            i = diff[:5].tolist()
            detail[f"out{k}_examples"] = [(j, hex(int(ba[j]) & 0xFFFFFFFF), hex(int(bb[j]) & 0xFFFFFFFF)) for j in i]
    results[name] = {"ok": ok, **detail}
    print(("PASS " if ok else "FAIL ") + name, detail if not ok else "", flush=True)
    return ok


def run_bits():
    g = torch.Generator().manual_seed(1234)
    results = {}
    ok = True
    for n, off in ((1 << 20, 0), ((1 << 20) + 3, 0), (100_003, 1), (7, 0), (5, 1)):
        xb = special_bits(n + off, g)
        rb = finite_like(special_bits(n + off, g), g)
        ib = (special_bits(n + off, g) >> 16).to(torch.int16)  # bf16 patterns
        # at most one NaN operand per add: where `in` is NaN, x (and acc) are finite
        in_nan = is_nan_bits(ib.to(torch.int32) << 16)
        x_acc = xb.clone()
        x_acc[in_nan] = finite_like(x_acc[in_nan] | 0x7FC00000, g)
        xc = f32_from_bits(xb)[off:]
        xac = f32_from_bits(x_acc)[off:]
        rc = f32_from_bits(rb)[off:]
        ic = ib.clone().view(torch.bfloat16)[off:]
        tag = f"n={n},offset={off}"
        for scale in (1.0, 0.25, 1.0 / 3.0):
            cpu = _C._codec_encode_ef(xc, scale, rc)
            gpu = _C._codec_encode_ef(xc.to(dev), scale, rc.to(dev))
            ok &= compare(f"encode_ef[{tag},scale={scale:.4g}]", cpu, gpu, results)
            cpu = _C._codec_accumulate_encode_ef(ic, xac, scale, rc)
            gpu = _C._codec_accumulate_encode_ef(ic.to(dev), xac.to(dev), scale, rc.to(dev))
            ok &= compare(f"accumulate_encode_ef[{tag},scale={scale:.4g}]", cpu, gpu, results)
        # in-place aliases: r_out = r_in; out = in
        r1, r2 = rc.clone(), rc.to(dev)
        cpu = _C._codec_encode_ef(xc, 0.5, r1, r1)
        gpu = _C._codec_encode_ef(xc.to(dev), 0.5, r2, r2)
        ok &= compare(f"encode_ef_inplace[{tag}]", cpu, gpu, results)
        i1, i2, r1, r2 = ic.clone(), ic.to(dev), rc.clone(), rc.to(dev)
        cpu = _C._codec_accumulate_encode_ef(i1, xac, 0.5, r1, r1, i1)
        gpu = _C._codec_accumulate_encode_ef(i2, xac.to(dev), 0.5, r2, r2, i2)
        ok &= compare(f"accumulate_encode_ef_inplace[{tag}]", cpu, gpu, results)
        ok &= compare(f"encode[{tag}]", [_C._codec_encode(xc)], [_C._codec_encode(xc.to(dev))], results)
        ok &= compare(f"decode[{tag}]", [_C._codec_decode(ic)], [_C._codec_decode(ic.to(dev))], results)
        a1, a2 = xac.clone(), xac.to(dev)
        _C._codec_decode_accumulate(ic, a1)
        _C._codec_decode_accumulate(ic.to(dev), a2)
        ok &= compare(f"decode_accumulate[{tag}]", [a1], [a2], results)
    torch.cuda.synchronize()
    with open(os.path.join(OUT, "kernel_bits.json"), "w") as f:
        json.dump({"ok": bool(ok), "cases": results}, f, indent=1)
    return ok


def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def run_speed():
    n = (256 << 20) // 4  # 256 MiB of fp32
    x = torch.randn(n, device=dev)
    r = torch.randn(n, device=dev) * 1e-3
    r2 = torch.empty_like(r)
    o = torch.empty(n, device=dev, dtype=torch.bfloat16)
    i = torch.randn(n, device=dev).to(torch.bfloat16)
    acc = torch.randn(n, device=dev)
    src = torch.empty(n, device=dev)
    dst = torch.empty_like(src)
    t_copy = timeit(lambda: dst.copy_(src))
    bw_copy = 2 * src.numel() * 4 / t_copy
    res = {"copy_GBps": bw_copy / 1e9, "bytes_fp32": n * 4}
    ops = {
        "encode_ef": (lambda: _C._codec_encode_ef(x, 0.5, r, r2, o), 14 * n, True),
        "accumulate_encode_ef": (lambda: _C._codec_accumulate_encode_ef(i, x, 0.5, r, r2, o), 16 * n, True),
        "decode_accumulate": (lambda: _C._codec_decode_accumulate(i, acc), 10 * n, False),
        "encode": (lambda: _C._codec_encode(x), 6 * n, False),
        "decode": (lambda: _C._codec_decode(i), 6 * n, False),
    }
    ok = True
    for name, (fn, nbytes, gated) in ops.items():
        t = timeit(fn)
        bw = nbytes / t
        ratio = bw / bw_copy
        res[name] = {"GBps": bw / 1e9, "ratio_to_copy": ratio, "gated": gated, "ok": ratio >= 0.8}
        if gated:
            ok &= ratio >= 0.8
        print(f"{'PASS' if ratio >= 0.8 else ('FAIL' if gated else 'INFO')} speed {name}: {bw / 1e9:.0f} GB/s = "
              f"{ratio:.2f} x copy ({bw_copy / 1e9:.0f} GB/s)", flush=True)
    res["ok"] = bool(ok)
    with open(os.path.join(OUT, "kernel_speed.json"), "w") as f:
        json.dump(res, f, indent=1)
    return ok


if __name__ == "__main__":
    good = True
    if WHAT in ("bits", "all"):
        good &= run_bits()
    if WHAT in ("speed", "all"):
        good &= run_speed()
    sys.exit(0 if good else 1)
