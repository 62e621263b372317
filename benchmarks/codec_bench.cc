// Microbenchmark of the codec paths: BF16, then the fp16 / int8 wire formats' blocks (not built by
// CMake). Build and run by hand:
//   g++ -std=c++20 -O2 -ffp-contract=off -Icsrc benchmarks/codec_bench.cc csrc/core/codec.cc csrc/core/env.cc \
//       -o /tmp/codec_bench && /tmp/codec_bench [n_elements] [reps]
// Reports GB/s of bytes read + written (best of reps), per path and function.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "core/codec.h"

namespace cd = xirang::codec;

static double bestSeconds(int reps, const std::function<void()>& fn) {
  fn();  // warm-up (page faults)
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : (int64_t{4} << 20);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1e-3f);
  std::vector<float> x(n), r(n), r2(n), dec(n);
  std::vector<uint16_t> in(n), out(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = nd(rng);
    r[i] = nd(rng) * 1e-3f;
    in[i] = cd::f32ToBf16(nd(rng));
  }
  std::printf("n=%lld elements, best of %d\n", static_cast<long long>(n), reps);
  std::printf("%-11s %12s %12s %12s %12s %12s %12s\n", "path", "accEncEF", "accEncEF-ip",
              "encodeEF", "encode", "decode", "decodeAcc");
  for (cd::Path p : {cd::Path::Scalar, cd::Path::AVX2, cd::Path::AVX512BF16}) {
    if (!cd::pathAvailable(p)) {
      std::printf("%-11s (not available)\n", cd::pathName(p));
      continue;
    }
    cd::setPathForTesting(p);
    const double gb = 1e-9 * static_cast<double>(n);
    // in(2) + x(4) + r_in(4) read, r_out(4) + out(2) written = 16 bytes/element.
    const double tAcc = bestSeconds(reps, [&] {
      cd::accumulateEncodeEF(in.data(), x.data(), 0.125f, r.data(), r2.data(), out.data(), n);
    });
    // In place, as the ring runs it: r_out == r_in, out == in.
    std::vector<uint16_t> io = in;
    std::vector<float> rr = r;
    const double tAccIp = bestSeconds(reps, [&] {
      cd::accumulateEncodeEF(io.data(), x.data(), 0.125f, rr.data(), rr.data(), io.data(), n);
    });
    const double tEF = bestSeconds(reps, [&] {  // 4 + 4 read, 4 + 2 written
      cd::encodeEF(x.data(), 0.125f, r.data(), r2.data(), out.data(), n);
    });
    const double tEnc = bestSeconds(reps, [&] { cd::encode(x.data(), out.data(), n); });  // 4 + 2
    const double tDec = bestSeconds(reps, [&] { cd::decode(in.data(), dec.data(), n); });  // 2 + 4
    const double tDA = bestSeconds(reps, [&] {  // 2 + 4 read, 4 written
      cd::decodeAccumulate(in.data(), dec.data(), n);
    });
    std::printf("%-11s %10.2f GB/s %7.2f GB/s %7.2f GB/s %7.2f GB/s %7.2f GB/s %7.2f GB/s\n",
                cd::pathName(p), 16 * gb / tAcc, 16 * gb / tAccIp, 14 * gb / tEF, 6 * gb / tEnc,
                6 * gb / tDec, 10 * gb / tDA);
  }
  // The scaled wire formats (codec.h: encodeBlockEF etc.), ns per element: the direct form's
  // sender encode (x, r_in read; codes, scales, r_out written), the owner's decode-accumulate.
  std::printf("\n%-11s %-6s %14s %14s %14s\n", "path", "wire", "encBlockEF", "decodeBlock", "decAccBlock");
  for (cd::Path p : {cd::Path::Scalar, cd::Path::AVX2, cd::Path::AVX512BF16}) {
    if (!cd::pathAvailable(p)) continue;
    cd::setPathForTesting(p);
    for (cd::Wire w : {cd::Wire::BF16, cd::Wire::FP16, cd::Wire::INT8}) {
      std::vector<uint8_t> block(cd::blockBytes(w, n));
      const double tE = bestSeconds(reps, [&] { cd::encodeBlockEF(w, x.data(), 0.125f, r.data(), r2.data(), block.data(), n); });
      const double tD = bestSeconds(reps, [&] { cd::decodeBlock(w, block.data(), dec.data(), n); });
      const double tA = bestSeconds(reps, [&] { cd::decodeAccumulateBlock(w, block.data(), dec.data(), n); });
      const double ns = 1e9 / static_cast<double>(n);
      std::printf("%-11s %-6s %9.2f ns/el %9.2f ns/el %9.2f ns/el\n", cd::pathName(p), cd::wireName(w), tE * ns,
                  tD * ns, tA * ns);
    }
  }
  return 0;
}
