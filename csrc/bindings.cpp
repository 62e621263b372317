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
#include "core/ring.h"
#include "core/topology.h"

namespace py = pybind11;

namespace {

py::dict recordToDict(const xirang::OpRecord& r) {
  py::dict d;
  d["seq"] = r.seq;
  d["op"] = r.op;
  d["algorithm"] = r.algorithm;
  d["group_id"] = r.group_id;
  d["dtype"] = r.dtype;
  d["numel"] = r.numel;
  d["bytes_raw"] = r.bytes_raw;
  d["bytes_wire"] = r.bytes_wire;
  d["t_enqueue"] = r.t_enqueue;
  d["queued_s"] = r.queued_s;
  d["encode_s"] = r.encode_s;
  d["scatter_reduce_s"] = r.scatter_reduce_s;
  d["allgather_s"] = r.allgather_s;
  d["decode_s"] = r.decode_s;
  d["total_s"] = r.total_s;
  d["ok"] = r.ok;
  d["label"] = r.label;
  d["bytes_cross_host"] = r.bytes_cross_host;
  d["bytes_cross_rack"] = r.bytes_cross_rack;
  py::list peers;
  for (const auto& p : r.peers) {
    py::dict pd;
    pd["peer"] = p.peer;
    pd["send_s"] = p.send_s;
    pd["recv_s"] = p.recv_s;
    pd["bytes_sent"] = p.bytes_sent;
    pd["bytes_recv"] = p.bytes_recv;
    peers.append(pd);
  }
  d["peers"] = peers;
  return d;
}

}  // namespace

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
  m.attr("CUDA_BUILT") = false;

  m.def("codec_path", [] { return std::string(xirang::codec::pathName(xirang::codec::activePath())); },
        "Name of the codec path in use: 'avx512bf16', 'avx2' or 'scalar' (XIRANG_CODEC overrides).");
  m.def("env_knobs", [] {
    py::list out;
    for (const auto& k : xirang::env::knobs()) out.append(py::make_tuple(k.name, k.default_value, k.help));
    return out;
  }, "Every XIRANG_* knob as (name, default, help), in declaration order.");
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
                       const std::string& stats_dir, const std::string& run_id) {
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
             return c10::make_intrusive<xirang::ProcessGroupXirang>(store, rank, size, cfg);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"), py::arg("group_name") = "",
           py::arg("algorithm") = "auto", py::arg("ring") = std::vector<int>{},
           py::arg("hosts") = std::vector<std::string>{}, py::arg("racks") = std::vector<std::string>{},
           py::arg("global_rank") = 0, py::arg("stats_dir") = "", py::arg("run_id") = "",
           py::call_guard<py::gil_scoped_release>(),
           "Create the backend of one group: store (c10d Store, prefixed per group by torch), group rank and\n"
           "size, timeout in seconds, ring order (group ranks; empty = rank order), host/rack label per rank.")
      .def("allreduce_ef", &xirang::ProcessGroupXirang::allreduceBF16EF, py::arg("buffer"), py::arg("residual"),
           py::arg("staged_residual"), py::arg("group_id") = -1, py::arg("label") = "", py::call_guard<py::gil_scoped_release>(),
           "BF16 error-feedback ring allreduce (average) of a 1-D float32 buffer, on the communication thread.\n"
           "residual (float32, same numel) is read; the new residual is written to staged_residual.\n"
           "Returns a Work; work.get_future().value() == [buffer] holds the average, bitwise equal on all ranks.")
      .def("records", [](xirang::ProcessGroupXirang& pg) {
        py::list out;
        for (const auto& r : pg.records()) out.append(recordToDict(r));
        return out;
      }, "This rank's operation records, oldest first (bounded by XIRANG_STATS_CAPACITY).")
      .def("clear_records", &xirang::ProcessGroupXirang::clearRecords)
      .def_property_readonly("ring", &xirang::ProcessGroupXirang::ringOrder)
      .def_property_readonly("address", &xirang::ProcessGroupXirang::address)
      .def_property_readonly("sequence_number", &xirang::ProcessGroupXirang::sequenceNumber);
}
