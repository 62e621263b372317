// Ring partition and schedule; see ring.h (Patarasuk & Yuan 2009; gloo allreduce_ring_chunked).
#include "core/ring.h"

#include <stdexcept>
#include <string>

namespace xirang::ring {
namespace {

void checkRing(int pos, int n, const char* fn) {
  if (n < 1) {
    throw std::invalid_argument(std::string(fn) + ": ring size n must be >= 1, got " +
                                std::to_string(n));
  }
  if (pos < 0 || pos >= n) {
    throw std::invalid_argument(std::string(fn) + ": position " + std::to_string(pos) +
                                " outside [0, " + std::to_string(n) + ")");
  }
}

void checkStep(int pos, int n, int s, const char* fn) {
  checkRing(pos, n, fn);
  if (s < 0 || s > n - 2) {
    throw std::invalid_argument(std::string(fn) + ": step " + std::to_string(s) +
                                " outside [0, n-2] for n=" + std::to_string(n));
  }
}

void checkPartition(int64_t n, int parts, const char* fn) {
  if (parts < 1) {
    throw std::invalid_argument(std::string(fn) + ": parts must be >= 1, got " +
                                std::to_string(parts));
  }
  if (n < 0) {
    throw std::invalid_argument(std::string(fn) + ": element count must be >= 0, got " +
                                std::to_string(n));
  }
}

// a mod n in [0, n) for any int a and n >= 1 (a is within a few n of [0, n) here).
int wrap(int64_t a, int n) {
  int64_t m = a % n;
  return static_cast<int>(m < 0 ? m + n : m);
}

Range chunkUnchecked(int64_t n, int parts, int i) {
  const int64_t base = n / parts;
  const int64_t rem = n % parts;
  // i * base <= n, so no overflow.
  const int64_t offset = static_cast<int64_t>(i) * base + (i < rem ? i : rem);
  return Range{offset, base + (i < rem ? 1 : 0)};
}

}  // namespace

std::vector<Range> partition(int64_t n, int parts) {
  checkPartition(n, parts, "ring::partition");
  std::vector<Range> out;
  out.reserve(static_cast<size_t>(parts));
  for (int i = 0; i < parts; ++i) out.push_back(chunkUnchecked(n, parts, i));
  return out;
}

Range chunkRange(int64_t n, int parts, int i) {
  checkPartition(n, parts, "ring::chunkRange");
  if (i < 0 || i >= parts) {
    throw std::invalid_argument("ring::chunkRange: chunk " + std::to_string(i) +
                                " outside [0, " + std::to_string(parts) + ")");
  }
  return chunkUnchecked(n, parts, i);
}

int64_t segmentCount(int64_t count, int64_t seg) {
  if (seg < 1) {
    throw std::invalid_argument("ring::segmentCount: segment size must be >= 1, got " +
                                std::to_string(seg));
  }
  if (count < 0) {
    throw std::invalid_argument("ring::segmentCount: count must be >= 0, got " +
                                std::to_string(count));
  }
  return count / seg + (count % seg != 0 ? 1 : 0);
}

std::vector<Range> segments(Range r, int64_t seg) {
  if (r.offset < 0) {
    throw std::invalid_argument("ring::segments: offset must be >= 0, got " +
                                std::to_string(r.offset));
  }
  const int64_t k = segmentCount(r.count, seg);  // validates seg and count
  std::vector<Range> out;
  out.reserve(static_cast<size_t>(k));
  int64_t done = 0;
  while (done < r.count) {
    const int64_t left = r.count - done;
    const int64_t c = left < seg ? left : seg;
    out.push_back(Range{r.offset + done, c});
    done += c;
  }
  return out;
}

Step scatterReduceStep(int pos, int n, int s) {
  checkStep(pos, n, s, "ring::scatterReduceStep");
  return Step{wrap(static_cast<int64_t>(pos) - s, n), wrap(static_cast<int64_t>(pos) - s - 1, n)};
}

Step allgatherStep(int pos, int n, int s) {
  checkStep(pos, n, s, "ring::allgatherStep");
  return Step{wrap(static_cast<int64_t>(pos) + 1 - s, n), wrap(static_cast<int64_t>(pos) - s, n)};
}

int ownedChunk(int pos, int n) {
  checkRing(pos, n, "ring::ownedChunk");
  return wrap(static_cast<int64_t>(pos) + 1, n);
}

int nextPos(int pos, int n) {
  checkRing(pos, n, "ring::nextPos");
  return wrap(static_cast<int64_t>(pos) + 1, n);
}

int prevPos(int pos, int n) {
  checkRing(pos, n, "ring::prevPos");
  return wrap(static_cast<int64_t>(pos) - 1, n);
}

int64_t allreduceElementsSent(int64_t numel, int n, int pos) {
  checkPartition(numel, n, "ring::allreduceElementsSent");
  checkRing(pos, n, "ring::allreduceElementsSent");
  if (n == 1) return 0;
  // Scatter-reduce sends every chunk but the one it ends up owning, (pos+1); allgather sends
  // every chunk but (pos+2), the one it receives last. numel <= INT64_MAX / 2 is assumed for
  // the 2 * numel below; subtract first so any numel that fits a buffer is safe.
  const int64_t owned = chunkUnchecked(numel, n, wrap(static_cast<int64_t>(pos) + 1, n)).count;
  const int64_t last = chunkUnchecked(numel, n, wrap(static_cast<int64_t>(pos) + 2, n)).count;
  return (numel - owned) + (numel - last);
}

std::vector<int64_t> replayAllreduceSent(int64_t numel, int n) {
  checkPartition(numel, n, "ring::replayAllreduceSent");
  std::vector<int64_t> sent(static_cast<size_t>(n), 0);
  for (int s = 0; s + 1 < n; ++s) {
    for (int pos = 0; pos < n; ++pos) {
      sent[pos] += chunkUnchecked(numel, n, scatterReduceStep(pos, n, s).send_chunk).count;
    }
  }
  for (int s = 0; s + 1 < n; ++s) {
    for (int pos = 0; pos < n; ++pos) {
      sent[pos] += chunkUnchecked(numel, n, allgatherStep(pos, n, s).send_chunk).count;
    }
  }
  return sent;
}

}  // namespace xirang::ring
