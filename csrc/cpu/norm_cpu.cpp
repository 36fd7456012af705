// The CPU entry points: a call's dtypes to the kernels instantiated for them (norm_cpu_<dtype>.cpp).
#include "norm_cpu.h"

#include <cstdint>
#include <cstdlib>
#include <string_view>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "../dispatch.h"

namespace torch_ln {
namespace {

// A large output that glibc has just mapped (M_MMAP_THRESHOLD tops out at 32 MiB, so every call at that size gets
// fresh pages) costs one page fault per 4 KiB on first write: on the 2-core dev VM, 32 MiB took 11 ms of faults
// against 3.4 ms with 2 MiB pages, for torch's outputs as for ours. With TORCH_LN_HUGE_PAGES=1, a fresh output gets
// transparent huge pages (c10's THP_MEM_ALLOC_ENABLE does the same for every allocation): only its 2 MiB-aligned
// interior, which the kernel writes whole, so no memory is added; only when its first page is not yet resident
// (mincore), so reused heap memory is left alone. Opt-in, as c10's is: a huge-page fault may stall (compaction;
// on the dev VM, 64 MiB fills of usually 6 ms took up to 479 ms now and then, against at most 26 ms with 4 KiB pages).
void advise_huge_pages(const at::Tensor& output) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  static const bool enabled = [] {
    const char* setting = std::getenv("TORCH_LN_HUGE_PAGES");
    return setting != nullptr && std::string_view(setting) == "1";
  }();
  if (!enabled || !output.defined() || output.nbytes() < 2 * kHugePage) return;
  const auto begin = reinterpret_cast<uintptr_t>(output.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1),
                  last = (begin + output.nbytes()) & ~(kHugePage - 1);
  if (last <= first) return;
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(first), 1, &resident) != 0 || (resident & 1) != 0) return;
  madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice: a refusal changes nothing
#else
  (void)output;
#endif
}

}  // namespace

void cpu_norm_forward(NormKind kind, const ForwardArgs& a) {
  advise_huge_pages(a.y);
  advise_huge_pages(a.residual_out);
  const auto rows = a.residual_out.defined() ? a.residual_out.scalar_type() : a.x.scalar_type();
  dispatch_dtypes(a.x.scalar_type(), parameter_dtype(a.x, a.weight, a.bias), rows,
                  [&](auto types) { cpu_forward<decltype(types)>(kind, a); });
}

void cpu_norm_backward(NormKind kind, const BackwardArgs& a) {
  advise_huge_pages(a.dx);
  dispatch_dtypes(a.dy.scalar_type(), parameter_dtype(a.dy, a.weight, a.dbias), a.x.scalar_type(),
                  [&](auto types) { cpu_backward<decltype(types)>(kind, a); });
}

}  // namespace torch_ln
