#include "backend/host_engine.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include "backend/tensors.h"
#include "core/planner.h"
#include "core/reduce.h"

namespace xirang::host {

using transport::RecvSeg;
using transport::SendSeg;

namespace {

// A buffer the algorithms can work in: the tensor itself when it is contiguous, else a
// contiguous copy that finish() writes back.
struct Contiguous {
  explicit Contiguous(const at::Tensor& t) : user(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void finish() {
    if (!buf.is_same(user)) user.copy_(buf);
  }
  at::Tensor user;
  at::Tensor buf;
};

// The output's own memory when it is contiguous, else a contiguous scratch tensor to copy back.
at::Tensor contiguousOut(const at::Tensor& o) {
  return o.is_contiguous() ? o : at::empty_like(o, at::MemoryFormat::Contiguous);
}

// Every operation below runs on the collectives of its transport (core/planner.h:
// collectivesFor): shared memory for same-host ranks (comm.shm), else comm.link.
void allgatherBlocks(const Comm& comm, const OpCtx& ctx, const std::vector<RecvSeg>& blocks) {
  collectivesFor(comm).allgather(comm, ctx, blocks);
}

}  // namespace

void reduceAll(const Comm& comm, const OpCtx& ctx, at::Tensor& buf, ReduceOp op, double premul) {
  const DType dtype = toDType(buf.scalar_type());
  collectivesFor(comm).allreduce(comm, ctx, buf.data_ptr(), buf.numel(), dtype, op, premul);  // core/planner.h
}

void allreduce(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, ReduceOp op, double premul) {
  Contiguous s(t);
  reduceAll(comm, ctx, s.buf, op, premul);
  s.finish();
}

void allreduceCoalesced(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& ts, ReduceOp op,
                        double premul) {
  std::vector<at::Tensor> flat;
  for (auto& t : ts) flat.push_back(t.reshape(-1));
  at::Tensor buf = at::cat(flat);
  reduceAll(comm, ctx, buf, op, premul);
  int64_t off = 0;
  for (auto& t : ts) {
    t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

namespace {
constexpr int64_t kSparseMeta = 4 + kSparseMaxDims;

std::string sparseShapeText(const int64_t* meta) {
  std::ostringstream o;
  const int64_t dim = std::clamp<int64_t>(meta[3], 0, kSparseMaxDims);
  o << "[";
  for (int64_t d = 0; d < dim; ++d) o << (d ? ", " : "") << meta[4 + d];
  o << "] (sparse_dim " << meta[0] << ", dense_dim " << meta[1] << ")";
  return o.str();
}

// a * b for byte / element counts a peer's metadata feeds; throws instead of wrapping.
uint64_t mulChecked(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r) || r > static_cast<uint64_t>(INT64_MAX))
    throw std::overflow_error(std::string("xirang: sparse allreduce: ") + what + " overflows int64");
  return r;
}
}  // namespace

// ReduceOp.SUM (the only op gloo reduces sparse tensors with), by gloo's algorithm: every rank
// coalesces its input; one allgather of a fixed-size metadata record per rank (sparse_dim,
// dense_dim, nnz, sizes), which every rank checks against its own, so a shape mismatch fails
// every rank naming both shapes; then an allgather of the indices and one of the values (block r
// holds rank r's nnz rows, so ranks may differ in nnz, zero included). Every rank builds the sum
// from the same bytes in rank order (one coalesce): the result is bitwise identical on every
// rank. It replaces t's indices and values (coalesced; its nnz is the number of distinct rows
// over the ranks).
void allreduceSparse(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, int size) {
  const int rank = comm.rank;
  // The result replaces t's data, as the dense path writes its memory: not an autograd op.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor in = t.coalesce();
  const int64_t sd = in.sparse_dim(), dim = in.dim();
  at::Tensor meta = at::zeros({size, kSparseMeta}, at::TensorOptions().dtype(at::kLong));
  int64_t* m = meta.data_ptr<int64_t>();
  int64_t* mine = m + rank * kSparseMeta;
  mine[0] = sd;
  mine[1] = in.dense_dim();
  mine[2] = in._nnz();
  mine[3] = dim;
  for (int64_t d = 0; d < dim; ++d) mine[4 + d] = in.size(d);
  std::vector<RecvSeg> blocks;
  for (int r = 0; r < size; ++r) blocks.push_back(RecvSeg{m + r * kSparseMeta, kSparseMeta * sizeof(int64_t)});
  allgatherBlocks(comm, ctx, blocks);

  // Rows a coalesced tensor can have at most (saturating): bounds the nnz a peer claims.
  uint64_t max_rows = 1;
  for (int64_t d = 0; d < sd; ++d)
    if (__builtin_mul_overflow(max_rows, static_cast<uint64_t>(in.size(d)), &max_rows)) max_rows = UINT64_MAX;
  std::vector<uint64_t> nnz(size, 0);  // 0 for ranks outside the ring
  uint64_t total = 0;
  for (int r : comm.ring) {
    const int64_t* theirs = m + r * kSparseMeta;
    // Everything but the nnz (index 2) must agree.
    const bool same = theirs[0] == mine[0] && theirs[1] == mine[1] && theirs[3] == mine[3] &&
                      std::equal(mine + 4, mine + 4 + dim, theirs + 4);
    if (!same)
      throw transport::MismatchError("sparse allreduce: rank " + std::to_string(r) + " has a sparse tensor of size " +
                                         sparseShapeText(theirs) + ", this rank " + sparseShapeText(mine),
                                     r);
    if (theirs[2] < 0 || static_cast<uint64_t>(theirs[2]) > max_rows)
      throw transport::TransportError("sparse allreduce: rank " + std::to_string(r) + " sent nnz " +
                                          std::to_string(theirs[2]) + " for a sparse tensor of size " +
                                          sparseShapeText(mine),
                                      r);
    nnz[r] = static_cast<uint64_t>(theirs[2]);
    if (__builtin_add_overflow(total, nnz[r], &total))
      throw std::overflow_error("xirang: sparse allreduce: total nnz overflows");
  }
  uint64_t row_numel = 1;  // elements of one value row (the dense dimensions)
  for (int64_t d = sd; d < dim; ++d)
    row_numel = mulChecked(row_numel, static_cast<uint64_t>(in.size(d)), "a value row");
  const uint64_t row_bytes = mulChecked(row_numel, in._values().element_size(), "a value row's bytes");
  const uint64_t idx_row_bytes = static_cast<uint64_t>(sd) * sizeof(int64_t);
  mulChecked(total, std::max(row_bytes, idx_row_bytes), "the gathered rows' bytes");

  // Rows of every rank back to back, in group-rank order: indices as [total, sparse_dim]
  // (rank r's indices transposed), values as [total, dense sizes...].
  std::vector<int64_t> val_sizes{static_cast<int64_t>(total)};
  for (int64_t d = sd; d < dim; ++d) val_sizes.push_back(in.size(d));
  at::Tensor idx = at::empty({static_cast<int64_t>(total), sd}, at::TensorOptions().dtype(at::kLong));
  at::Tensor val = at::empty(val_sizes, in._values().options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<RecvSeg> iblocks, vblocks;
  uint64_t row = 0, my_row = 0;
  for (int r = 0; r < size; ++r) {
    if (r == rank) my_row = row;
    iblocks.push_back(RecvSeg{static_cast<uint8_t*>(idx.data_ptr()) + row * idx_row_bytes, nnz[r] * idx_row_bytes});
    vblocks.push_back(RecvSeg{static_cast<uint8_t*>(val.data_ptr()) + row * row_bytes, nnz[r] * row_bytes});
    row += nnz[r];
  }
  const int64_t my_nnz = static_cast<int64_t>(nnz[rank]);
  if (my_nnz > 0) {
    idx.narrow(0, static_cast<int64_t>(my_row), my_nnz).copy_(in._indices().t());
    val.narrow(0, static_cast<int64_t>(my_row), my_nnz).copy_(in._values());
  }
  allgatherBlocks(comm, ctx, iblocks);
  allgatherBlocks(comm, ctx, vblocks);

  // Indices a peer sent must lie inside the shape (coalesce trusts them).
  if (total > 0 && sd > 0) {
    at::Tensor limit = at::empty({sd}, at::TensorOptions().dtype(at::kLong));
    for (int64_t d = 0; d < sd; ++d) limit.data_ptr<int64_t>()[d] = in.size(d);
    at::Tensor bad = (idx < 0).logical_or_(idx >= limit).any(1);
    if (bad.any().item<bool>()) {
      const int64_t first = bad.nonzero()[0][0].item<int64_t>();
      int owner = 0;
      for (uint64_t acc = 0; owner < size; ++owner) {
        acc += nnz[owner];
        if (static_cast<uint64_t>(first) < acc) break;
      }
      throw transport::TransportError("sparse allreduce: rank " + std::to_string(owner) +
                                          " sent an index outside the size " + sparseShapeText(mine),
                                      owner);
    }
  }
  at::Tensor sum = at::sparse_coo_tensor(idx.t().contiguous(), val, in.sizes(), in.options()).coalesce();
  t.copy_(sum);
}

void allreduceEF(const Comm& comm, const OpCtx& ctx, const at::Tensor& buffer, const at::Tensor& residual,
                 const at::Tensor& staged, const std::vector<at::Tensor>& plain, codec::Wire wire,
                 const std::vector<at::Tensor>& pack_into, const std::vector<at::Tensor>& pack_from) {
  if (!pack_into.empty()) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < pack_into.size(); ++i) pack_into[i].copy_(pack_from[i]);
    if (ctx.phases) ctx.phases->pack_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // planner.h: Collectives::allreduceEF chooses the algorithm (the BF16 ring, the FP16 / INT8
  // direct form, two-level on multi-host groups, fp32 through shared memory on one host).
  collectivesFor(comm).allreduceEF(comm, ctx, buffer.data_ptr<float>(), residual.data_ptr<float>(),
                                   staged.data_ptr<float>(), buffer.numel(), wire);
  // The group's other tensors (biases, norms, 16-bit or fp64 gradients): averaged in their own
  // dtype within the same operation, so a layer group costs one launch.
  for (const auto& t : plain) {
    Contiguous s(t);
    reduceAll(comm, ctx, s.buf, ReduceOp::Avg, 1.0);
    s.finish();
  }
}

void broadcast(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, int root) {
  Contiguous s(t);
  collectivesFor(comm).broadcast(comm, ctx, s.buf.data_ptr(), nbytes(s.buf), root);
  if (comm.rank != root) s.finish();
}

void reduce(const Comm& comm, const OpCtx& ctx, const at::Tensor& t, ReduceOp op, double premul, int root) {
  at::Tensor buf = t.clone(at::MemoryFormat::Contiguous);
  reduceAll(comm, ctx, buf, op, premul);
  if (comm.rank == root) t.copy_(buf);
}

void allgatherBase(const Comm& comm, const OpCtx& ctx, const at::Tensor& output, const at::Tensor& input, int size) {
  Contiguous s(output);
  const uint64_t b = nbytes(input);
  std::vector<RecvSeg> blocks;
  for (int r = 0; r < size; ++r) blocks.push_back(RecvSeg{static_cast<uint8_t*>(s.buf.data_ptr()) + b * r, b});
  s.buf.reshape(-1).narrow(0, input.numel() * comm.rank, input.numel()).copy_(input.reshape(-1));
  allgatherBlocks(comm, ctx, blocks);
  s.finish();
}

void allgather(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& outs, const at::Tensor& in,
               int size) {
  at::Tensor flat = at::empty({static_cast<int64_t>(size) * in.numel()},
                              in.options().memory_format(at::MemoryFormat::Contiguous));
  const uint64_t b = nbytes(in);
  std::vector<RecvSeg> blocks;
  for (int r = 0; r < size; ++r) blocks.push_back(RecvSeg{static_cast<uint8_t*>(flat.data_ptr()) + b * r, b});
  flat.narrow(0, in.numel() * comm.rank, in.numel()).copy_(in.reshape(-1));
  allgatherBlocks(comm, ctx, blocks);
  for (int r = 0; r < size; ++r) outs[r].copy_(flat.narrow(0, in.numel() * r, in.numel()).view(outs[r].sizes()));
}

// This rank's inputs are packed, back to back, into one byte block (they may differ in shape,
// and in dtype too, as torch's complex-as-real rule allows), one ring allgather moves every
// rank's block, and block r is unpacked into outs[r].
void allgatherCoalesced(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& ins,
                        const std::vector<std::vector<at::Tensor>>& outs, uint64_t bytes, int size) {
  // In the comm's memory (the device of the inputs that hold data: an empty placeholder may be a
  // CPU tensor); the copies are the comm's reducer's (memcpy on the host, a copy on the device
  // link's stream).
  at::Device dev(at::kCPU);
  for (const auto& in : ins)
    if (in.numel() > 0) {
      dev = in.device();
      break;
    }
  at::Tensor flat = at::empty({static_cast<int64_t>(bytes) * size}, at::TensorOptions().dtype(at::kByte).device(dev));
  uint8_t* base = flat.data_ptr<uint8_t>();
  uint64_t off = 0;
  for (const auto& in : ins) {
    const uint64_t b = nbytes(in);
    if (b) comm.reducer->copy(base + bytes * comm.rank + off, in.contiguous().data_ptr(), b);
    off += b;
  }
  std::vector<RecvSeg> blocks;
  for (int r = 0; r < size; ++r) blocks.push_back(RecvSeg{base + bytes * r, bytes});
  allgatherBlocks(comm, ctx, blocks);
  for (int r = 0; r < size; ++r) {
    off = 0;
    for (const auto& o : outs[r]) {
      const uint64_t b = nbytes(o);
      if (b) {
        at::Tensor dst = contiguousOut(o);
        comm.reducer->copy(dst.data_ptr(), base + bytes * r + off, b);
        if (!dst.is_same(o)) o.copy_(dst);
      }
      off += b;
    }
  }
}

void reduceScatterBase(const Comm& comm, const OpCtx& ctx, const at::Tensor& output, const at::Tensor& input,
                       const std::vector<int64_t>& counts, ReduceOp op, double premul, int size) {
  at::Tensor buf = is16BitFloat(input.scalar_type()) ? input.to(at::kFloat).reshape(-1)
                                                     : input.reshape(-1).clone(at::MemoryFormat::Contiguous);
  const DType wire = toDType(buf.scalar_type());
  const Scaling sc = scalingFor(op, premul, size);  // AVG divides before the sum: no overflow
  if (sc.factor != 1.0) comm.reducer->scale(buf.data_ptr(), buf.numel(), wire, sc.factor);
  const uint64_t es = buf.element_size();
  std::vector<RecvSeg> blocks;
  int64_t off = 0, mine = 0;
  for (int r = 0; r < size; ++r) {
    const int64_t c = counts[static_cast<size_t>(r)];
    if (r == comm.rank) mine = off;
    blocks.push_back(RecvSeg{static_cast<uint8_t*>(buf.data_ptr()) + static_cast<uint64_t>(off) * es,
                             static_cast<uint64_t>(c) * es});
    off += c;
  }
  collectivesFor(comm).reduceScatter(comm, ctx, blocks, wire, sc.wire_op);
  output.copy_(buf.narrow(0, mine, output.numel()).view(output.sizes()));
}

void alltoallBase(const Comm& comm, const OpCtx& ctx, const at::Tensor& output, const at::Tensor& input,
                  const std::vector<int64_t>& in_rows, const std::vector<int64_t>& out_rows, int size) {
  Contiguous so(output);
  at::Tensor in = input.contiguous();
  const int64_t in_row = input.dim() == 0 ? 1 : (input.size(0) ? input.numel() / input.size(0) : 0);
  const int64_t out_row = output.dim() == 0 ? 1 : (output.size(0) ? output.numel() / output.size(0) : 0);
  const uint64_t es = input.element_size();
  std::vector<SendSeg> sends;
  std::vector<RecvSeg> recvs;
  uint64_t ioff = 0, ooff = 0;
  for (int r = 0; r < size; ++r) {
    uint64_t ib = static_cast<uint64_t>(in_rows[r] * in_row) * es, ob = static_cast<uint64_t>(out_rows[r] * out_row) * es;
    sends.push_back(SendSeg{static_cast<const uint8_t*>(in.data_ptr()) + ioff, ib});
    recvs.push_back(RecvSeg{static_cast<uint8_t*>(so.buf.data_ptr()) + ooff, ob});
    ioff += ib;
    ooff += ob;
  }
  collectivesFor(comm).alltoall(comm, ctx, sends, recvs);
  so.finish();
}

void alltoall(const Comm& comm, const OpCtx& ctx, const std::vector<at::Tensor>& outs,
              const std::vector<at::Tensor>& ins, int size) {
  std::vector<at::Tensor> in_c, out_c;
  std::vector<SendSeg> sends;
  std::vector<RecvSeg> recvs;
  for (int r = 0; r < size; ++r) {
    in_c.push_back(ins[r].contiguous());
    out_c.push_back(contiguousOut(outs[r]));
    sends.push_back(SendSeg{in_c[r].data_ptr(), nbytes(in_c[r])});
    recvs.push_back(RecvSeg{out_c[r].data_ptr(), nbytes(out_c[r])});
  }
  collectivesFor(comm).alltoall(comm, ctx, sends, recvs);
  for (int r = 0; r < size; ++r)
    if (!out_c[r].is_same(outs[r])) outs[r].copy_(out_c[r]);
}

void gather(const Comm& comm, const OpCtx& ctx, const at::Tensor& in, const std::vector<at::Tensor>& outs, int root) {
  at::Tensor ic = in.contiguous();
  std::vector<at::Tensor> oc;
  std::vector<RecvSeg> blocks;
  for (auto& o : outs) {
    oc.push_back(contiguousOut(o));
    blocks.push_back(RecvSeg{oc.back().data_ptr(), nbytes(oc.back())});
  }
  collectivesFor(comm).gather(comm, ctx, SendSeg{ic.data_ptr(), nbytes(ic)}, blocks, root);
  for (size_t r = 0; r < outs.size(); ++r)
    if (!oc[r].is_same(outs[r])) outs[r].copy_(oc[r]);
}

void scatter(const Comm& comm, const OpCtx& ctx, const at::Tensor& out, const std::vector<at::Tensor>& ins, int root) {
  std::vector<at::Tensor> ic;
  std::vector<SendSeg> blocks;
  for (auto& t : ins) {
    ic.push_back(t.contiguous());
    blocks.push_back(SendSeg{ic.back().data_ptr(), nbytes(ic.back())});
  }
  Contiguous so(out);
  collectivesFor(comm).scatter(comm, ctx, blocks, RecvSeg{so.buf.data_ptr(), nbytes(so.buf)}, root);
  so.finish();
}

void barrier(const Comm& comm, const OpCtx& ctx) {
  collectivesFor(comm).barrier(comm, ctx);
}

}  // namespace xirang::host
