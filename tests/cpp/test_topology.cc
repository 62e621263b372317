// Topology: ring order, cross-rack/host edge counts, two-level plans, local ranks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/topology.h"

namespace topo = xirang::topology;
using topo::RankLabel;
using topo::RingOrder;

namespace {

// 2 racks x 2 hosts x 2 ranks, round-robin across racks: rank r on rack r%2, host (r/2)%2 in it.
std::vector<RankLabel> roundRobin8() {
  std::vector<RankLabel> l;
  for (int r = 0; r < 8; ++r) {
    const std::string rack = "rack" + std::to_string(r % 2);
    l.push_back(RankLabel{r, rack + "-host" + std::to_string((r / 2) % 2), rack, -1});
  }
  return l;
}

bool isPermutation(std::vector<int> v, int n) {
  if (static_cast<int>(v.size()) != n) return false;
  std::sort(v.begin(), v.end());
  for (int i = 0; i < n; ++i) {
    if (v[i] != i) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("round-robin 2x2x2: topology ring crosses racks twice, rank ring 8 times",
          "[topology]") {
  const auto labels = roundRobin8();
  const auto topoRing = topo::ringOrder(labels, RingOrder::Topology);
  REQUIRE(topoRing == std::vector<int>{0, 4, 2, 6, 1, 5, 3, 7});
  REQUIRE(topo::crossRackEdges(topoRing, labels) == 2);
  REQUIRE(topo::crossHostEdges(topoRing, labels) == 4);

  const auto rankRing = topo::ringOrder(labels, RingOrder::Rank);
  REQUIRE(rankRing == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  REQUIRE(topo::crossRackEdges(rankRing, labels) == 8);
  REQUIRE(topo::crossHostEdges(rankRing, labels) == 8);
}

TEST_CASE("labels are looked up by rank, not by vector position", "[topology]") {
  auto labels = roundRobin8();
  std::reverse(labels.begin(), labels.end());
  const auto ringT = topo::ringOrder(labels, RingOrder::Topology);
  REQUIRE(ringT == std::vector<int>{0, 4, 2, 6, 1, 5, 3, 7});
  REQUIRE(topo::crossRackEdges(ringT, labels) == 2);
  REQUIRE(topo::ringOrder(labels, RingOrder::Rank) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
}

TEST_CASE("single rack / single host: no crossings", "[topology]") {
  std::vector<RankLabel> oneHost;
  std::vector<RankLabel> oneRack;
  for (int r = 0; r < 6; ++r) {
    oneHost.push_back(RankLabel{r, "h", "", 0});
    // Appended, not `"h" + std::to_string(...)`: GCC 12 (C++20) reports a false -Wrestrict there.
    std::string host = "h";
    host += std::to_string(r % 3);
    oneRack.push_back(RankLabel{r, host, "rackA", 0});
  }
  for (auto mode : {RingOrder::Topology, RingOrder::Rank}) {
    const auto a = topo::ringOrder(oneHost, mode);
    REQUIRE(topo::crossRackEdges(a, oneHost) == 0);
    REQUIRE(topo::crossHostEdges(a, oneHost) == 0);
    REQUIRE(topo::crossRackEdges(topo::ringOrder(oneRack, mode), oneRack) == 0);
  }
  // One rack, three hosts: the topology ring crosses hosts 3 times, the rank ring 6 times.
  REQUIRE(topo::crossHostEdges(topo::ringOrder(oneRack, RingOrder::Topology), oneRack) == 3);
  REQUIRE(topo::crossHostEdges(topo::ringOrder(oneRack, RingOrder::Rank), oneRack) == 6);

  // Rings of 0 and 1 ranks have no edges.
  const std::vector<RankLabel> none;
  REQUIRE(topo::ringOrder(none, RingOrder::Topology).empty());
  REQUIRE(topo::crossRackEdges({}, none) == 0);
  const std::vector<RankLabel> one = {RankLabel{0, "h", "r", 0}};
  REQUIRE(topo::ringOrder(one, RingOrder::Topology) == std::vector<int>{0});
  REQUIRE(topo::crossRackEdges({0}, one) == 0);
  REQUIRE(topo::crossHostEdges({0}, one) == 0);
}

TEST_CASE("ringOrder is a permutation and the topology ring minimises crossings",
          "[topology]") {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 130);
    const int racks = 1 + static_cast<int>(rng() % 5);
    const int hostsPerRack = 1 + static_cast<int>(rng() % 4);
    std::vector<RankLabel> labels;
    std::set<std::string> usedRacks, usedHosts;
    for (int r = 0; r < n; ++r) {
      const int rk = static_cast<int>(rng() % racks);
      const int h = static_cast<int>(rng() % hostsPerRack);
      std::string rack = "r";  // appended: see the -Wrestrict note above
      rack += std::to_string(rk);
      const std::string host = rack + "h" + std::to_string(h);
      usedRacks.insert(rack);
      usedHosts.insert(host);
      labels.push_back(RankLabel{r, host, rack, 0});
    }
    std::shuffle(labels.begin(), labels.end(), rng);
    CAPTURE(trial, n, racks, hostsPerRack);
    for (auto mode : {RingOrder::Topology, RingOrder::Rank}) {
      REQUIRE(isPermutation(topo::ringOrder(labels, mode), n));
    }
    const auto ring = topo::ringOrder(labels, RingOrder::Topology);
    const int nr = static_cast<int>(usedRacks.size());
    const int nh = static_cast<int>(usedHosts.size());
    // Every rack (host) is one contiguous run of the ring: the lower bound on crossings.
    REQUIRE(topo::crossRackEdges(ring, labels) == (nr > 1 ? nr : 0));
    REQUIRE(topo::crossHostEdges(ring, labels) == (nh > 1 ? nh : 0));
    const auto rankRing = topo::ringOrder(labels, RingOrder::Rank);
    REQUIRE(topo::crossRackEdges(rankRing, labels) >= topo::crossRackEdges(ring, labels));
    REQUIRE(topo::crossHostEdges(rankRing, labels) >= topo::crossHostEdges(ring, labels));
  }
}

TEST_CASE("bad labels are rejected", "[topology]") {
  const std::vector<RankLabel> dup = {RankLabel{0, "a", "r", 0}, RankLabel{0, "b", "r", 0}};
  const std::vector<RankLabel> gap = {RankLabel{0, "a", "r", 0}, RankLabel{2, "b", "r", 0}};
  const std::vector<RankLabel> split = {RankLabel{0, "a", "r1", 0}, RankLabel{1, "a", "r2", 0}};
  for (const auto* l : {&dup, &gap, &split}) {
    REQUIRE_THROWS_AS(topo::ringOrder(*l, RingOrder::Topology), std::invalid_argument);
    REQUIRE_THROWS_AS(topo::crossRackEdges({0, 1}, *l), std::invalid_argument);
    const auto plan = topo::twoLevelPlan(*l, false);
    REQUIRE_FALSE(plan.valid);
    REQUIRE_FALSE(plan.reason.empty());
  }
  const auto labels = roundRobin8();
  REQUIRE_THROWS_AS(topo::crossHostEdges({0, 8}, labels), std::invalid_argument);
  REQUIRE_THROWS_AS(topo::crossHostEdges({-1}, labels), std::invalid_argument);
}

TEST_CASE("twoLevelPlan: even groups", "[topology]") {
  const auto labels = roundRobin8();

  const auto byHost = topo::twoLevelPlan(labels, false);
  REQUIRE(byHost.valid);
  REQUIRE(byHost.reason.empty());
  REQUIRE(byHost.local_groups ==
          std::vector<std::vector<int>>{{0, 4}, {2, 6}, {1, 5}, {3, 7}});
  REQUIRE(byHost.cross_groups == std::vector<std::vector<int>>{{0, 2, 1, 3}, {4, 6, 5, 7}});

  const auto byRack = topo::twoLevelPlan(labels, true);
  REQUIRE(byRack.valid);
  REQUIRE(byRack.local_groups == std::vector<std::vector<int>>{{0, 4, 2, 6}, {1, 5, 3, 7}});
  REQUIRE(byRack.cross_groups ==
          std::vector<std::vector<int>>{{0, 1}, {4, 5}, {2, 3}, {6, 7}});

  // Every rank appears exactly once in the local groups and once in the cross groups.
  for (const auto* plan : {&byHost, &byRack}) {
    std::vector<int> a, b;
    for (const auto& g : plan->local_groups) a.insert(a.end(), g.begin(), g.end());
    for (const auto& g : plan->cross_groups) b.insert(b.end(), g.begin(), g.end());
    REQUIRE(isPermutation(a, 8));
    REQUIRE(isPermutation(b, 8));
  }

  // A single host: one local group, one cross group per rank.
  std::vector<RankLabel> single;
  for (int r = 0; r < 3; ++r) single.push_back(RankLabel{r, "h", "", 0});
  const auto one = topo::twoLevelPlan(single, false);
  REQUIRE(one.valid);
  REQUIRE(one.local_groups == std::vector<std::vector<int>>{{0, 1, 2}});
  REQUIRE(one.cross_groups == std::vector<std::vector<int>>{{0}, {1}, {2}});
}

TEST_CASE("twoLevelPlan: uneven groups are invalid with a reason", "[topology]") {
  // Host a has 3 ranks, host b has 1; both in one rack.
  const std::vector<RankLabel> labels = {RankLabel{0, "a", "r", 0}, RankLabel{1, "a", "r", 0},
                                         RankLabel{2, "a", "r", 0}, RankLabel{3, "b", "r", 0}};
  const auto plan = topo::twoLevelPlan(labels, false);
  REQUIRE_FALSE(plan.valid);
  REQUIRE(plan.reason.find("uneven") != std::string::npos);
  REQUIRE(plan.reason.find("'a' has 3") != std::string::npos);
  REQUIRE(plan.local_groups.empty());
  REQUIRE(plan.cross_groups.empty());
  // By rack it is one group of 4: valid.
  const auto rack = topo::twoLevelPlan(labels, true);
  REQUIRE(rack.valid);
  REQUIRE(rack.local_groups == std::vector<std::vector<int>>{{0, 1, 2, 3}});

  // Even hosts but uneven racks: valid by host, invalid by rack.
  const std::vector<RankLabel> racks = {RankLabel{0, "a", "r1", 0}, RankLabel{1, "b", "r1", 0},
                                        RankLabel{2, "c", "r2", 0}};
  REQUIRE(topo::twoLevelPlan(racks, false).valid);
  const auto bad = topo::twoLevelPlan(racks, true);
  REQUIRE_FALSE(bad.valid);
  REQUIRE(bad.reason.find("rack") != std::string::npos);

  const auto empty = topo::twoLevelPlan({}, false);
  REQUIRE_FALSE(empty.valid);
  REQUIRE_FALSE(empty.reason.empty());
}

TEST_CASE("assignLocalRanks numbers ranks within a host by rank", "[topology]") {
  auto labels = roundRobin8();
  std::reverse(labels.begin(), labels.end());  // vector order must not matter
  topo::assignLocalRanks(labels);
  for (const auto& l : labels) {
    CAPTURE(l.rank);
    REQUIRE(l.local_rank == l.rank / 4);  // hosts hold {r, r+4}
  }
  std::vector<RankLabel> mixed = {RankLabel{5, "x", "", -1}, RankLabel{1, "y", "", -1},
                                  RankLabel{3, "x", "", -1}, RankLabel{0, "x", "", -1},
                                  RankLabel{2, "y", "", -1}, RankLabel{4, "z", "", -1}};
  topo::assignLocalRanks(mixed);
  const std::vector<int> expect = {2, 0, 1, 0, 1, 0};
  for (size_t i = 0; i < mixed.size(); ++i) REQUIRE(mixed[i].local_rank == expect[i]);
  std::vector<RankLabel> none;
  topo::assignLocalRanks(none);
  REQUIRE(none.empty());
}
