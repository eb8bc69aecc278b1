// ds_resilience copy kernel: a device tensor chunk -> a contiguous buffer (device memory or pinned
// host memory through its mapped device address), optionally checksummed in the same pass.
//
// Pure CUDA: no torch headers. csrc/bindings.cpp is the thin torch binding; it calls the two
// entry points at the bottom of this file on the current stream.
//
// Checksum (defined once in ds_resilience/kernels/checksum.py): the copied bytes, zero-padded to
// whole little-endian 32-bit words w[i], give
//     S1 = sum w[i]            mod 2^32
//     S2 = sum (i + 1) * w[i]  mod 2^32
// uint32_t arithmetic wraps modulo 2^32, so every thread sums its own words, warps and blocks
// reduce, and one atomicAdd per block and sum publishes the result: exact and independent of the
// order of the additions. The caller passes a device pointer to two uint32_t (S1, S2) or nullptr.
//
// Paths:
//   * vec16:   src and dst 16-byte aligned: uint4 loads (ld.global.nc) and stores, kUnroll vectors
//              in flight per thread, grid-stride; the last nbytes % 16 bytes take a byte tail path.
//   * word:    both 4-byte aligned: the same with uint32_t and a tail of up to 3 bytes.
//   * strided: any element size in {1, 2, 4, 8}, up to kMaxDims collapsed dims with element
//              strides (also serves dense data at other alignments as one dim of stride 1).
// The grid is capped (max_blocks, default: one block per SM) so the copy leaves most of the
// machine to a concurrent compute kernel; each thread then loops.

#include <cuda_runtime.h>

#include <cstdint>

namespace dsr_copy {

constexpr int kThreads = 256;  // a multiple of 32 (block_publish relies on it)
constexpr int kUnroll = 4;     // vectors in flight per thread and iteration
constexpr int kMaxDims = 8;

struct StridedLayout {
  int32_t ndim;
  int64_t sizes[kMaxDims];    // outermost first
  int64_t strides[kMaxDims];  // in elements
};

__device__ __forceinline__ void add_word(uint32_t& s1, uint32_t& s2, uint32_t word, uint64_t index) {
  s1 += word;
  s2 += word * static_cast<uint32_t>(index + 1);  // wraps mod 2^32 by definition
}

// Sum s1, s2 over the block and add them to out[0], out[1]. Every thread of the block must call it.
__device__ void block_publish(uint32_t s1, uint32_t s2, uint32_t* out) {
  __shared__ uint32_t shared1[kThreads / 32];
  __shared__ uint32_t shared2[kThreads / 32];
  const unsigned full = 0xffffffffu;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    s1 += __shfl_down_sync(full, s1, offset);
    s2 += __shfl_down_sync(full, s2, offset);
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    shared1[warp] = s1;
    shared2[warp] = s2;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    s1 = lane < warps ? shared1[lane] : 0u;
    s2 = lane < warps ? shared2[lane] : 0u;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      s1 += __shfl_down_sync(full, s1, offset);
      s2 += __shfl_down_sync(full, s2, offset);
    }
    if (lane == 0 && (s1 | s2)) {
      atomicAdd(out, s1);
      atomicAdd(out + 1, s2);
    }
  }
}

// Bytes [start, start + count) of the chunk, count < blockDim.x, done by block 0 (the tail path).
template <bool kChecksum>
__device__ __forceinline__ void copy_tail_bytes(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                                int64_t start, int count, uint32_t& s1, uint32_t& s2) {
  if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < count) {
    const int64_t p = start + threadIdx.x;
    const uint8_t b = src[p];
    dst[p] = b;
    if (kChecksum) {
      add_word(s1, s2, static_cast<uint32_t>(b) << (8 * (p & 3)), static_cast<uint64_t>(p >> 2));
    }
  }
}

// Dense copy in units of Vec (uint4: 16 bytes, 4 words; uint32_t: 1 word), then the byte tail.
template <typename Vec, bool kChecksum>
__global__ void __launch_bounds__(kThreads) copy_dense_kernel(const Vec* __restrict__ src, Vec* __restrict__ dst,
                                                              int64_t nvec, int tail_bytes, uint32_t* checksum) {
  constexpr int kWords = sizeof(Vec) / 4;
  uint32_t s1 = 0, s2 = 0;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kUnroll;
  const int64_t step = tile * gridDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * tile + threadIdx.x; base < nvec; base += step) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < nvec) v[u] = __ldg(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < nvec) {
        dst[i] = v[u];
        if (kChecksum) {
          const uint32_t* w = reinterpret_cast<const uint32_t*>(&v[u]);
          const uint64_t first = static_cast<uint64_t>(i) * kWords;
#pragma unroll
          for (int k = 0; k < kWords; ++k) add_word(s1, s2, w[k], first + k);
        }
      }
    }
  }
  copy_tail_bytes<kChecksum>(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst),
                             nvec * static_cast<int64_t>(sizeof(Vec)), tail_bytes, s1, s2);
  if (kChecksum) block_publish(s1, s2, checksum);
}

// Checksum contribution of element i (T is an unsigned integer of the element's width).
template <typename T>
__device__ __forceinline__ void add_element(uint32_t& s1, uint32_t& s2, T x, int64_t i) {
  if constexpr (sizeof(T) == 8) {
    const uint64_t v = static_cast<uint64_t>(x);
    add_word(s1, s2, static_cast<uint32_t>(v), 2 * static_cast<uint64_t>(i));
    add_word(s1, s2, static_cast<uint32_t>(v >> 32), 2 * static_cast<uint64_t>(i) + 1);
  } else if constexpr (sizeof(T) == 4) {
    add_word(s1, s2, static_cast<uint32_t>(x), static_cast<uint64_t>(i));
  } else {
    const int64_t p = i * static_cast<int64_t>(sizeof(T));  // byte position in the chunk
    add_word(s1, s2, static_cast<uint32_t>(x) << (8 * (p & 3)), static_cast<uint64_t>(p >> 2));
  }
}

template <typename T, bool kChecksum>
__global__ void __launch_bounds__(kThreads) copy_strided_kernel(const T* __restrict__ src, T* __restrict__ dst,
                                                                int64_t numel, StridedLayout layout,
                                                                uint32_t* checksum) {
  uint32_t s1 = 0, s2 = 0;
  const int64_t step = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += step) {
    int64_t rest = i;
    int64_t offset = 0;
    for (int d = layout.ndim - 1; d >= 0; --d) {
      const int64_t size = layout.sizes[d];
      const int64_t q = rest / size;
      offset += (rest - q * size) * layout.strides[d];
      rest = q;
    }
    const T x = src[offset];
    dst[i] = x;
    if (kChecksum) add_element<T>(s1, s2, x, i);
  }
  if (kChecksum) block_publish(s1, s2, checksum);
}

int device_sms() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 108;
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 108;
  if (cached[device] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 108;
    cached[device] = sms;
  }
  return cached[device];
}

int grid_for(int64_t work_items, int64_t items_per_block, int max_blocks) {
  const int64_t cap = max_blocks > 0 ? max_blocks : device_sms();
  int64_t blocks = (work_items + items_per_block - 1) / items_per_block;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return static_cast<int>(blocks);
}

template <typename Vec>
cudaError_t launch_dense(const void* src, void* dst, int64_t nbytes, uint32_t* checksum, int max_blocks,
                         cudaStream_t stream) {
  const int64_t nvec = nbytes / static_cast<int64_t>(sizeof(Vec));
  const int tail = static_cast<int>(nbytes - nvec * static_cast<int64_t>(sizeof(Vec)));
  const int grid = grid_for(nvec, static_cast<int64_t>(kThreads) * kUnroll, max_blocks);
  const Vec* s = static_cast<const Vec*>(src);
  Vec* d = static_cast<Vec*>(dst);
  if (checksum != nullptr) {
    copy_dense_kernel<Vec, true><<<grid, kThreads, 0, stream>>>(s, d, nvec, tail, checksum);
  } else {
    copy_dense_kernel<Vec, false><<<grid, kThreads, 0, stream>>>(s, d, nvec, tail, nullptr);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_strided(const void* src, void* dst, int64_t numel, const StridedLayout& layout,
                           uint32_t* checksum, int max_blocks, cudaStream_t stream) {
  const int grid = grid_for(numel, static_cast<int64_t>(kThreads) * kUnroll, max_blocks);
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  if (checksum != nullptr) {
    copy_strided_kernel<T, true><<<grid, kThreads, 0, stream>>>(s, d, numel, layout, checksum);
  } else {
    copy_strided_kernel<T, false><<<grid, kThreads, 0, stream>>>(s, d, numel, layout, nullptr);
  }
  return cudaGetLastError();
}

cudaError_t prepare_checksum(uint32_t* checksum, cudaStream_t stream) {
  return checksum != nullptr ? cudaMemsetAsync(checksum, 0, 2 * sizeof(uint32_t), stream) : cudaSuccess;
}

// ---------------------------------------------------------------------------------- entry points
// Declared again in csrc/bindings.cpp (C++ linkage on purpose: the mangled names carry the
// parameter types, so a signature drift between the two files fails at link time).
// Both launch on `stream` and never synchronize.
// `dst` is a device address (for pinned host memory: its mapped device pointer).
// `checksum`: device pointer to 2 x uint32_t (S1, S2), zeroed here on `stream`, or nullptr.
// `max_blocks` <= 0: one block per SM.

cudaError_t launch_copy_contiguous(const void* src, void* dst, int64_t nbytes, uint32_t* checksum, int max_blocks,
                                   cudaStream_t stream) {
  if (nbytes < 0 || (nbytes > 0 && (src == nullptr || dst == nullptr))) return cudaErrorInvalidValue;
  cudaError_t err = prepare_checksum(checksum, stream);
  if (err != cudaSuccess || nbytes == 0) return err;
  const uintptr_t both = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if ((both & 15u) == 0) return launch_dense<uint4>(src, dst, nbytes, checksum, max_blocks, stream);
  if ((both & 3u) == 0) return launch_dense<uint32_t>(src, dst, nbytes, checksum, max_blocks, stream);
  StridedLayout dense{};
  dense.ndim = 1;
  dense.sizes[0] = nbytes;
  dense.strides[0] = 1;
  return launch_strided<uint8_t>(src, dst, nbytes, dense, checksum, max_blocks, stream);
}

cudaError_t launch_copy_strided(const void* src, void* dst, int64_t numel, int elem_size, int ndim,
                                const int64_t* sizes, const int64_t* strides, uint32_t* checksum, int max_blocks,
                                cudaStream_t stream) {
  if (numel < 0 || ndim < 1 || ndim > kMaxDims || sizes == nullptr || strides == nullptr) return cudaErrorInvalidValue;
  if (numel > 0 && (src == nullptr || dst == nullptr)) return cudaErrorInvalidValue;
  StridedLayout layout{};
  layout.ndim = ndim;
  int64_t count = 1;
  for (int d = 0; d < ndim; ++d) {
    if (sizes[d] < 1 || strides[d] < 0) return cudaErrorInvalidValue;
    layout.sizes[d] = sizes[d];
    layout.strides[d] = strides[d];
    count *= sizes[d];
  }
  if (count != numel) return cudaErrorInvalidValue;
  cudaError_t err = prepare_checksum(checksum, stream);
  if (err != cudaSuccess || numel == 0) return err;
  switch (elem_size) {
    case 1:
      return launch_strided<uint8_t>(src, dst, numel, layout, checksum, max_blocks, stream);
    case 2:
      return launch_strided<uint16_t>(src, dst, numel, layout, checksum, max_blocks, stream);
    case 4:
      return launch_strided<uint32_t>(src, dst, numel, layout, checksum, max_blocks, stream);
    case 8:
      return launch_strided<uint64_t>(src, dst, numel, layout, checksum, max_blocks, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dsr_copy
