// NCCL loaded at run time: libnccl.so.2 is dlopen'ed into a table of function pointers
// (core/device/api.h: NcclApi), so that xirang links no NCCL symbol (`nm -D --undefined-only` of
// xirang._C shows none), `import xirang` and every CPU path work where the library is absent,
// and the CUDA path says why NCCL is unavailable instead of failing to load.
//
// Where the library is looked for, in order (the first that loads and is new enough wins):
//   1. XIRANG_NCCL_LIBRARY (core/env.cc), a path or a file name: only that;
//   2. the libnccl.so.2 this process already has loaded (torch's libtorch_cuda.so needs it, so
//      after `import torch` with CUDA this is torch's own copy: one NCCL in the process);
//   3. torch's nvidia-nccl wheel as torch's RPATH finds it: <dir of the loaded libtorch_cuda.so
//      or libc10_cuda.so>/../../nvidia/nccl/lib/libnccl.so.2, then the same relative to
//      xirang/_C (site-packages/nvidia/nccl/lib/libnccl.so.2);
//   4. "libnccl.so.2" through the dynamic loader's path (LD_LIBRARY_PATH, ld.so.cache).
// Compiled against the wheel's nccl.h (setup.py finds it next to torch); the table checks at
// load time that the library is at least kMinNcclVersion (non-blocking communicators with
// ncclCommInitRankConfig, ncclCommAbort and ncclGetLastError) and has every symbol it needs.
#pragma once

#include <string>

#include "core/device/api.h"

namespace xirang::cuda {

constexpr int kMinNcclVersion = 21400;  // 2.14.0

// The table, loading the library on the first call (once per process, thread-safe). Throws
// std::runtime_error when no usable library was found: the message names every path tried and
// why it was refused (not found, dlopen's error, too old, a missing symbol).
device::NcclApi& ncclApi();
// Non-throwing form: the table, or nullptr with the same message in *why.
device::NcclApi* tryNcclApi(std::string* why);
// The loaded library's version ("2.30.7") and file; "" before the first ncclApi()/tryNcclApi()
// call and when no library could be loaded (these never load it).
std::string ncclVersionString();
std::string ncclLibraryPath();

}  // namespace xirang::cuda
