// pagoda/parallel.h: split a loop over OpenMP threads, the thread count given by the caller.
//
// Python passes torch.get_num_threads() into every kernel call: an engine step may run on a
// thread whose OpenMP settings (ICVs) are not the main thread's, and the kernels must use the
// threads torch was told to use. The libraries link the OpenMP runtime torch loaded, so these
// threads are torch's pool (see pagoda.cpp_extension).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace pagoda {

// fn(begin, end) over [begin, end) in one contiguous range per thread, each range at least `grain`
// long, on up to `threads` threads; on the calling thread alone when one range would do or when
// already inside a parallel region (as at::parallel_for does).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t ranges = std::min<int64_t>(threads, (n + grain - 1) / grain);
  if (ranges <= 1 || omp_in_parallel()) {
    fn(begin, end);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(ranges))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t lo = begin + t * chunk, hi = std::min(end, lo + chunk);
    if (lo < hi) fn(lo, hi);
  }
}

}  // namespace pagoda
