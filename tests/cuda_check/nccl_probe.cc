// tests/cuda_build.sh (section 3b): loads NCCL through csrc/cuda/nccl_api (dlopen, no NCCL symbol
// linked) and prints what it found, or why nothing was usable. Needs no GPU: ncclGetVersion
// does not touch CUDA.
//
//     nccl_probe            prints "nccl <version> <path>" (exit 0) or "unavailable: <why>" (exit 1)
#include <cstdio>
#include <string>

#include "cuda/nccl_api.h"

int main() {
  if (!xirang::cuda::ncclVersionString().empty()) {
    std::printf("loaded before the first call\n");  // the version must be "" until a load
    return 2;
  }
  std::string why;
  xirang::device::NcclApi* api = xirang::cuda::tryNcclApi(&why);
  if (!api) {
    std::printf("unavailable: %s\n", why.c_str());
    return 1;
  }
  int v = 0;
  if (api->getVersion(&v) != xirang::device::kNcclSuccess || v < xirang::cuda::kMinNcclVersion) return 3;
  std::printf("nccl %s %s\n", xirang::cuda::ncclVersionString().c_str(), xirang::cuda::ncclLibraryPath().c_str());
  return 0;
}
