// pybind11 module xirang._C, built with torch's bundled pybind11. ProcessGroupXirang is bound
// with torch's c10d Backend as its base, so torch sees a real Backend and
// pg._get_backend(device) returns it.
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/process_group_xirang.h"
#include "core/codec.h"
#include "core/env.h"
#include "core/generation.h"
#include "core/ring.h"
#include "core/topology.h"
#ifdef XIRANG_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/codec_cuda.h"
#include "cuda/nccl_api.h"
#endif

namespace py = pybind11;

namespace {

// A record's field value as Python: numbers, str, bool, None for an unset optional, a list of
// dicts for the peers.
template <class T>
py::object toPython(const T& v) {
  return py::cast(v);
}
py::object toPython(const std::optional<double>& v) { return v ? py::cast(*v) : py::none(); }
template <class R>
py::dict fieldsToDict(const R& r);
py::object toPython(const std::vector<xirang::PeerRecord>& peers) {
  py::list out;
  for (const auto& p : peers) out.append(fieldsToDict(p));
  return out;
}
// One record as a dict, from its field table (backend/records.h).
template <class R>
py::dict fieldsToDict(const R& r) {
  py::dict d;
  xirang::forEachField(r, [&d](const char* name, const auto& v) { d[name] = toPython(v); });
  return d;
}

// Test hooks of the codec (kernel bits against the CPU codec): 1-D contiguous tensors, fp32 as
// float32 and bf16 as torch.bfloat16 (compare bits with .view(torch.int16)). CPU tensors run
// core/codec, CUDA tensors the kernels of csrc/cuda on the current stream.
void codecCheck(const at::Tensor& t, at::ScalarType dt, const char* what) {
  TORCH_CHECK(t.defined() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == dt, "xirang codec hook: ", what,
              " must be a 1-D contiguous ", dt, " tensor");
}

void codecDevices(std::initializer_list<const at::Tensor*> ts) {
  const auto dev = (*ts.begin())->device();
  for (auto* t : ts) {
    TORCH_CHECK(t->device() == dev, "xirang codec hook: all tensors must be on one device");
    TORCH_CHECK(t->numel() == (*ts.begin())->numel(), "xirang codec hook: all tensors must have the same numel");
  }
#ifndef XIRANG_WITH_CUDA
  TORCH_CHECK(!dev.is_cuda(), "xirang codec hook: CUDA tensor, but the CUDA path is not built in this xirang");
#endif
}

// Runs codec function FN on the device of tensor T: xirang::cuda::FN on the current stream for a
// CUDA tensor, xirang::codec::FN (core/codec) otherwise; the arguments are FN's, without the stream.
#ifdef XIRANG_WITH_CUDA
void cudaOk(cudaError_t e) { TORCH_CHECK(e == cudaSuccess, "xirang codec kernel launch: ", cudaGetErrorString(e)); }
#define XR_CODEC_RUN(T, FN, ...)                                                  \
  do {                                                                            \
    if ((T).is_cuda()) {                                                          \
      c10::cuda::CUDAGuard g((T).device());                                       \
      cudaOk(xirang::cuda::FN(__VA_ARGS__, c10::cuda::getCurrentCUDAStream()));   \
    } else {                                                                      \
      xirang::codec::FN(__VA_ARGS__);                                             \
    }                                                                             \
  } while (0)
#else
#define XR_CODEC_RUN(T, FN, ...) xirang::codec::FN(__VA_ARGS__)
#endif

uint16_t* bf(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// out = bf16(x)
at::Tensor codecEncode(const at::Tensor& x) {
  codecCheck(x, at::kFloat, "x");
  codecDevices({&x});
  at::Tensor out = at::empty_like(x, x.options().dtype(at::kBFloat16));
  XR_CODEC_RUN(x, encode, x.data_ptr<float>(), bf(out), x.numel());
  return out;
}

// out = f32(in)
at::Tensor codecDecode(const at::Tensor& in) {
  codecCheck(in, at::kBFloat16, "in");
  codecDevices({&in});
  at::Tensor out = at::empty_like(in, in.options().dtype(at::kFloat));
  XR_CODEC_RUN(in, decode, bf(in), out.data_ptr<float>(), in.numel());
  return out;
}

// acc += f32(in), in place
void codecDecodeAccumulate(const at::Tensor& in, at::Tensor& acc) {
  codecCheck(in, at::kBFloat16, "in");
  codecCheck(acc, at::kFloat, "acc");
  codecDevices({&in, &acc});
  XR_CODEC_RUN(in, decodeAccumulate, bf(in), acc.data_ptr<float>(), in.numel());
}

// (out, r_out) of encodeEF; r_out and out are new tensors unless given (aliases allowed as in codec.h).
std::pair<at::Tensor, at::Tensor> codecEncodeEF(const at::Tensor& x, double scale, const at::Tensor& r_in,
                                                std::optional<at::Tensor> r_out_opt, std::optional<at::Tensor> out_opt) {
  codecCheck(x, at::kFloat, "x");
  codecCheck(r_in, at::kFloat, "r_in");
  at::Tensor r_out = r_out_opt ? *r_out_opt : at::empty_like(x);
  at::Tensor out = out_opt ? *out_opt : at::empty_like(x, x.options().dtype(at::kBFloat16));
  codecCheck(r_out, at::kFloat, "r_out");
  codecCheck(out, at::kBFloat16, "out");
  codecDevices({&x, &r_in, &r_out, &out});
  const float sc = static_cast<float>(scale);
  XR_CODEC_RUN(x, encodeEF, x.data_ptr<float>(), sc, r_in.data_ptr<float>(), r_out.data_ptr<float>(), bf(out),
               x.numel());
  return {out, r_out};
}

// (out, r_out) of accumulateEncodeEF.
std::pair<at::Tensor, at::Tensor> codecAccumulateEncodeEF(const at::Tensor& in, const at::Tensor& x, double scale,
                                                          const at::Tensor& r_in, std::optional<at::Tensor> r_out_opt,
                                                          std::optional<at::Tensor> out_opt) {
  codecCheck(in, at::kBFloat16, "in");
  codecCheck(x, at::kFloat, "x");
  codecCheck(r_in, at::kFloat, "r_in");
  at::Tensor r_out = r_out_opt ? *r_out_opt : at::empty_like(x);
  at::Tensor out = out_opt ? *out_opt : at::empty_like(in);
  codecCheck(r_out, at::kFloat, "r_out");
  codecCheck(out, at::kBFloat16, "out");
  codecDevices({&in, &x, &r_in, &r_out, &out});
  const float sc = static_cast<float>(scale);
  XR_CODEC_RUN(x, accumulateEncodeEF, bf(in), x.data_ptr<float>(), sc, r_in.data_ptr<float>(),
               r_out.data_ptr<float>(), bf(out), x.numel());
  return {out, r_out};
}

#undef XR_CODEC_RUN

}  // namespace

static py::dict membershipDict(xirang::ProcessGroupXirang& pg) {
  auto m = pg.membership();
  py::dict d;
  d["epoch"] = m.epoch;
  d["live"] = m.live;
  d["ring"] = m.ring;
  d["world_size"] = pg.getSize();
  d["recoveries"] = m.recoveries;
  d["last_recovery_s"] = m.last_recovery_s;
  d["last_agreement_s"] = m.last_agreement_s;
  d["last_failure"] = m.last_failure;
  d["source"] = m.source;
  return d;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "xirang: torch.distributed backend with a BF16 error-feedback ring (C++ core)";
  py::module_::import("torch.distributed");

  m.attr("TORCH_VERSION_COMPILED") = std::string(TORCH_VERSION);
#if defined(__clang__)
  m.attr("COMPILER") = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  m.attr("COMPILER") = std::string("gcc ") + __VERSION__;
#else
  m.attr("COMPILER") = std::string("unknown");
#endif
#ifdef XIRANG_WITH_CUDA
  m.attr("CUDA_BUILT") = true;
#else
  m.attr("CUDA_BUILT") = false;
#endif

  py::register_exception<xirang::MembershipChanged>(m, "MembershipChanged", PyExc_RuntimeError);

  // Codec test hooks (tests/gpu/check_kernels.py): CPU tensors -> core/codec, CUDA -> kernels.
  m.def("_codec_encode", &codecEncode, py::arg("x"));
  m.def("_codec_decode", &codecDecode, py::arg("input"));
  m.def("_codec_decode_accumulate", &codecDecodeAccumulate, py::arg("input"), py::arg("acc"));
  m.def("_codec_encode_ef", &codecEncodeEF, py::arg("x"), py::arg("scale"), py::arg("r_in"),
        py::arg("r_out") = py::none(), py::arg("out") = py::none());
  m.def("_codec_accumulate_encode_ef", &codecAccumulateEncodeEF, py::arg("input"), py::arg("x"), py::arg("scale"),
        py::arg("r_in"), py::arg("r_out") = py::none(), py::arg("out") = py::none());

  m.def("nccl_version", []() -> py::object {
#ifdef XIRANG_WITH_CUDA
        const std::string v = xirang::cuda::ncclVersionString();
        if (!v.empty()) return py::str(v);
#endif
        return py::none();
      },
      "The version ('2.27.3') of the libnccl.so.2 xirang loaded (cuda/nccl_api.h), or None: a build without "
      "the CUDA path, or no NCCL loaded yet (it loads at the creation of a group with XIRANG_CUDA_TRANSPORT=nccl, or at the first CUDA collective of one with auto).");
  m.def("_shutdown_for_exit", [] { xirang::ProcessGroupXirang::shutdownAllForExit(std::chrono::seconds(5)); },
        py::call_guard<py::gil_scoped_release>(),
        "Registered with atexit when xirang._C loads: shuts every live xirang group down (aborts one with "
        "operations pending) and drains the completion threads (at most 5 s), so that no xirang thread "
        "touches Python objects while the interpreter finalizes (ProcessGroupXirang::shutdownAllForExit).");
  py::module_::import("atexit").attr("register")(m.attr("_shutdown_for_exit"));
  m.def("codec_path", [] { return std::string(xirang::codec::pathName(xirang::codec::activePath())); },
        "Name of the codec path in use: 'avx512bf16', 'avx2' or 'scalar' (XIRANG_CODEC overrides).");
  m.def("env_knobs", [] {
    py::list out;
    for (const auto& k : xirang::env::knobs())
      out.append(py::make_tuple(k.name, k.default_value, k.help, xirang::env::typeName(k.type),
                                xirang::env::readName(k.read)));
    return out;
  }, "Every XIRANG_* knob as (name, default, help, type, read), in declaration order. type: 'string',\n"
     "'int', 'float' or 'bool'; read: when it is read: 'process' (first use, then cached), 'group' (each\n"
     "group creation), 'op' (each operation) or 'call' (each call of the function its help names).");
  // Python reads its knobs through these, so that each knob's default and parsing live once, in
  // core/env.cc. Bad values raise ValueError (std::invalid_argument) naming the knob.
  m.def("env_get", [](const std::string& name) { return xirang::env::get(name.c_str()); }, py::arg("name"),
        "A declared XIRANG_* knob's value: the environment's if set and non-empty, else its default.");
  m.def("env_bool", [](const std::string& name) { return xirang::env::getBool(name.c_str()); }, py::arg("name"),
        "A declared boolean knob: 1/true/yes/on or 0/false/no/off (case-insensitive); else ValueError.");
  m.def("env_int", [](const std::string& name) { return xirang::env::getInt(name.c_str()); }, py::arg("name"),
        "A declared int knob (K/M/G suffixes: powers of 1024; unset and no default: 0); ValueError otherwise.");
  m.def("env_double", [](const std::string& name) { return xirang::env::getDouble(name.c_str()); }, py::arg("name"),
        "A declared float knob as a float; ValueError if it is not a number.");
  m.def("check_settings", &xirang::checkSettings, py::arg("algorithm") = "auto",
        "Parses and range-checks every knob a group reads on this rank alone (backend/config.h:\n"
        "checkSettings), as the group will read it; `algorithm`: Options.algorithm. ValueError naming\n"
        "the knob and the value. The group's creator calls it before the ranks exchange labels.");
  m.def("env_log_level", [] {
    static const char* names[] = {"WARN", "INFO", "TRACE"};
    return std::string(names[static_cast<int>(xirang::env::parseLogLevel())]);
  }, "XIRANG_DEBUG now: 'WARN', 'INFO' or 'TRACE'; ValueError naming the accepted values otherwise.");
  m.def("generation", [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
                         bool join, const std::string& group_name) {
    return xirang::ProcessGroupXirang::agreeGeneration(
        store, rank, size, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0)), join, group_name);
  }, py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("join") = false,
        py::arg("group_name") = "", py::call_guard<py::gil_scoped_release>(),
        "The generation of the group being created (16 hex digits): a handshake every rank of the\n"
        "creation runs through `store` (rank 0 draws it), or with join=True the live group's. Pass it\n"
        "to ProcessGroupXirang(generation=...); the group's store keys live under key_namespace(it).\n"
        "Waits at most timeout_s seconds; RuntimeError naming the ranks that never answered.");
  m.def("key_namespace", &xirang::generation::keyNamespace, py::arg("generation"),
        "The store key namespace of a generation: 'xirang/<generation>'.");
  m.def("ring_allreduce_elements_sent", &xirang::ring::replayAllreduceSent, py::arg("numel"), py::arg("world_size"),
        "Replay of the ring schedule: elements each ring position sends in one allreduce of numel elements.");
  m.def("ring_order", [](const std::vector<std::tuple<int, std::string, std::string>>& labels, bool topology) {
    std::vector<xirang::topology::RankLabel> ls;
    for (auto& [rank, host, rack] : labels) ls.push_back({rank, host, rack, 0});
    xirang::topology::assignLocalRanks(ls);
    return xirang::topology::ringOrder(ls, topology ? xirang::topology::RingOrder::Topology
                                                    : xirang::topology::RingOrder::Rank);
  }, py::arg("labels"), py::arg("topology") = true,
        "Ring order from (rank, host, rack) labels: sorted by (rack, host, rank), or rank order.");

  py::class_<xirang::ProcessGroupXirang, c10d::Backend, c10::intrusive_ptr<xirang::ProcessGroupXirang>>(
      m, "ProcessGroupXirang",
      "c10d Backend of the 'xirang' torch.distributed backend. Create it through\n"
      "torch.distributed.init_process_group(backend='xirang') after `import xirang`.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s,
                       const std::string& group_name, const std::string& algorithm, std::vector<int> ring,
                       std::vector<std::string> hosts, std::vector<std::string> racks, int global_rank,
                       const std::string& stats_dir, const std::string& run_id, bool elastic,
                       std::optional<double> heartbeat_s, bool join, const std::string& generation) {
             xirang::XirangConfig cfg;
             cfg.group_name = group_name;
             cfg.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
             cfg.algorithm = algorithm;
             cfg.ring = std::move(ring);
             cfg.hosts = std::move(hosts);
             cfg.racks = std::move(racks);
             cfg.global_rank = global_rank;
             cfg.stats_dir = stats_dir;
             cfg.run_id = run_id;
             cfg.elastic = elastic;
             cfg.heartbeat_s = heartbeat_s ? *heartbeat_s : xirang::env::getDouble("XIRANG_HEARTBEAT_S");
             cfg.join = join;
             cfg.generation = generation;
             return c10::make_intrusive<xirang::ProcessGroupXirang>(store, rank, size, cfg);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("group_name") = "",
           py::arg("algorithm") = "auto", py::arg("ring") = std::vector<int>{},
           py::arg("hosts") = std::vector<std::string>{}, py::arg("racks") = std::vector<std::string>{},
           py::arg("global_rank") = 0, py::arg("stats_dir") = "", py::arg("run_id") = "",
           py::arg("elastic") = false, py::arg("heartbeat_s") = py::none(), py::arg("join") = false,
           py::arg("generation") = "", py::call_guard<py::gil_scoped_release>(),
           "Create the backend of one group: store (c10d Store, prefixed per group by torch), group rank and\n"
           "size, timeout in seconds, ring order (group ranks; empty = rank order), host/rack label per rank,\n"
           "elastic mode, its heartbeat period in seconds (None: XIRANG_HEARTBEAT_S), join (a spare taking rank `rank`'s place:\n"
           "blocks until the live ranks admit it) and the creation's generation (generation(); empty:\n"
           "the constructor runs that handshake itself).")
      .def("allreduce_ef", &xirang::ProcessGroupXirang::allreduceEF, py::arg("buffer"), py::arg("residual"),
           py::arg("staged_residual"), py::arg("group_id") = -1, py::arg("label") = "",
           py::arg("plain") = std::vector<at::Tensor>{}, py::arg("wire") = "bf16",
           py::arg("pack_into") = std::vector<at::Tensor>{}, py::arg("pack_from") = std::vector<at::Tensor>{},
           py::call_guard<py::gil_scoped_release>(),
           "One layer group's reduction, on the communication thread: error-feedback allreduce (average)\n"
           "of a 1-D float32 buffer, then the average of each `plain` tensor in its own dtype.\n"
           "wire: 'bf16' (the compressed ring), 'fp16' or 'int8' (the direct form: codes plus one fp32\n"
           "scale per 1024 elements, summed in fp32 at each chunk's owner). residual (float32, same\n"
           "numel) is read; the new residual is written to staged_residual. pack_into / pack_from (CPU):\n"
           "first pack_into[i].copy_(pack_from[i]) on the communication thread, each pack_into[i] a\n"
           "contiguous view of buffer or a plain tensor (the hook's packing; timed as the record's\n"
           "pack_s). Returns a Work; its future's value is [buffer, *plain], bitwise equal on all\n"
           "ranks. RuntimeError for an unknown wire or a bad pack pair.")
      .def("records", [](xirang::ProcessGroupXirang& pg) {
        py::list out;
        for (const auto& r : pg.records()) out.append(fieldsToDict(r));
        return out;
      }, "This rank's operation records, oldest first (bounded by XIRANG_STATS_CAPACITY).")
      .def("clear_records", &xirang::ProcessGroupXirang::clearRecords)
      .def("record_cost", [](xirang::ProcessGroupXirang& pg) {
        const auto c = pg.recordCost();
        py::dict d;
        d["records"] = c.records;
        d["ns"] = c.ns;
        d["on"] = pg.recordsOn();
        return d;
      }, "What keeping the records has cost this group so far: records (built), ns (spent building and\n"
         "storing them, JSON lines included), on (False: created with XIRANG_STATS=0).")
      .def_property_readonly("ring", &xirang::ProcessGroupXirang::ringOrder)
      .def_property_readonly("address", &xirang::ProcessGroupXirang::address)
      .def_property_readonly("shm_ranks", &xirang::ProcessGroupXirang::shmRanks,
                             "group ranks whose collectives go through this rank's shared-memory domain "
                             "(XIRANG_TRANSPORT_LOCAL; empty: none)")
      .def_property_readonly("sequence_number", &xirang::ProcessGroupXirang::sequenceNumber)
      .def_property_readonly("elastic", &xirang::ProcessGroupXirang::elastic)
      .def_property_readonly("generation", &xirang::ProcessGroupXirang::generation,
                             "This creation's generation: the group's store keys live under 'xirang/<generation>'.")
      .def("membership", &membershipDict, "Elastic membership: epoch, live (group ranks), ring, world_size, recoveries, last_recovery_s,\n"
         "last_agreement_s (seconds) and last_failure (the reason recorded).")
      .def("admit_joiners", &xirang::ProcessGroupXirang::admitJoiners, py::arg("expect") = 0,
           py::arg("wait_s") = 0.0, py::call_guard<py::gil_scoped_release>(),
           "Collective over the live ranks at a step boundary: admit waiting spares (XIRANG_JOIN=1) if at\n"
           "least `expect` are waiting (the lowest live rank waits up to wait_s seconds). Returns a Work.")
      .def("set_membership_callback", [](xirang::ProcessGroupXirang& pg, py::object fn) {
        if (fn.is_none()) {
          pg.setMembershipCallback(nullptr);
          return;
        }
        // Held with the GIL: the callable is released on the caller's (Python) thread or under
        // the GIL on the communication thread.
        auto held = std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* o) {
          py::gil_scoped_acquire g;
          delete o;
        });
        auto* self = &pg;  // the callback lives inside pg
        pg.setMembershipCallback([held, self] {
          py::gil_scoped_acquire g;
          try {
            (*held)(membershipDict(*self));
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("xirang membership callback");
          }
        });
      }, py::arg("fn"), "fn(membership dict) runs on the communication thread (with the GIL) after each ring rebuild.");
}
