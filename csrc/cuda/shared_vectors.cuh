// Vectors kept in a block's shared memory by the shared-memory kernels (forward.cuh, backward.cuh).
#pragma once

#include "gate.cuh"
#include "launch_plan.h"
#include "reduce.cuh"

namespace torch_ln {

// Vectors of VEC elements kept in shared memory as E, in 16-byte pieces: piece h of vector c at h * count + c, so
// that a warp's lanes touch consecutive 16-byte pieces (no bank conflicts, even for 32-byte vectors: float
// parameters or a float32 residual stream beside 16-bit inputs).
template <typename E, int VEC>
struct SharedVectors {
  static constexpr int kPieceElems = VEC * sizeof(E) > kVectorBytes ? kVectorBytes / sizeof(E) : VEC;
  using Piece = Vec<E, kPieceElems>;

  Piece* pieces;
  int64_t count;

  // The bytes `count` vectors take.
  static constexpr size_t bytes(int64_t count) { return static_cast<size_t>(count) * VEC * sizeof(E); }

  TLN_DEVICE void store(int64_t c, const Vec<E, VEC>& v, dev::Site site = TLN_SITE) const {
#pragma unroll
    for (int h = 0; h < VEC / kPieceElems; ++h) {
      Piece piece;
#pragma unroll
      for (int j = 0; j < kPieceElems; ++j) piece.v[j] = v.v[h * kPieceElems + j];
      dev::store_shared(&pieces[h * count + c], piece, site);
    }
  }

  // Vector c copied from global memory at `src` by cp.async (the calling thread's open group).
  TLN_DEVICE void copy_async(int64_t c, const E* src, dev::Site site = TLN_SITE) const {
    static_assert(sizeof(Piece) == kVectorBytes, "cp.async moves 16-byte pieces");
#pragma unroll
    for (int h = 0; h < VEC / kPieceElems; ++h) dev::copy_async_16(&pieces[h * count + c], src + h * kPieceElems, site);
  }

  template <typename acc_t>
  TLN_DEVICE void load(int64_t c, acc_t (&out)[VEC], dev::Site site = TLN_SITE) const {
#pragma unroll
    for (int h = 0; h < VEC / kPieceElems; ++h) {
      const Piece piece = dev::load_shared(&pieces[h * count + c], site);
#pragma unroll
      for (int j = 0; j < kPieceElems; ++j) out[h * kPieceElems + j] = static_cast<acc_t>(piece.v[j]);
    }
  }
};

// The register kernels' prefetch of their next tiles (the forward's x, the backward's x and dy): a ring of `stages`
// stages in shared memory of one stream's vectors, ITEMS a thread, which each thread copies from global memory into
// its own slots by cp.async (one commit group a tile, ring_turn) and reads back itself: no barrier, no mbarrier. Slot
// (stage, k) of a thread is vector (stage * ITEMS + k) * threads + thread (consecutive 16-byte pieces across a warp).
template <typename E, int VEC, int ITEMS>
struct ThreadRing {
  SharedVectors<E, VEC> vectors;
  int64_t threads, thread;

  static constexpr size_t bytes(int stages, int64_t block_threads) {
    return SharedVectors<E, VEC>::bytes(int64_t{stages} * ITEMS * block_threads);
  }

  TLN_DEVICE ThreadRing(unsigned char* base, int stages, int64_t block_threads)
      : vectors{reinterpret_cast<typename SharedVectors<E, VEC>::Piece*>(base),
                int64_t{stages} * ITEMS * block_threads},
        threads(block_threads),
        thread(dev::thread_x()) {}

  TLN_DEVICE int64_t slot(int stage, int k) const { return (int64_t{stage} * ITEMS + k) * threads + thread; }

  // Copies the thread's vectors of a row (`row`: its first element) into `stage`: those in the row (nvec vectors),
  // the only ones a kernel reads back.
  TLN_DEVICE void copy(const E* row, const RowLayout& layout, int64_t nvec, int stage) const {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (layout.vector(k) < nvec) vectors.copy_async(slot(stage, k), row + layout.vector(k) * VEC);
    }
  }

  template <typename acc_t>
  TLN_DEVICE void load(int stage, int k, acc_t (&out)[VEC]) const {
    vectors.load(slot(stage, k), out);
  }
};

// Whether a register kernel instance may prefetch through a ThreadRing: vectorized rows (cp.async moves 16-byte
// pieces) with float32 sums; not float64's (bound by their arithmetic) nor the gated instances' (their gate's loads
// would still wait).
constexpr bool ring_prefetches(int vec, int acc_bytes, bool gated) { return vec > 1 && acc_bytes == 4 && !gated; }

// A ring's turn at a tile, once the copies of the tile stages - 1 ahead are issued (none past the last tile): they
// close their group, and this tile's group, stages - 1 groups older, is waited for (3 stages: two tiles in flight).
TLN_DEVICE void ring_turn(int stages) {
  dev::copy_async_commit();
  if (stages == 3) {
    dev::copy_async_wait<2>();
  } else {
    dev::copy_async_wait<1>();
  }
}

// The stage after `stage` in a ring of `stages`.
TLN_DEVICE int next_stage(int stage, int stages) { return stage + 1 == stages ? 0 : stage + 1; }

// The stage before `stage` in a ring of `stages`: the one the last use read, which the next copy refills.
TLN_DEVICE int previous_stage(int stage, int stages) { return stage == 0 ? stages - 1 : stage - 1; }

// A register kernel's walk of its prefetch ring over its tiles (first_tile, first_tile + tile_step, ... below
// batch_rows), stages - 1 tiles ahead, one commit group a tile. copy_tile(ring, p, walk, layout, tile, batch_rows,
// stage), beside each kernel, copies a thread's row of a tile into a stage (nothing past the last row).
template <typename Ring, typename Params>
struct RingWalk {
  const Ring& ring;
  const Params& p;
  // Copies, not references: by reference ptxas (sm_90) kept both alive apart and gave 4 forward instances 1-5
  // registers more (bfloat16 LayerNorm's 8x2 tier 80 -> 85: 6 -> 5 blocks an SM).
  GroupWalk walk;
  RowLayout layout;
  int64_t tile_step, batch_rows;
  int stages;

  TLN_DEVICE RingWalk(const Ring& r, const Params& params, const GroupWalk& w, const RowLayout& l, int64_t step,
                      int64_t rows, int s)
      : ring(r), p(params), walk(w), layout(l), tile_step(step), batch_rows(rows), stages(s) {}

  // Before the first tile: the tiles ahead of it, one group each.
  TLN_DEVICE void fill(int64_t first_tile) const {
    for (int s = 0; s + 1 < stages; ++s) {
      copy_tile(ring, p, walk, layout, first_tile + s * tile_step, batch_rows, s);
      dev::copy_async_commit();
    }
  }

  // At `tile`, in `stage`: the copies of the tile stages - 1 ahead into the stage before this one (an empty group
  // past the last tile), then this tile's wait.
  TLN_DEVICE void turn(int64_t tile, int stage) const {
    copy_tile(ring, p, walk, layout, tile + (stages - 1) * tile_step, batch_rows, previous_stage(stage, stages));
    ring_turn(stages);
  }
};

// Vector c of block `rank`'s copy of `sums` in its cluster (distributed shared memory).
template <typename E, int VEC, typename acc_t>
TLN_DEVICE void load_from_rank(const SharedVectors<E, VEC>& sums, unsigned rank, int64_t c, acc_t (&out)[VEC]) {
  using Piece = typename SharedVectors<E, VEC>::Piece;
  const SharedVectors<E, VEC> remote{const_cast<Piece*>(dev::cluster_shared(sums.pieces, rank)), sums.count};
  remote.load(c, out);
}

// This block's slice of a row staged over `cluster` blocks of `slice_vectors` vectors each (consecutive ranks of a
// thread-block cluster, which may hold several such groups): its first vector in the row and how many it holds (the
// last slice may be shorter; the planner's smallest cluster leaves none empty, where one would loop zero times).
struct RowSlice {
  int64_t first, count;
};

TLN_DEVICE RowSlice row_slice(int64_t row_vectors, int64_t slice_vectors, int cluster) {
  const int64_t first = int64_t{cluster > 1 ? dev::cluster_rank() % cluster : 0} * slice_vectors;
  const int64_t rest = row_vectors - first;
  return {first, rest < slice_vectors ? rest : slice_vectors};
}

// A block's slice of the rows it walks, kept in shared memory as stored in global memory (16-byte vectors, whose
// SharedVectors layout is then the row's own) and loaded there by sm_90's copy engine (bulk copies) in `stages` chunks,
// each completing on an mbarrier of its own (`full`): a kernel's passes over a row wait for one chunk at a time, and
// thread 0 refills a chunk with the block's next row as soon as the block's last pass over the chunk has read it, so
// the next row's loads are in flight during this row's reductions and stores, with no registers held for them. Each
// thread arrives on the chunk's second mbarrier (`empty`) after its last read of the chunk, and only thread 0 waits
// for the block's arrivals before the refill: no block barrier a chunk, the other warps go on. A slice may be several
// arrays of the same vectors (the backward's x and dy: streams), on one `full` mbarrier a chunk.
struct SliceRing {
  // Where a stream's vectors go (its slice in shared memory) and come from (the row's slice in global memory).
  struct Stream {
    unsigned char* shared;
    const void* global;
  };

  uint64_t* full;   // a chunk's mbarrier: one arrival (thread 0's, expecting its bytes), one phase per row
  uint64_t* empty;  // a chunk's mbarrier: every thread's arrival once it has read the chunk, one phase per row
  int64_t count;    // vectors in the slice
  int64_t chunk;    // vectors per chunk: whole rounds of the block's threads (0: no bulk loads)
  int stages;

  // `barriers`: 2 x stages mbarriers (SharedRowLayout::stages).
  TLN_DEVICE SliceRing(unsigned char* barriers, int64_t count, int stages, int threads)
      : full(reinterpret_cast<uint64_t*>(barriers)),
        empty(full + stages),
        count(count),
        chunk(stages > 0 ? ((count + stages - 1) / stages + threads - 1) / threads * threads : 0),
        stages(stages) {}

  // Vectors [begin(k), end(k)) of the slice are chunk k's (none for the last chunks of a short slice).
  TLN_DEVICE int64_t begin(int k) const { return k * chunk < count ? k * chunk : count; }
  TLN_DEVICE int64_t end(int k) const { return (k + 1) * chunk < count ? (k + 1) * chunk : count; }

  // Thread 0, once: the mbarriers (a block barrier must follow before the other threads wait on them); `threads`:
  // the block's, every one of which releases every chunk.
  TLN_DEVICE void init(int threads) const {
    for (int k = 0; k < stages; ++k) {
      dev::mbarrier_init(&full[k], 1);
      dev::mbarrier_init(&empty[k], threads);
    }
  }
  // Where `loads` (thread 0, for a row before the last's end): the copies of chunks [from, to) of a row's streams,
  // after the block's reads of those chunks' previous row.
  template <typename... Streams>
  TLN_DEVICE void load(bool loads, int from, int to, const Streams&... streams) const {
    for (int k = from; loads && k < to; ++k) {
      if (begin(k) == end(k)) continue;
      const auto bytes = static_cast<unsigned>((end(k) - begin(k)) * kVectorBytes);
      const auto offset = begin(k) * kVectorBytes;
      dev::mbarrier_arrive_expect_tx(&full[k], bytes * sizeof...(Streams));
      (dev::bulk_load_shared(streams.shared + offset, static_cast<const unsigned char*>(streams.global) + offset, bytes,
                             &full[k]),
       ...);
    }
  }
  // Every thread, before reading chunk k of the row of this `parity` (rows alternate).
  TLN_DEVICE void wait(int k, unsigned parity) const {
    if (begin(k) < end(k)) dev::mbarrier_wait(&full[k], parity);
  }
  // Every thread reading the slice round by round (chunks are whole rounds of the block's `threads`), before round
  // `round`: a wait for the chunks not yet waited for (the first `waited`) that begin at or before it.
  TLN_DEVICE void wait_through_round(int& waited, int round, int threads, unsigned parity) const {
    for (; waited < stages && begin(waited) <= int64_t{round} * threads; ++waited) wait(waited, parity);
  }
  // Every thread, after its last read of chunk k of the row of this `parity`; thread 0 (`producer`) then waits for
  // the block's reads before it refills the chunk (load). The arrival's release and the wait's acquire order the
  // reads before the refill's proxy fence and copy.
  TLN_DEVICE void release(int k, unsigned parity, bool producer) const {
    if (begin(k) == end(k)) return;
    dev::mbarrier_arrive(&empty[k]);
    if (producer) dev::mbarrier_wait(&empty[k], parity);
  }
};

}  // namespace torch_ln
