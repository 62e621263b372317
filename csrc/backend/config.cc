#include "backend/config.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>

#include "backend/records.h"
#include "core/codec.h"
#include "core/env.h"
#include "core/topology.h"
#include "core/transport/auth.h"
#include "core/transport/frame.h"
#include "core/transport/socket.h"

namespace xirang {

std::chrono::microseconds spinKnob() {
  const int64_t spin = env::getInt("XIRANG_SPIN_US");
  if (spin < 0 || spin > 10000)
    throw std::invalid_argument("xirang: XIRANG_SPIN_US=" + std::to_string(spin) + " must be 0 to 10000 microseconds");
  return std::chrono::microseconds(spin);
}

Comm configure(int rank, int size, const XirangConfig& cfg, std::string& algo) {
  Comm comm;
  comm.rank = rank;
  if (cfg.ring.empty()) {
    for (int r = 0; r < size; ++r) comm.ring.push_back(r);
  } else {
    TORCH_CHECK(static_cast<int>(cfg.ring.size()) == size, "xirang: ring order has ", cfg.ring.size(),
                " entries for world size ", size);
    comm.ring = cfg.ring;
  }
  comm.segment_bytes = env::getInt("XIRANG_SEGMENT_BYTES");
  comm.small_bytes = env::getInt("XIRANG_SMALL_BYTES");
  TORCH_CHECK(comm.segment_bytes >= 4096, "xirang: XIRANG_SEGMENT_BYTES=", comm.segment_bytes,
              " is too small (at least 4096 bytes; default ", env::knob("XIRANG_SEGMENT_BYTES").default_value, ")");
  // Scratch buffers are a segment each, whatever the message: 64 GiB made every op fail with
  // std::bad_alloc after the group was created.
  TORCH_CHECK(comm.segment_bytes <= (int64_t{1} << 28), "xirang: XIRANG_SEGMENT_BYTES=", comm.segment_bytes,
              " is too large (at most 268435456 bytes = 256 MiB; default ",
              env::knob("XIRANG_SEGMENT_BYTES").default_value, ")");
  TORCH_CHECK(comm.small_bytes >= 0, "xirang: XIRANG_SMALL_BYTES=", comm.small_bytes, " must be >= 0");
  algo = cfg.algorithm == "auto" ? env::get("XIRANG_ALGO") : cfg.algorithm;
  if (algo == "ring") comm.algo = Comm::Algo::Ring;
  else if (algo == "direct") comm.algo = Comm::Algo::Direct;
  else if (algo == "two_level") comm.algo = Comm::Algo::TwoLevel;
  else if (algo == "auto") comm.algo = Comm::Algo::Auto;
  else TORCH_CHECK(false, "xirang: XIRANG_ALGO/algorithm must be auto, ring, direct or two_level, got '", algo, "'");
  if (static_cast<int>(cfg.hosts.size()) == size && size > 1) {
    std::vector<topology::RankLabel> labels;
    for (int r = 0; r < size; ++r)
      labels.push_back({r, cfg.hosts[r], r < static_cast<int>(cfg.racks.size()) ? cfg.racks[r] : "", 0});
    topology::assignLocalRanks(labels);
    auto plan = topology::twoLevelPlan(labels, /*by_rack=*/false);
    if (plan.valid && plan.local_groups.size() > 1 && plan.local_groups[0].size() > 1) {
      for (auto& lg : plan.local_groups)
        if (std::find(lg.begin(), lg.end(), rank) != lg.end()) comm.local_group = lg;
      for (auto& cg : plan.cross_groups)
        if (std::find(cg.begin(), cg.end(), rank) != cg.end()) comm.cross_group = cg;
    } else if (algo == "two_level" || algo == "auto") {
      env::log(env::Level::Info, rank,
               "two-level allreduce unavailable (" +
                   (plan.valid ? std::string("one host or one rank per host") : plan.reason) + "): using the ring");
    }
  }
  return comm;
}

void checkSettings(const std::string& algorithm) {
  try {
    XirangConfig cfg;
    cfg.algorithm = algorithm;
    std::string algo;
    configure(0, 1, cfg, algo);
    env::getBool("XIRANG_STATS");
    statsCapacityKnob();
    codec::activePath();  // a process knob: read at its first use, which may be this
    spinKnob();
    const int64_t handshake = env::getInt("XIRANG_HANDSHAKE_TIMEOUT_MS");
    if (handshake <= 0)
      throw std::invalid_argument("xirang: XIRANG_HANDSHAKE_TIMEOUT_MS=" + std::to_string(handshake) +
                                  " must be > 0 milliseconds");
    // A process knob of the TCP exchange, read at the first large send: checked here so that a bad
    // value fails group creation instead of that op.
    const int64_t send_thread = env::getInt("XIRANG_SEND_THREAD_BYTES");
    if (send_thread < 0)
      throw std::invalid_argument("xirang: XIRANG_SEND_THREAD_BYTES=" + std::to_string(send_thread) +
                                  " must be >= 0 bytes (0: never a send thread)");
    // Read by the CUDA engine (cuda/cuda_stage.cc) of a CUDA build only: every build checks it.
    const std::string cuda = env::get("XIRANG_CUDA_TRANSPORT");
    if (cuda != "auto" && cuda != "host" && cuda != "mirror" && cuda != "nccl")
      throw std::invalid_argument("xirang: XIRANG_CUDA_TRANSPORT must be auto, host, mirror or nccl, got '" +
                                  cuda.substr(0, 64) + "'");
#ifndef XIRANG_WITH_CUDA
    static std::once_flag said;
    if (cuda == "nccl")
      std::call_once(said, [] {
        env::log(env::Level::Warn, -1,
                 "XIRANG_CUDA_TRANSPORT=nccl has no effect: this xirang was built without its CUDA path, so its groups "
                 "take no CUDA tensors (use \"cpu:xirang,cuda:nccl\" for torch's NCCL backend, or build xirang with CUDA)");
      });
#endif
    // The test-only knobs, read at their first use: a typo fails here, not silently later.
    const int64_t delay = env::getInt("XIRANG_TEST_DELAY_MS");
    if (delay < 0 || delay > 600000)
      throw std::invalid_argument("xirang: XIRANG_TEST_DELAY_MS=" + std::to_string(delay) +
                                  " must be 0 to 600000 milliseconds");
    (void)transport::dieAfterSegmentsKnob();
    const std::string die = env::get("XIRANG_TEST_DIE_IN_REBUILD");
    // elastic.cc compares it with the rank's decimal text: no sign, no leading zero
    if (!die.empty() && (die.size() > 9 || (die.size() > 1 && die[0] == '0') ||
                         !std::all_of(die.begin(), die.end(), [](char c) { return c >= '0' && c <= '9'; })))
      throw std::invalid_argument("xirang: XIRANG_TEST_DIE_IN_REBUILD='" + die.substr(0, 64) +
                                  "' must be empty or a group rank (an integer >= 0, no leading zero)");
    const std::string key_file = env::get("XIRANG_AUTH_KEY_FILE");
    if (!key_file.empty()) transport::loadKeyFile(key_file);
    const std::string ifname = env::get("XIRANG_SOCKET_IFNAME");
    if (!ifname.empty()) {  // the transport's own bind, on a port of its own, closed again
      std::string address;
      ::close(transport::listenOnInterface(ifname, &address));
    }
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const c10::Error& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::invalid_argument(e.what());
  }
}

}  // namespace xirang
