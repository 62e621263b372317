// Topology-aware ring order and two-level groups; see topology.h.
#include "core/topology.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>

namespace xirang::topology {
namespace {

// Validate labels and return byRank[r] = index into labels of the label with rank r.
// On error returns false and fills *why.
bool indexByRank(const std::vector<RankLabel>& labels, std::vector<size_t>* byRank,
                 std::string* why) {
  const size_t n = labels.size();
  byRank->assign(n, n);
  std::map<std::string, std::string> rackOfHost;
  for (size_t i = 0; i < n; ++i) {
    const RankLabel& l = labels[i];
    if (l.rank < 0 || static_cast<size_t>(l.rank) >= n) {
      *why = "label rank " + std::to_string(l.rank) + " outside [0, " + std::to_string(n) + ")";
      return false;
    }
    if ((*byRank)[l.rank] != n) {
      *why = "rank " + std::to_string(l.rank) + " labelled twice";
      return false;
    }
    (*byRank)[l.rank] = i;
    auto [it, inserted] = rackOfHost.emplace(l.host, l.rack);
    if (!inserted && it->second != l.rack) {
      *why = "host '" + l.host + "' appears in racks '" + it->second + "' and '" + l.rack + "'";
      return false;
    }
  }
  return true;
}

std::vector<size_t> indexByRankOrThrow(const std::vector<RankLabel>& labels, const char* fn) {
  std::vector<size_t> byRank;
  std::string why;
  if (!indexByRank(labels, &byRank, &why)) {
    throw std::invalid_argument(std::string(fn) + ": " + why);
  }
  return byRank;
}

std::vector<int> topologyOrder(const std::vector<RankLabel>& labels,
                               const std::vector<size_t>& byRank) {
  std::vector<int> order(labels.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const RankLabel& la = labels[byRank[a]];
    const RankLabel& lb = labels[byRank[b]];
    return std::tie(la.rack, la.host, la.rank) < std::tie(lb.rack, lb.host, lb.rank);
  });
  return order;
}

template <typename Differ>
int countEdges(const std::vector<int>& ring, const std::vector<RankLabel>& labels,
               const char* fn, Differ differ) {
  const std::vector<size_t> byRank = indexByRankOrThrow(labels, fn);
  const size_t m = ring.size();
  for (int r : ring) {
    if (r < 0 || static_cast<size_t>(r) >= byRank.size()) {
      throw std::invalid_argument(std::string(fn) + ": ring rank " + std::to_string(r) +
                                  " has no label");
    }
  }
  if (m < 2) return 0;
  int edges = 0;
  for (size_t i = 0; i < m; ++i) {
    const RankLabel& a = labels[byRank[ring[i]]];
    const RankLabel& b = labels[byRank[ring[(i + 1) % m]]];
    if (differ(a, b)) ++edges;
  }
  return edges;
}

}  // namespace

std::vector<int> ringOrder(const std::vector<RankLabel>& labels, RingOrder mode) {
  const std::vector<size_t> byRank = indexByRankOrThrow(labels, "topology::ringOrder");
  if (mode == RingOrder::Rank) {
    std::vector<int> order(labels.size());
    std::iota(order.begin(), order.end(), 0);
    return order;
  }
  return topologyOrder(labels, byRank);
}

int crossRackEdges(const std::vector<int>& ring, const std::vector<RankLabel>& labels) {
  return countEdges(ring, labels, "topology::crossRackEdges",
                    [](const RankLabel& a, const RankLabel& b) { return a.rack != b.rack; });
}

int crossHostEdges(const std::vector<int>& ring, const std::vector<RankLabel>& labels) {
  // Host names are job-wide (validated to sit in one rack), so host equality suffices.
  return countEdges(ring, labels, "topology::crossHostEdges",
                    [](const RankLabel& a, const RankLabel& b) { return a.host != b.host; });
}

TwoLevelPlan twoLevelPlan(const std::vector<RankLabel>& labels, bool by_rack) {
  TwoLevelPlan plan;
  if (labels.empty()) {
    plan.reason = "no ranks";
    return plan;
  }
  std::vector<size_t> byRank;
  if (!indexByRank(labels, &byRank, &plan.reason)) return plan;

  // Walk the topology order; a new group starts whenever the group key changes (the order is
  // sorted by (rack, host), so each group is one contiguous run).
  const std::vector<int> order = topologyOrder(labels, byRank);
  std::vector<std::vector<int>> groups;
  const std::string* key = nullptr;
  for (int r : order) {
    const RankLabel& l = labels[byRank[r]];
    const std::string& k = by_rack ? l.rack : l.host;
    if (key == nullptr || *key != k) groups.emplace_back();
    key = &k;
    groups.back().push_back(r);
  }

  const size_t size = groups.front().size();
  for (size_t g = 1; g < groups.size(); ++g) {
    if (groups[g].size() != size) {
      const char* what = by_rack ? "rack" : "host";
      const RankLabel& a = labels[byRank[groups.front().front()]];
      const RankLabel& b = labels[byRank[groups[g].front()]];
      plan.reason = std::string("uneven groups: ") + what + " '" + (by_rack ? a.rack : a.host) +
                    "' has " + std::to_string(size) + " ranks but " + what + " '" +
                    (by_rack ? b.rack : b.host) + "' has " + std::to_string(groups[g].size());
      return plan;
    }
  }

  plan.cross_groups.assign(size, {});
  for (const auto& g : groups) {
    for (size_t j = 0; j < size; ++j) plan.cross_groups[j].push_back(g[j]);
  }
  plan.local_groups = std::move(groups);
  plan.valid = true;
  return plan;
}

void assignLocalRanks(std::vector<RankLabel>& labels) {
  std::vector<size_t> idx(labels.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return std::tie(labels[a].host, labels[a].rank) < std::tie(labels[b].host, labels[b].rank);
  });
  int next = 0;
  for (size_t i = 0; i < idx.size(); ++i) {
    if (i > 0 && labels[idx[i]].host != labels[idx[i - 1]].host) next = 0;
    labels[idx[i]].local_rank = next++;
  }
}

}  // namespace xirang::topology
