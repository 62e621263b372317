// GPU-only checks of the device data path (#17), run by tests/gpu/run_checks.sh on a machine with
// a GPU; tests/cuda_build.sh only compiles and links it (no GPU there). Two checks:
//
//   device_checks kernels   every kernel of core/device/kernels.h launched on the GPU
//                           (cuda/kernels.cu through cuda::kernelApi()) gives the bytes of the
//                           host grid emulator (device::emulate) on the same inputs: every
//                           dtype x op the kernels take, sizes 0, 1, 7, 4095, 4097, 2^20 + 3,
//                           aligned and misaligned (the scalar path), inputs with edge values
//                           (+-0, +-inf, NaN, FLT_MAX, denormals, bf16 rounding ties) and random
//                           bits. NaN outputs are compared by NaN-ness; differing NaN payloads
//                           are counted and printed, not failed.
//   device_checks nccl      a one-rank communicator of the real libnccl.so.2 (cuda/nccl_api.h):
//                           unique id through a store, non-blocking init, a grouped send/receive
//                           to itself through the table, then every collective of the core
//                           (tests/cpp/collective_cases.h) over NcclLink + DeviceReducer (GPU
//                           kernels, managed memory) gives the in-process host engine's bits;
//                           abort of a second communicator returns.
//
// Prints "device_checks: PASS|FAIL <what>" lines; the exit status is the number of failures.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collective_cases.h"
#include "core/algorithms/device_reducer.h"
#include "core/codec.h"
#include "core/device/kernels.h"
#include "core/transport/nccl_link.h"
#include "cuda/cuda_api.h"
#include "cuda/nccl_api.h"
#include "support.h"

namespace {

namespace dv = xirang::device;
namespace tp = xirang::transport;
using xirang::DType;
using xirang::ReduceOp;
using std::chrono::milliseconds;

int failures = 0;
void report(bool ok, const std::string& what) {
  std::printf("device_checks: %s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++failures;
}

void cudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// --- kernels ------------------------------------------------------------------------------------

// How a buffer's bytes are compared: floats by value bits with NaN == NaN, the rest bytewise.
enum class Elem { F32, F64, F16, BF16, Raw };
Elem elemOf(DType t) {
  switch (t) {
    case DType::Float32: case DType::Complex64: return Elem::F32;
    case DType::Float64: case DType::Complex128: return Elem::F64;
    case DType::Float16: return Elem::F16;
    case DType::BFloat16: return Elem::BF16;
    default: return Elem::Raw;
  }
}
size_t width(Elem e) { return e == Elem::F64 ? 8 : e == Elem::F32 ? 4 : e == Elem::Raw ? 1 : 2; }
bool isNanAt(const uint8_t* p, Elem e) {
  uint64_t u = 0;
  std::memcpy(&u, p, width(e));
  switch (e) {
    case Elem::F32: return (u & 0x7FFFFFFFu) > 0x7F800000u;
    case Elem::F64: return (u & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull;
    case Elem::F16: return (u & 0x7FFFu) > 0x7C00u;
    case Elem::BF16: return (u & 0x7FFFu) > 0x7F80u;
    default: return false;
  }
}

struct Buf {
  size_t bytes;
  Elem elem;   // of the values (inputs are filled accordingly; outputs compared so)
  bool out;    // written by the kernel (compared)
  bool boolean = false;   // Bool dtype: bytes 0 / 1
  bool small_ints = false;  // integer Product: elements with values in -3..3 (no overflow)
  size_t es = 0;            // element size when elem is Raw (the misaligned shift, small_ints)
};
size_t elementBytes(const Buf& b) { return b.elem == Elem::Raw && b.es ? b.es : width(b.elem); }

const uint32_t kEdgeF32[] = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00001u,
                             0x7F7FFFFFu, 0xFF7FFFFFu, 0x00000001u, 0x807FFFFFu, 0x3F808000u, 0x3F818000u,
                             0x3F80C000u, 0x7F7F8000u, 0x7F7F7FFFu, 0x00008000u, 0x3F800001u, 0xBF807FFFu};

void fill(uint8_t* p, const Buf& b, uint64_t salt) {
  using xirang_test::mix;
  const size_t w = width(b.elem), n = b.bytes / w;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = mix(salt, i, b.bytes);
    uint8_t* e = p + i * w;
    if (b.boolean) {
      e[0] = static_cast<uint8_t>(h & 1);
    } else if (b.small_ints) {
      const size_t es = elementBytes(b);
      if (i % es == 0) {  // little-endian, sign-extended over the element
        const int64_t v = static_cast<int64_t>(h % 7) - 3;
        std::memcpy(e, &v, std::min(es, n - i));
        i += es - 1;
      }
    } else if (b.elem == Elem::F32 && i < sizeof(kEdgeF32) / 4) {
      std::memcpy(e, &kEdgeF32[i], 4);
    } else if (b.elem == Elem::F32 && (h >> 62) != 0) {  // 3/4 ordinary values, 1/4 random bits
      const float f = static_cast<float>((xirang_test::unit(h) - 0.5) * std::ldexp(1.0, static_cast<int>(h % 40) - 20));
      std::memcpy(e, &f, 4);
    } else {
      std::memcpy(e, &h, w);
    }
  }
}

// Fills the buffers, runs make(host pointers) through the emulator and make(device pointers) on
// the GPU, compares the outputs. `misalign` shifts every buffer by one element (scalar path).
void checkKernel(const std::string& name, const std::vector<Buf>& bufs, bool misalign,
                 const std::function<dv::Kernel(const std::vector<uint8_t*>&)>& make, cudaStream_t stream) {
  std::vector<std::vector<uint8_t>> host(bufs.size());
  std::vector<uint8_t*> hp(bufs.size()), dp(bufs.size());
  std::vector<void*> dbase(bufs.size(), nullptr);
  for (size_t i = 0; i < bufs.size(); ++i) {
    const size_t shift = misalign ? elementBytes(bufs[i]) : 0;  // one element: off 16-byte alignment
    host[i].assign(bufs[i].bytes + 64, 0);
    // 16-byte aligned host start (vectors), then the shift.
    uint8_t* base = host[i].data();
    base += (16 - reinterpret_cast<uintptr_t>(base) % 16) % 16;
    hp[i] = base + shift;
    fill(hp[i], bufs[i], i * 1000003u + bufs[i].bytes);
    cudaOk(cudaMalloc(&dbase[i], bufs[i].bytes + 64), "cudaMalloc");
    dp[i] = static_cast<uint8_t*>(dbase[i]) + shift;
    cudaOk(cudaMemcpy(dp[i], hp[i], bufs[i].bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  std::string err;
  size_t bad = 0, nan_payload = 0, checked = 0, first = 0;
  try {
    const dv::Kernel hk = make(hp), gk = make(dp);
    if (!dv::checkKernel(hk).empty()) throw std::runtime_error("checkKernel: " + dv::checkKernel(hk));
    dv::emulate(hk);
    const int rc = xirang::cuda::kernelApi().launch(gk, reinterpret_cast<dv::Stream>(stream));
    cudaOk(static_cast<cudaError_t>(rc), "launch");
    cudaOk(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    for (size_t i = 0; i < bufs.size(); ++i) {
      if (!bufs[i].out) continue;
      std::vector<uint8_t> got(bufs[i].bytes);
      cudaOk(cudaMemcpy(got.data(), dp[i], bufs[i].bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
      const size_t w = width(bufs[i].elem);
      for (size_t k = 0; k + w <= bufs[i].bytes; k += w, ++checked) {
        if (std::memcmp(got.data() + k, hp[i] + k, w) == 0) continue;
        if (isNanAt(got.data() + k, bufs[i].elem) && isNanAt(hp[i] + k, bufs[i].elem)) {
          ++nan_payload;
        } else if (bad++ == 0) {
          first = k / w;
        }
      }
    }
  } catch (const std::exception& e) {
    err = e.what();
  }
  for (void* p : dbase) (void)cudaFree(p);
  char line[512];
  if (!err.empty()) {
    std::snprintf(line, sizeof line, "kernel %s: %s", name.c_str(), err.c_str());
  } else {
    std::snprintf(line, sizeof line, "kernel %s: %zu values, %zu differ (first at %zu)%s", name.c_str(), checked, bad,
                  first, nan_payload ? (", NaN payloads differ at " + std::to_string(nan_payload)).c_str() : "");
  }
  report(err.empty() && bad == 0, line);
}

void kernels() {
  cudaStream_t s;
  cudaOk(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Int8,
                          DType::Int16,   DType::Int32,   DType::Int64,   DType::UInt8,   DType::Bool,
                          DType::Complex64, DType::Complex128};
  const ReduceOp ops[] = {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max,
                          ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor};
  using P = const std::vector<uint8_t*>&;
  auto f = [](uint8_t* p) { return reinterpret_cast<float*>(p); };
  auto h = [](uint8_t* p) { return reinterpret_cast<uint16_t*>(p); };
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4095}, int64_t{4097}, (int64_t{1} << 20) + 3}) {
    const size_t n4 = static_cast<size_t>(n) * 4, n2 = static_cast<size_t>(n) * 2;
    for (bool mis : {false, true}) {
      const std::string tag = "[n=" + std::to_string(n) + (mis ? ", misaligned]" : "]");
      checkKernel("encode" + tag, {{n4, Elem::F32, false}, {n2, Elem::BF16, true}}, mis,
                  [&](P p) { return dv::Kernel::encode(f(p[0]), h(p[1]), n); }, s);
      checkKernel("decode" + tag, {{n2, Elem::BF16, false}, {n4, Elem::F32, true}}, mis,
                  [&](P p) { return dv::Kernel::decode(h(p[0]), f(p[1]), n); }, s);
      checkKernel("decode_accumulate" + tag, {{n2, Elem::BF16, false}, {n4, Elem::F32, true}}, mis,
                  [&](P p) { return dv::Kernel::decodeAccumulate(h(p[0]), f(p[1]), n); }, s);
      checkKernel("encode_ef" + tag,
                  {{n4, Elem::F32, false}, {n4, Elem::F32, false}, {n4, Elem::F32, true}, {n2, Elem::BF16, true}}, mis,
                  [&](P p) { return dv::Kernel::encodeEF(f(p[0]), 0.37f, f(p[1]), f(p[2]), h(p[3]), n); }, s);
      checkKernel("encode_ef_aliased" + tag, {{n4, Elem::F32, false}, {n4, Elem::F32, true}, {n2, Elem::BF16, true}},
                  mis, [&](P p) { return dv::Kernel::encodeEF(f(p[0]), 1.0f, f(p[1]), f(p[1]), h(p[2]), n); }, s);
      checkKernel("accumulate_encode_ef" + tag,
                  {{n2, Elem::BF16, false}, {n4, Elem::F32, false}, {n4, Elem::F32, false}, {n4, Elem::F32, true},
                   {n2, Elem::BF16, true}},
                  mis,
                  [&](P p) {
                    return dv::Kernel::accumulateEncodeEF(h(p[0]), f(p[1]), 0.5f, f(p[2]), f(p[3]), h(p[4]), n);
                  },
                  s);
      for (xirang::codec::Wire w : {xirang::codec::Wire::FP16, xirang::codec::Wire::INT8}) {  // scaled wires
        const DType codes = xirang::codec::wireDType(w);
        const size_t nb = static_cast<size_t>(xirang::codec::blockBytes(w, n));
        const std::string wn = xirang::codec::wireName(w);
        checkKernel("scaled_encode_ef " + wn + tag,
                    {{n4, Elem::F32, false}, {n4, Elem::F32, false}, {n4, Elem::F32, true}, {nb, Elem::Raw, true}}, mis,
                    [&](P p) { return dv::Kernel::scaledEncodeEF(codes, f(p[0]), 0.37f, f(p[1]), f(p[2]), p[3], n); }, s);
        checkKernel("scaled_encode_ef_aliased " + wn + tag,
                    {{n4, Elem::F32, false}, {n4, Elem::F32, true}, {nb, Elem::Raw, true}}, mis,
                    [&](P p) { return dv::Kernel::scaledEncodeEF(codes, f(p[0]), 1.0f, f(p[1]), f(p[1]), p[2], n); }, s);
        for (bool acc : {false, true})
          checkKernel(std::string(acc ? "scaled_decode_accumulate " : "scaled_decode ") + wn + tag,
                      {{nb, Elem::Raw, false}, {n4, Elem::F32, true}}, mis,
                      [&](P p) { return dv::Kernel::scaledDecode(codes, p[0], f(p[1]), n, acc); }, s);
      }
      for (DType t : dtypes) {
        const size_t es = xirang::elementSize(t);
        const Elem el = elemOf(t);
        const std::string dn = xirang::dtypeName(t);
        for (ReduceOp op : ops) {
          if (!dv::checkKernel(dv::Kernel::reduce(nullptr, nullptr, 0, t, op)).empty()) continue;
          Buf a{n * es, el, true, t == DType::Bool, op == ReduceOp::Product && el == Elem::Raw, es};
          Buf b = a;
          b.out = false;
          checkKernel("reduce " + dn + " " + xirang::reduceOpName(op) + tag, {a, b}, mis,
                      [&](P p) { return dv::Kernel::reduce(p[0], p[1], n, t, op); }, s);
        }
        for (double factor : {0.37, 1.0 / 3.0}) {
          if (!dv::checkKernel(dv::Kernel::scaleBy(nullptr, 0, t, factor)).empty()) continue;
          checkKernel("scale " + dn + " by " + std::to_string(factor) + tag, {{n * es, el, true, false, false, es}}, mis,
                      [&](P p) { return dv::Kernel::scaleBy(p[0], n, t, factor); }, s);
        }
      }
      for (DType t : {DType::Float16, DType::BFloat16}) {
        const Elem el = elemOf(t);
        const std::string dn = xirang::dtypeName(t);
        checkKernel("widen16 " + dn + tag, {{n2, el, false}, {n4, Elem::F32, true}}, mis,
                    [&](P p) { return dv::Kernel::widen16(h(p[0]), f(p[1]), n, t); }, s);
        checkKernel("narrow16 " + dn + tag, {{n4, Elem::F32, false}, {n2, el, true}}, mis,
                    [&](P p) { return dv::Kernel::narrow16(f(p[0]), h(p[1]), n, t); }, s);
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max})
          checkKernel("combine16 " + dn + " " + xirang::reduceOpName(op) + " x3" + tag, {{3 * n2, el, false}, {n2, el, true}},
                      mis, [&](P p) { return dv::Kernel::combine16(h(p[0]), 3, n, t, op, 0.5f, 1.0f / 3.0f, h(p[1])); },
                      s);
      }
    }
  }
  (void)cudaStreamDestroy(s);
}

// --- one-rank NCCL ------------------------------------------------------------------------------

void nccl() {
  std::string why;
  dv::NcclApi* api = xirang::cuda::tryNcclApi(&why);
  report(api != nullptr, "load libnccl.so.2: " + (api ? xirang::cuda::ncclVersionString() + " from " +
                                                             xirang::cuda::ncclLibraryPath()
                                                       : why));
  if (!api) return;
  dv::CudaApi& cuda = xirang::cuda::runtimeApi();
  cudaOk(static_cast<cudaError_t>(cuda.setDevice(0)), "cudaSetDevice");
  dv::Stream stream = nullptr;
  cudaOk(static_cast<cudaError_t>(cuda.streamCreate(&stream)), "cudaStreamCreate");
  xirang_test::MemStore store;
  const auto deadline = [] { return xirang_test::after(milliseconds(60000)); };
  const auto id = tp::shareNcclUniqueId(*api, store, "xirang/gpu_check/0/nccl_uid", 0, deadline());
  dv::NcclComm comm = tp::initNcclComm(*api, id, 0, 1, deadline(), "gpu_check");
  report(comm != nullptr, "one-rank communicator (non-blocking ncclCommInitRankConfig)");

  // A grouped send + receive to itself, 1 MiB + 3 bytes, through the table.
  {
    const size_t bytes = (size_t{1} << 20) + 3;
    std::vector<uint8_t> src(bytes), got(bytes, 0);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(xirang_test::mix(i, 17));
    void *ds = nullptr, *dr = nullptr;
    cudaOk(cudaMalloc(&ds, bytes), "cudaMalloc");
    cudaOk(cudaMalloc(&dr, bytes), "cudaMalloc");
    cudaOk(cudaMemcpy(ds, src.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    int rc = api->groupStart();
    if (rc == dv::kNcclSuccess) rc = api->send(ds, bytes, 0, comm, stream);
    if (rc == dv::kNcclSuccess || rc == dv::kNcclInProgress) rc = api->recv(dr, bytes, 0, comm, stream);
    const int end = api->groupEnd();
    if (rc == dv::kNcclSuccess || rc == dv::kNcclInProgress) rc = end;
    int async = rc;
    for (int k = 0; async == dv::kNcclInProgress && k < 60000; ++k) {
      (void)api->commGetAsyncError(comm, &async);
      if (async == dv::kNcclInProgress) std::this_thread::sleep_for(milliseconds(1));
    }
    std::string what = async == dv::kNcclSuccess ? "" : std::string(api->errorString(async)) + " " + api->lastError(comm);
    if (what.empty() && cuda.streamSynchronize(stream) != dv::kCudaSuccess) what = "cudaStreamSynchronize failed";
    if (what.empty()) cudaOk(cudaMemcpy(got.data(), dr, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    report(what.empty() && got == src,
           "ncclSend/ncclRecv to itself in one group: " + (what.empty() ? (got == src ? "bytes equal" : "bytes differ") : what));
    (void)cudaFree(ds);
    (void)cudaFree(dr);
  }

  // Every collective over NcclLink + DeviceReducer (GPU kernels) == the in-process host engine.
  namespace cs = xirang_test::cases;
  std::vector<std::vector<uint8_t>> host_out, dev_out;
  std::string err;
  try {
    {
      xirang_test::InprocGroup g(1);
      std::vector<std::unique_ptr<uint8_t[]>> mem;
      g.run([&](int r) {
        cs::Env e;
        e.comm = g.comm(r);
        e.out = &host_out;
        e.alloc = [&mem](size_t b) {
          mem.emplace_back(new uint8_t[b + 1]());
          return mem.back().get();
        };
        e.finish = [] {};
        cs::allCollectives(e);
      });
    }
    tp::NcclLink link(*api, cuda, comm, 0, 1, stream);
    comm = nullptr;  // owned by the link
    xirang::algo::DeviceReducer reducer(cuda, xirang::cuda::kernelApi(), stream);
    std::vector<void*> mem;
    cs::Env e;
    e.comm = xirang_test::commOver(&link, 0, 1, {});
    e.comm.reducer = &reducer;
    e.out = &dev_out;
    // Managed memory: the cases fill and read buffers on the host while the stream is idle.
    e.alloc = [&mem](size_t b) {
      void* p = nullptr;
      cudaOk(cudaMallocManaged(&p, b + 1), "cudaMallocManaged");
      std::memset(p, 0, b + 1);
      mem.push_back(p);
      return static_cast<uint8_t*>(p);
    };
    e.finish = [&link, &deadline] { link.synchronize(deadline()); };
    try {
      cs::allCollectives(e);
      e.finish();
    } catch (...) {
      for (void* p : mem) (void)cudaFree(p);
      throw;
    }
    for (void* p : mem) (void)cudaFree(p);
  } catch (const std::exception& ex) {
    err = ex.what();
  }
  size_t bad = 0;
  for (size_t k = 0; k < host_out.size() && k < dev_out.size(); ++k) bad += host_out[k] != dev_out[k];
  report(err.empty() && !host_out.empty() && host_out.size() == dev_out.size() && bad == 0,
         "every collective over one-rank NCCL + GPU kernels == host engine: " +
             (err.empty() ? std::to_string(dev_out.size()) + " results, " + std::to_string(bad) + " differ"
                          : err));
  if (comm) (void)api->commDestroy(comm);

  // ncclCommAbort of a live communicator returns (the link's abort path).
  const auto id2 = tp::shareNcclUniqueId(*api, store, "xirang/gpu_check/1/nccl_uid", 0, deadline());
  dv::NcclComm c2 = tp::initNcclComm(*api, id2, 0, 1, deadline(), "gpu_check_abort");
  report(api->commAbort(c2) == dv::kNcclSuccess, "ncclCommAbort of a one-rank communicator");
  (void)cuda.streamDestroy(stream);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if (what != "kernels" && what != "nccl") {
    std::fprintf(stderr, "usage: device_checks kernels|nccl\n");
    return 2;
  }
  try {
    int devices = 0;
    cudaOk(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (what == "kernels") kernels();
    else nccl();
  } catch (const std::exception& e) {
    report(false, what + ": " + e.what());
  }
  std::printf("device_checks: %s: %d failed\n", what.c_str(), failures);
  return failures;
}
