// Topology: ring order from host/rack labels, cross-host/cross-rack edge counts, and the
// groups of a two-level (hierarchical) allreduce. Torch-free.
//
// A ring allreduce moves the same number of elements over every ring edge, so the traffic that
// crosses a rack (or host) boundary is proportional to the number of ring edges whose endpoints
// sit in different racks (hosts). Sorting ranks by (rack, host, rank) makes that number the
// minimum possible: the number of racks (hosts) when there are at least two, else 0.
//
// Labels are indexed by their `rank` field, not by their position in the vector: the ranks of
// the labels must be exactly 0..n-1, in any order. A host name identifies a host across the
// whole job, so it must map to one rack.
#pragma once

#include <string>
#include <vector>

namespace xirang::topology {

struct RankLabel {
  int rank = 0;
  std::string host;    // e.g. hostname; ranks with equal host share a machine
  std::string rack;    // rack / switch / pod name; "" when unknown (all one rack)
  int local_rank = 0;  // index among the ranks of the same host, by rank (assignLocalRanks)
};

enum class RingOrder {
  Topology,  // ranks sorted by (rack, host, rank): racks together, hosts together inside racks
  Rank,      // 0..n-1
};

// Ring order (ring position -> rank). Topology: ranks sorted by (rack, host, rank), stable by
// rank; Rank: 0..n-1. Always a permutation of 0..n-1. Throws std::invalid_argument when the
// label ranks are not a permutation of 0..n-1 or one host appears under two racks.
std::vector<int> ringOrder(const std::vector<RankLabel>& labels, RingOrder mode);

// Number of ring edges ring[i] -> ring[(i+1) % size] (cyclic) whose endpoints differ in rack /
// in host. A ring of 0 or 1 ranks has 0 edges. `ring` holds ranks, looked up in labels by rank.
// Throws std::invalid_argument for a rank in ring that has no label or bad labels.
int crossRackEdges(const std::vector<int>& ring, const std::vector<RankLabel>& labels);
int crossHostEdges(const std::vector<int>& ring, const std::vector<RankLabel>& labels);

// Two-level allreduce plan: groups are hosts (by_rack == false) or racks (by_rack == true).
//   1. reduce inside each local group, 2. allreduce across cross_groups, 3. broadcast/allgather
//   inside each local group.
// Valid only if there is at least one rank and every group has the same size; otherwise
// valid == false, `reason` says why and the group vectors are empty. Never throws.
struct TwoLevelPlan {
  bool valid = false;
  std::string reason;  // empty when valid
  // local_groups[g]: the ranks of group g in topology order ((host, rank) inside a rack, i.e.
  // by rank inside a host); groups in topology order (by (rack, host) of their first rank).
  std::vector<std::vector<int>> local_groups;
  // cross_groups[j]: the j-th rank of each local group, groups in topology order.
  std::vector<std::vector<int>> cross_groups;
};
TwoLevelPlan twoLevelPlan(const std::vector<RankLabel>& labels, bool by_rack);

// Fill local_rank of every label: its index among labels with the same host, ordered by rank.
// Only host equality matters; labels may be in any order and need not be validated.
void assignLocalRanks(std::vector<RankLabel>& labels);

}  // namespace xirang::topology
