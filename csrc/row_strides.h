// Where each row of a strided input starts, shared by the host, the CPU kernels and the CUDA kernels.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TLN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TLN_HOST_DEVICE inline
#endif

namespace torch_ln {

// The rows of an input whose leading dimensions, flattened, are at most two strides deep: rows come in groups of
// inner_rows, `inner` elements apart within a group and `outer` apart from one group to the next (the q heads of a
// packed QKV projection: inner = head_dim, outer = the token's width; transposed leading dimensions). One level
// (inner_rows 0): row r starts at r * inner (cols when contiguous, 0 for a broadcast row).
// Two levels only below 2^32 rows (strided_rows): the row's group comes from a 32-bit division, as a 64-bit one
// raised the register count of every forward register kernel, contiguous rows included.
struct RowStrides {
  int64_t inner = 0;
  int64_t inner_rows = 0;
  int64_t outer = 0;

  TLN_HOST_DEVICE int64_t offset(int64_t row) const {
    if (inner_rows == 0) return row * inner;
    const auto r = static_cast<uint32_t>(row), n = static_cast<uint32_t>(inner_rows);
    return static_cast<int64_t>(r / n) * outer + static_cast<int64_t>(r % n) * inner;
  }
  // Every row starts a multiple of `elements` past the base (the vector width, for aligned vector access).
  TLN_HOST_DEVICE bool multiple_of(int64_t elements) const {
    return inner % elements == 0 && (inner_rows == 0 || outer % elements == 0);
  }
};

}  // namespace torch_ln
