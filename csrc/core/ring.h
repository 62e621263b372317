// Chunk/segment partitioning and the ring allreduce schedule (torch-free).
//
// The schedule is the bandwidth-optimal ring of
//   P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
//   workstations", J. Parallel Distrib. Comput. 69(2):117-124, 2009,
// laid out the way gloo's allreduce_ring_chunked does it: the buffer is cut into n chunks
// (n = ring size), n-1 scatter-reduce steps leave each position with one fully reduced chunk,
// n-1 allgather steps circulate those chunks. Each position sends 2(n-1)/n * numel elements,
// which is optimal for any allreduce on n nodes.
//
// Units: every count, offset and total here is in ELEMENTS (multiply by the element size, or
// the wire element size when compressing, for bytes). All of them are int64_t so buffers above
// INT32_MAX elements work; nothing here allocates per element.
//
// "pos" is a position in the ring order (0..n-1), not a process rank: the caller maps positions
// to ranks (see topology.h: ringOrder). The successor of pos is pos+1 mod n.
#pragma once

#include <cstdint>
#include <vector>

namespace xirang::ring {

// A contiguous run of elements [offset, offset + count).
struct Range {
  int64_t offset = 0;  // elements from the start of the buffer
  int64_t count = 0;   // elements
};

// Split n elements into `parts` (>= 1) contiguous chunks, in order, covering [0, n); sizes differ
// by at most 1 and the first n % parts chunks get the extra element. Chunks may be empty (n < parts).
// Throws std::invalid_argument for parts < 1 or n < 0.
std::vector<Range> partition(int64_t n, int parts);

// Chunk i of partition(n, parts) without building the vector (O(1)). Throws std::invalid_argument
// for parts < 1, n < 0 or i outside [0, parts).
Range chunkRange(int64_t n, int parts, int i);

// Split r into consecutive segments of at most seg (>= 1) elements, all full except possibly the
// last. r.count == 0 -> empty vector. Throws std::invalid_argument for seg < 1, r.count < 0 or
// r.offset < 0. Materialises ceil(count/seg) entries: use segmentCount first for huge ranges.
std::vector<Range> segments(Range r, int64_t seg);

// Number of segments of at most seg elements in count elements, ceil(count/seg), without
// materialising them (no overflow for count near INT64_MAX). Throws std::invalid_argument for
// seg < 1 or count < 0.
int64_t segmentCount(int64_t count, int64_t seg);

// One step of the ring for one position: the chunk index (into partition(numel, n)) it sends to
// nextPos(pos) and the chunk index it receives from prevPos(pos).
struct Step {
  int send_chunk;
  int recv_chunk;
};

// Scatter-reduce step s in [0, n-2]: pos sends chunk (pos - s) mod n to pos+1 and receives chunk
// (pos - s - 1) mod n from pos-1, reducing it into its own copy. The chunk sent at step s carries
// s+1 contributions. After n-1 steps pos holds the full reduction of chunk ownedChunk(pos, n).
// Throws std::invalid_argument for n < 1, pos outside [0, n) or s outside [0, n-2] (n == 1 has
// no steps).
Step scatterReduceStep(int pos, int n, int s);

// Allgather step s in [0, n-2]: pos sends chunk (pos + 1 - s) mod n (at s == 0 its owned chunk)
// to pos+1 and receives chunk (pos - s) mod n from pos-1, overwriting its copy. Every chunk sent
// is already fully reduced. Same argument checks as scatterReduceStep.
Step allgatherStep(int pos, int n, int s);

// Chunk fully reduced at pos after the scatter-reduce: (pos + 1) mod n.
int ownedChunk(int pos, int n);

// Ring neighbours: (pos + 1) mod n and (pos - 1 + n) mod n. Throw std::invalid_argument for
// n < 1 or pos outside [0, n).
int nextPos(int pos, int n);
int prevPos(int pos, int n);

// Elements sent by position pos during a full ring allreduce of numel elements (scatter-reduce +
// allgather), summed exactly over the chunks of partition(numel, n):
//   2 * numel - |chunk (pos+1) mod n| - |chunk (pos+2) mod n|   (0 for n == 1).
// Equals 2(n-1)/n * numel when n divides numel; summed over all positions it is always
// 2(n-1) * numel. O(1), no allocation. Throws std::invalid_argument for bad numel/n/pos.
int64_t allreduceElementsSent(int64_t numel, int n, int pos);

// Replay the schedule step by step (scatter-reduce then allgather, using scatterReduceStep /
// allgatherStep and chunk sizes from partition) and return, per position, the elements it sends.
// O(n^2) time, O(n) memory, independent of numel. Used by the simulator and to cross-check
// allreduceElementsSent.
std::vector<int64_t> replayAllreduceSent(int64_t numel, int n);

}  // namespace xirang::ring
