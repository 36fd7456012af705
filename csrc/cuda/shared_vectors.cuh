// Vectors kept in a block's shared memory by the shared-memory kernels (forward.cuh, backward.cuh).
#pragma once

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

}  // namespace torch_ln
