// A group's generation: a random id that group rank 0 draws each time the group is created and
// every rank of that creation learns through the c10d store. Every store key of the group lives
// under keyNamespace(generation), so the keys of one creation never meet another's on a store that
// outlives it (torchrun's restarts share the agents' store across attempts: the previous
// attempt's abort, secret and addresses are still there, #15 item 21).
//
// Why not a counter: torchrun's TORCHELASTIC_RESTART_COUNT differs between nodes (an agent that
// restarts because another node's worker failed does not count it), and a shared counter taken
// with store.add is off once an attempt died part-way through its increments. Instead rank 0
// answers each rank's fresh nonce with the generation; a stale answer never carries a fresh
// nonce, so nobody proceeds with an old generation.
//
// Store keys, under kPrefix:
//   hello/<r>       rank r's nonce (r != 0), fresh in every creation
//   answer/<r>      rank 0's answer to rank r: "<nonce> <generation>"
//   ack/<G>/<r>     rank r learned generation G (rank 0 answers rank r until it exists)
//   live            the generation of the group created last (written by rank 0 once every rank
//                   learned it): an elastic spare (XIRANG_JOIN=1) joins that one
// and, under keyNamespace(G): failed   rank 0's reason when its handshake timed out (the ranks
// that learned G wait there next, for the topology labels: they fail with it at once)
#pragma once

#include <string>

#include "core/transport/tcp.h"

namespace xirang::generation {

constexpr const char* kPrefix = "xirang/gen";

// The handshake of one group creation, run by every rank of it (group rank `rank` of `size`).
// Returns the generation (16 hex digits; size 1: a fresh one, no store traffic). Rank 0 returns
// once every rank has learned it. Throws transport::TimeoutError at `deadline`: rank 0's names the
// ranks that never answered, another rank's says rank 0 never answered it.
std::string agree(transport::Store& store, int rank, int size, transport::Deadline deadline);

// An elastic spare's generation: the live group's (`live`), waiting for it until `deadline`.
// A spare must be started while the group it joins is live: started during a restart it may read
// the previous attempt's generation, and then it is never admitted (the join times out).
std::string live(transport::Store& store, transport::Deadline deadline);

// The store key namespace of generation `g`: "xirang/<g>". The transport's keys (secret, addr/<r>,
// abort), the elastic keys and the topology labels live under it.
std::string keyNamespace(const std::string& g);

}  // namespace xirang::generation
