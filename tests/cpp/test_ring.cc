// Ring partition and schedule: coverage, symbolic proof of the reduction, element totals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "core/ring.h"

using xirang::ring::Range;
namespace ring = xirang::ring;

namespace {

std::vector<int64_t> countsFor(int n) {
  std::vector<int64_t> c = {0, 1, 2, n - 1, n, n + 1, 3 * n + 2, 1009, 65537,
                            int64_t{INT32_MAX} + 7, int64_t{5000000000000}};
  std::vector<int64_t> out;
  for (int64_t v : c) {
    if (v >= 0) out.push_back(v);
  }
  return out;
}

void checkCover(const std::vector<Range>& parts, int64_t offset, int64_t count) {
  int64_t at = offset;
  for (const Range& r : parts) {
    REQUIRE(r.offset == at);
    REQUIRE(r.count >= 0);
    at += r.count;
  }
  REQUIRE(at == offset + count);
}

// Symbolic replay of one allreduce over n positions: state[pos][chunk] is the bitmask of the
// positions whose contribution pos holds for that chunk. Checks, step by step, that senders and
// receivers agree on the chunk, that no contribution is ever added twice, that the chunk sent
// at scatter-reduce step s carries s+1 contributions, and that the allgather forwards only
// complete chunks, each exactly once to each position. Returns elements sent per position.
std::vector<int64_t> simulate(int64_t numel, int n) {
  const auto chunks = ring::partition(numel, n);
  REQUIRE(n < 32);
  const uint32_t full = (1u << n) - 1u;
  std::vector<std::vector<uint32_t>> state(n, std::vector<uint32_t>(n));
  for (int p = 0; p < n; ++p) {
    for (int c = 0; c < n; ++c) state[p][c] = 1u << p;
  }
  std::vector<int64_t> sent(n, 0);

  for (int s = 0; s + 1 < n; ++s) {
    std::vector<uint32_t> msg(n);  // message sent by pos this step (all sends before receives)
    for (int p = 0; p < n; ++p) {
      const auto st = ring::scatterReduceStep(p, n, s);
      msg[p] = state[p][st.send_chunk];
      REQUIRE(std::popcount(msg[p]) == s + 1);
      sent[p] += chunks[st.send_chunk].count;
    }
    for (int p = 0; p < n; ++p) {
      const int from = ring::prevPos(p, n);
      const auto st = ring::scatterReduceStep(p, n, s);
      REQUIRE(st.recv_chunk == ring::scatterReduceStep(from, n, s).send_chunk);
      REQUIRE((state[p][st.recv_chunk] & msg[from]) == 0u);  // each contribution once
      state[p][st.recv_chunk] |= msg[from];
    }
  }
  for (int p = 0; p < n; ++p) {
    REQUIRE(state[p][ring::ownedChunk(p, n)] == full);
  }

  std::vector<std::vector<int>> received(n, std::vector<int>(n, 0));
  for (int s = 0; s + 1 < n; ++s) {
    std::vector<uint32_t> msg(n);
    for (int p = 0; p < n; ++p) {
      const auto st = ring::allgatherStep(p, n, s);
      msg[p] = state[p][st.send_chunk];
      REQUIRE(msg[p] == full);  // only complete chunks are forwarded
      sent[p] += chunks[st.send_chunk].count;
    }
    for (int p = 0; p < n; ++p) {
      const int from = ring::prevPos(p, n);
      const auto st = ring::allgatherStep(p, n, s);
      REQUIRE(st.recv_chunk == ring::allgatherStep(from, n, s).send_chunk);
      REQUIRE(st.recv_chunk != ring::ownedChunk(p, n));
      state[p][st.recv_chunk] = msg[from];  // overwrite, not reduce
      ++received[p][st.recv_chunk];
    }
  }
  for (int p = 0; p < n; ++p) {
    for (int c = 0; c < n; ++c) {
      REQUIRE(state[p][c] == full);
      REQUIRE(received[p][c] == (c == ring::ownedChunk(p, n) ? 0 : 1));
    }
  }
  return sent;
}

}  // namespace

TEST_CASE("partition covers [0,n) with sizes within 1", "[ring]") {
  for (int parts = 1; parts <= 9; ++parts) {
    for (int64_t n : countsFor(parts)) {
      CAPTURE(parts, n);
      const auto p = ring::partition(n, parts);
      REQUIRE(p.size() == static_cast<size_t>(parts));
      checkCover(p, 0, n);
      const int64_t base = n / parts;
      for (int i = 0; i < parts; ++i) {
        REQUIRE(p[i].count == base + (i < n % parts ? 1 : 0));
        const Range c = ring::chunkRange(n, parts, i);
        REQUIRE(c.offset == p[i].offset);
        REQUIRE(c.count == p[i].count);
      }
    }
  }
  REQUIRE_THROWS_AS(ring::partition(10, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::partition(-1, 2), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::chunkRange(10, 3, 3), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::chunkRange(10, 3, -1), std::invalid_argument);
}

TEST_CASE("partition of huge counts stays exact in int64", "[ring]") {
  const int64_t n = int64_t{INT32_MAX} + 7;  // 2147483654
  const auto p = ring::partition(n, 4);
  REQUIRE(p[0].count == 536870914);
  REQUIRE(p[1].count == 536870914);
  REQUIRE(p[2].count == 536870913);
  REQUIRE(p[3].offset == 3 * int64_t{536870914} - 1);
  REQUIRE(p[3].offset + p[3].count == n);
  const int64_t big = INT64_MAX;
  const auto q = ring::partition(big, 7);
  checkCover(q, 0, big);
}

TEST_CASE("segments cover their range", "[ring]") {
  for (int64_t off : {int64_t{0}, int64_t{5}, int64_t{INT32_MAX} + 3}) {
    for (int64_t count : {0, 1, 7, 8, 9, 1009, 65537}) {
      for (int64_t seg : {1, 2, 8, 1000, 1 << 20}) {
        CAPTURE(off, count, seg);
        const auto s = ring::segments(Range{off, count}, seg);
        REQUIRE(static_cast<int64_t>(s.size()) == ring::segmentCount(count, seg));
        checkCover(s, off, count);
        for (size_t i = 0; i < s.size(); ++i) {
          REQUIRE(s[i].count >= 1);
          REQUIRE(s[i].count <= seg);
          if (i + 1 < s.size()) REQUIRE(s[i].count == seg);
        }
      }
    }
  }
  REQUIRE(ring::segments(Range{3, 0}, 4).empty());
  REQUIRE_THROWS_AS(ring::segments(Range{0, 4}, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::segments(Range{0, -1}, 4), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::segments(Range{-1, 4}, 4), std::invalid_argument);
}

TEST_CASE("segmentCount is ceil without overflow or allocation", "[ring]") {
  REQUIRE(ring::segmentCount(0, 1) == 0);
  REQUIRE(ring::segmentCount(1, 1) == 1);
  REQUIRE(ring::segmentCount(8, 4) == 2);
  REQUIRE(ring::segmentCount(9, 4) == 3);
  const int64_t mib = int64_t{1} << 18;  // 1 MiB of fp32 elements
  REQUIRE(ring::segmentCount(int64_t{INT32_MAX} + 7, mib) == 8193);
  REQUIRE(ring::segmentCount(int64_t{5000000000000}, mib) == 19073487);
  REQUIRE(ring::segmentCount(INT64_MAX, INT64_MAX) == 1);
  REQUIRE(ring::segmentCount(INT64_MAX, 2) == INT64_MAX / 2 + 1);
  REQUIRE_THROWS_AS(ring::segmentCount(5, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::segmentCount(-5, 1), std::invalid_argument);
}

TEST_CASE("schedule formulas, neighbours and argument checks", "[ring]") {
  for (int n = 1; n <= 9; ++n) {
    for (int p = 0; p < n; ++p) {
      REQUIRE(ring::nextPos(p, n) == (p + 1) % n);
      REQUIRE(ring::prevPos(ring::nextPos(p, n), n) == p);
      REQUIRE(ring::ownedChunk(p, n) == (p + 1) % n);
      for (int s = 0; s + 1 < n; ++s) {
        const auto sr = ring::scatterReduceStep(p, n, s);
        REQUIRE(sr.send_chunk == ((p - s) % n + n) % n);
        REQUIRE(sr.recv_chunk == ((p - s - 1) % n + n) % n);
        const auto ag = ring::allgatherStep(p, n, s);
        REQUIRE(ag.send_chunk == ((p + 1 - s) % n + n) % n);
        REQUIRE(ag.recv_chunk == ((p - s) % n + n) % n);
      }
      // The chunk received last in the scatter-reduce is the owned one, sent first in allgather.
      if (n > 1) {
        REQUIRE(ring::scatterReduceStep(p, n, n - 2).recv_chunk == ring::ownedChunk(p, n));
        REQUIRE(ring::allgatherStep(p, n, 0).send_chunk == ring::ownedChunk(p, n));
      }
    }
  }
  REQUIRE_THROWS_AS(ring::scatterReduceStep(0, 1, 0), std::invalid_argument);  // n=1: no steps
  REQUIRE_THROWS_AS(ring::scatterReduceStep(0, 4, 3), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::allgatherStep(0, 4, -1), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::allgatherStep(4, 4, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::nextPos(0, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::prevPos(-1, 3), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::allreduceElementsSent(10, 3, 3), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::allreduceElementsSent(-1, 3, 0), std::invalid_argument);
  REQUIRE_THROWS_AS(ring::replayAllreduceSent(10, 0), std::invalid_argument);
}

TEST_CASE("symbolic replay: every position ends with every chunk fully reduced once", "[ring]") {
  for (int n = 1; n <= 9; ++n) {
    for (int64_t numel : countsFor(n)) {
      CAPTURE(n, numel);
      const auto sent = simulate(numel, n);
      const auto replay = ring::replayAllreduceSent(numel, n);
      REQUIRE(replay.size() == static_cast<size_t>(n));
      int64_t total = 0;
      int64_t lo = INT64_MAX, hi = 0;
      for (int p = 0; p < n; ++p) {
        const int64_t closed = ring::allreduceElementsSent(numel, n, p);
        REQUIRE(sent[p] == closed);
        REQUIRE(replay[p] == closed);
        if (numel % n == 0) REQUIRE(closed == 2 * (n - 1) * (numel / n));
        total += closed;
        lo = std::min(lo, closed);
        hi = std::max(hi, closed);
      }
      // Whole ring: every element crosses 2(n-1) edges; positions differ by at most 2 elements.
      REQUIRE(total == 2 * int64_t{n - 1} * numel);
      REQUIRE(hi - lo <= 2);
    }
  }
}

TEST_CASE("bandwidth-optimal totals at scale", "[ring]") {
  // 2(n-1)/n * numel exactly when n divides numel, e.g. 8 ranks, 5e12 elements.
  REQUIRE(ring::allreduceElementsSent(5000000000000, 8, 3) == 8750000000000);
  REQUIRE(ring::allreduceElementsSent(5000000000000, 1, 0) == 0);
  // Non-divisible: INT32_MAX + 7 = 2147483654 over 3: chunks 715827885, 715827885, 715827884.
  const int64_t n32 = int64_t{INT32_MAX} + 7;
  REQUIRE(ring::allreduceElementsSent(n32, 3, 0) == 2 * n32 - 715827885 - 715827884);
  REQUIRE(ring::allreduceElementsSent(n32, 3, 1) == 2 * n32 - 715827884 - 715827885);
  REQUIRE(ring::allreduceElementsSent(n32, 3, 2) == 2 * n32 - 715827885 - 715827885);
  // 128 ranks: replay equals the closed form without allocating per element.
  const auto replay = ring::replayAllreduceSent(5000000000003, 128);
  for (int p = 0; p < 128; ++p) {
    REQUIRE(replay[p] == ring::allreduceElementsSent(5000000000003, 128, p));
  }
}
