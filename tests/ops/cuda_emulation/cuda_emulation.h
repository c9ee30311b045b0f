// Just enough of the CUDA programming model to run the selective-scan kernels on the CPU, for tests.
//
// A grid runs one block after another; a block runs as kThreads std::threads. __syncthreads is a barrier of the
// block, and a warp shuffle is an exchange through a block-wide array between two barriers, so it is exact for
// code in which every thread of the block reaches the shuffle together (as in these kernels). __shared__ becomes
// `static`: one copy per kernel instantiation, which is per block since blocks do not overlap.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <barrier>
#include <functional>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(...)

namespace emulation {

struct Index {
  unsigned x = 0, y = 0, z = 0;
};

inline thread_local Index thread_index;
inline Index block_index;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<float> exchange;

// Runs body() on every thread of every block of a (grid_x, grid_y) grid.
inline void launch(unsigned grid_x, unsigned grid_y, int threads, const std::function<void()>& body) {
  std::barrier<> barrier(threads);
  block_barrier = &barrier;
  exchange.assign(threads, 0.f);
  for (unsigned y = 0; y < grid_y; ++y) {
    for (unsigned x = 0; x < grid_x; ++x) {
      block_index = {x, y, 0};
      std::vector<std::thread> workers;
      for (int t = 0; t < threads; ++t) {
        workers.emplace_back([t, &body] {
          thread_index = {static_cast<unsigned>(t), 0, 0};
          body();
        });
      }
      for (auto& worker : workers) worker.join();
    }
  }
  block_barrier = nullptr;
}

// The value `value` held by the thread whose lane is source(lane) (or this thread's own value if out of the warp).
template <typename Source>
float shuffle(float value, Source source) {
  const unsigned me = thread_index.x, lane = me % 32;
  exchange[me] = value;
  block_barrier->arrive_and_wait();
  const int from = source(static_cast<int>(lane));
  const float result = from >= 0 && from < 32 ? exchange[me - lane + from] : value;
  block_barrier->arrive_and_wait();
  return result;
}

}  // namespace emulation

#define threadIdx (::emulation::thread_index)
#define blockIdx (::emulation::block_index)

inline void __syncthreads() { emulation::block_barrier->arrive_and_wait(); }
inline float __shfl_up_sync(unsigned, float value, unsigned delta) {
  return emulation::shuffle(value, [delta](int lane) { return lane - static_cast<int>(delta); });
}
inline float __shfl_down_sync(unsigned, float value, unsigned delta) {
  return emulation::shuffle(value, [delta](int lane) { return lane + static_cast<int>(delta); });
}
inline float __shfl_xor_sync(unsigned, float value, int mask) {
  return emulation::shuffle(value, [mask](int lane) { return lane ^ mask; });
}
inline float atomicAdd(float* address, float value) { return std::atomic_ref<float>(*address).fetch_add(value); }
