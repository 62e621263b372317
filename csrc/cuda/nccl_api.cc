// NcclApi over a dlopen'ed libnccl.so.2: see nccl_api.h.
#include "cuda/nccl_api.h"

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <atomic>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "core/env.h"

#if defined(XIRANG_HAVE_NCCL_H)
#include <nccl.h>
#endif

namespace xirang::cuda {

namespace {

std::string dirOf(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

#if defined(XIRANG_HAVE_NCCL_H)

static_assert(device::kNcclSuccess == ncclSuccess);
static_assert(device::kNcclUnhandledCudaError == ncclUnhandledCudaError);
static_assert(device::kNcclSystemError == ncclSystemError);
static_assert(device::kNcclInternalError == ncclInternalError);
static_assert(device::kNcclInvalidArgument == ncclInvalidArgument);
static_assert(device::kNcclInvalidUsage == ncclInvalidUsage);
static_assert(device::kNcclRemoteError == ncclRemoteError);
static_assert(device::kNcclInProgress == ncclInProgress);
static_assert(sizeof(device::NcclUniqueId) == sizeof(ncclUniqueId));

// The functions the table uses, each once: X(Fns member, NCCL symbol).
#define XR_NCCL_FUNCTIONS(X)                                                                                \
  X(getVersion, ncclGetVersion) X(getErrorString, ncclGetErrorString) X(getLastError, ncclGetLastError)     \
  X(getUniqueId, ncclGetUniqueId) X(commInitRankConfig, ncclCommInitRankConfig) X(commAbort, ncclCommAbort) \
  X(commDestroy, ncclCommDestroy) X(commGetAsyncError, ncclCommGetAsyncError)                               \
  X(groupStart, ncclGroupStart) X(groupEnd, ncclGroupEnd) X(send, ncclSend) X(recv, ncclRecv)

// The signatures, from nccl.h.
struct Fns {
#define XR_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
  XR_NCCL_FUNCTIONS(XR_MEMBER)
#undef XR_MEMBER
};

inline ncclComm_t cm(device::NcclComm c) { return reinterpret_cast<ncclComm_t>(c); }
inline cudaStream_t st(device::Stream s) { return reinterpret_cast<cudaStream_t>(s); }

class Library : public device::NcclApi {
 public:
  Library(void* handle, const Fns& f, int version, std::string path)
      : handle_(handle), f_(f), version_(version), path_(std::move(path)) {}
  const char* name() const override { return "nccl"; }
  const char* errorString(int r) override { return f_.getErrorString(static_cast<ncclResult_t>(r)); }
  std::string lastError(device::NcclComm comm) override {
    const char* s = f_.getLastError(cm(comm));
    return s ? s : "";
  }
  int getVersion(int* v) override { return f_.getVersion(v); }
  int getUniqueId(device::NcclUniqueId* id) override {
    return f_.getUniqueId(reinterpret_cast<ncclUniqueId*>(id->internal));
  }
  int commInitRankConfig(device::NcclComm* comm, int nranks, const device::NcclUniqueId& id, int rank,
                         const device::NcclConfig& config) override {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = config.blocking ? 1 : 0;
    if (!config.comm_name.empty()) c.commName = config.comm_name.c_str();  // copied by NCCL during the call
    ncclUniqueId u;
    std::memcpy(&u, id.internal, sizeof u);
    ncclComm_t out = nullptr;
    const ncclResult_t r = f_.commInitRankConfig(&out, nranks, u, rank, &c);
    *comm = reinterpret_cast<device::NcclComm>(out);
    return r;
  }
  int commAbort(device::NcclComm comm) override { return f_.commAbort(cm(comm)); }
  int commDestroy(device::NcclComm comm) override { return f_.commDestroy(cm(comm)); }
  int commGetAsyncError(device::NcclComm comm, int* async_error) override {
    ncclResult_t a = ncclSuccess;
    const ncclResult_t r = f_.commGetAsyncError(cm(comm), &a);
    *async_error = a;
    return r;
  }
  int groupStart() override { return f_.groupStart(); }
  int groupEnd() override { return f_.groupEnd(); }
  int send(const void* buf, size_t bytes, int peer, device::NcclComm comm, device::Stream stream) override {
    return f_.send(buf, bytes, ncclUint8, peer, cm(comm), st(stream));
  }
  int recv(void* buf, size_t bytes, int peer, device::NcclComm comm, device::Stream stream) override {
    return f_.recv(buf, bytes, ncclUint8, peer, cm(comm), st(stream));
  }
  int version() const { return version_; }
  const std::string& path() const { return path_; }

 private:
  void* handle_;  // never dlclose'd: communicators may outlive any owner
  Fns f_;
  int version_;
  std::string path_;
};

// Where libtorch_cuda.so / libc10_cuda.so are loaded from, if they are.
std::vector<std::string> torchLibDirs() {
  std::vector<std::string> out;
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        const char* name = info->dlpi_name;
        if (name && *name) {
          const std::string s(name);
          const std::string base = s.substr(s.rfind('/') + 1);
          if (base == "libtorch_cuda.so" || base == "libc10_cuda.so")
            static_cast<std::vector<std::string>*>(data)->push_back(dirOf(s));
        }
        return 0;
      },
      &out);
  return out;
}

std::string ownDir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&torchLibDirs), &info) && info.dli_fname) return dirOf(info.dli_fname);
  return "";
}

std::string versionString(int v) {
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9; X*1000 + Y*100 + Z before.
  const int major = v >= 10000 ? v / 10000 : v / 1000;
  const int minor = v >= 10000 ? (v / 100) % 100 : (v / 100) % 10;
  const int patch = v % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// Tries one candidate: a Library, or nullptr and why not appended to *log.
Library* tryLoad(const std::string& what, const std::string& file, int flags, std::string* log) {
  dlerror();
  void* h = dlopen(file.c_str(), flags);
  if (!h) {
    const char* e = dlerror();
    if (flags & RTLD_NOLOAD) *log += "\n  " + what + ": not loaded";
    else *log += "\n  " + what + " (" + file + "): " + (e ? e : "dlopen failed");
    return nullptr;
  }
  Fns f;
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
#define XR_SYM(member, symbol) sym(f.member, #symbol);
  XR_NCCL_FUNCTIONS(XR_SYM)
#undef XR_SYM
  std::string path = file;
  Dl_info info;
  if (f.getVersion && dladdr(reinterpret_cast<void*>(f.getVersion), &info) && info.dli_fname) path = info.dli_fname;
  int v = 0;
  if (f.getVersion && f.getVersion(&v) != ncclSuccess) v = 0;
  if (!missing.empty() || v < kMinNcclVersion) {
    *log += "\n  " + what + " (" + path + "): version " + (v ? versionString(v) : std::string("unknown")) +
            (v < kMinNcclVersion ? ", older than the " + versionString(kMinNcclVersion) + " xirang needs" : "") +
            (missing.empty() ? "" : "; missing " + missing);
    return nullptr;  // not dlclose'd: it may be torch's copy
  }
  return new Library(h, f, v, path);
}

#endif  // XIRANG_HAVE_NCCL_H

std::once_flag gOnce;
device::NcclApi* gApi = nullptr;
std::string gWhy, gVersion, gPath;
std::atomic<bool> gLoaded{false};  // load() has run

void load() {
#if !defined(XIRANG_HAVE_NCCL_H)
  gWhy = "this xirang was built without nccl.h (torch's nvidia-nccl wheel was not found at build time)";
#else
  std::string log;
  Library* lib = nullptr;
  const std::string forced = env::get("XIRANG_NCCL_LIBRARY");
  if (!forced.empty()) {
    lib = tryLoad("XIRANG_NCCL_LIBRARY", forced, RTLD_NOW | RTLD_LOCAL, &log);
  } else {
    lib = tryLoad("libnccl.so.2 already loaded in this process", "libnccl.so.2", RTLD_NOW | RTLD_NOLOAD, &log);
    std::vector<std::string> cands;
    for (const auto& d : torchLibDirs()) cands.push_back(d + "/../../nvidia/nccl/lib/libnccl.so.2");
    const std::string own = ownDir();
    if (!own.empty()) cands.push_back(own + "/../nvidia/nccl/lib/libnccl.so.2");
    for (size_t i = 0; !lib && i < cands.size(); ++i) {
      if (::access(cands[i].c_str(), R_OK) != 0) {
        log += "\n  torch's nvidia-nccl wheel (" + cands[i] + "): no such file";
        continue;
      }
      lib = tryLoad("torch's nvidia-nccl wheel", cands[i], RTLD_NOW | RTLD_LOCAL, &log);
    }
    if (!lib) lib = tryLoad("the dynamic loader's search path", "libnccl.so.2", RTLD_NOW | RTLD_LOCAL, &log);
  }
  if (lib) {
    gApi = lib;
    gVersion = versionString(lib->version());
    gPath = lib->path();
  } else {
    gWhy = "no usable NCCL library (libnccl.so.2 >= " + versionString(kMinNcclVersion) + ") was found; tried:" + log +
           "\n(set XIRANG_NCCL_LIBRARY to the library's path)";
  }
#endif
  gLoaded.store(true, std::memory_order_release);
}

}  // namespace

device::NcclApi* tryNcclApi(std::string* why) {
  std::call_once(gOnce, load);
  if (!gApi && why) *why = gWhy;
  return gApi;
}

device::NcclApi& ncclApi() {
  std::string why;
  device::NcclApi* api = tryNcclApi(&why);
  if (!api) throw std::runtime_error("xirang: " + why);
  return *api;
}

std::string ncclVersionString() { return gLoaded.load(std::memory_order_acquire) ? gVersion : std::string(); }

std::string ncclLibraryPath() { return gLoaded.load(std::memory_order_acquire) ? gPath : std::string(); }

}  // namespace xirang::cuda
