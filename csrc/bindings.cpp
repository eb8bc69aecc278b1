// Thin torch binding of csrc/copy_kernel.cu, built as ds_resilience.kernels._copy_cuda.
//
// ds_resilience/kernels/copy.py does the planning (integer views of the element width, dims
// collapsed, alignment chosen); this file checks devices and sizes, resolves the destination's
// device address (pinned host memory through cudaHostGetDevicePointer), and launches on the
// current CUDA stream of the source's device. Nothing here synchronizes.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace dsr_copy {  // defined in csrc/copy_kernel.cu (C++ linkage: a signature drift fails to link)
cudaError_t launch_copy_contiguous(const void* src, void* dst, int64_t nbytes, uint32_t* checksum, int max_blocks,
                                   cudaStream_t stream);
cudaError_t launch_copy_strided(const void* src, void* dst, int64_t numel, int elem_size, int ndim,
                                const int64_t* sizes, const int64_t* strides, uint32_t* checksum, int max_blocks,
                                cudaStream_t stream);
}  // namespace dsr_copy

namespace {

constexpr int64_t kMaxDims = 8;

// A device address for dst: its own pointer on the source's device, or the mapped address of
// pinned host memory (the kernels then write over PCIe/NVLink-C2C directly).
void* device_address(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_cuda()) {
    TORCH_CHECK(dst.device() == src.device(), "copy_chunk: dst on ", dst.device(), " but src on ", src.device());
    return dst.data_ptr();
  }
  TORCH_CHECK(dst.device().is_cpu() && dst.is_pinned(), "copy_chunk: a host dst must be pinned memory");
  void* base = dst.storage().mutable_data();
  void* mapped = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&mapped, base, 0);
  TORCH_CHECK(err == cudaSuccess, "copy_chunk: pinned dst has no device mapping: ", cudaGetErrorString(err));
  const auto offset = static_cast<char*>(dst.data_ptr()) - static_cast<char*>(base);
  return static_cast<char*>(mapped) + offset;
}

uint32_t* checksum_address(const std::optional<at::Tensor>& out, const at::Tensor& src) {
  if (!out.has_value()) return nullptr;
  const at::Tensor& t = *out;
  TORCH_CHECK(t.is_cuda() && t.device() == src.device(), "copy_chunk: checksum_out must be on ", src.device());
  TORCH_CHECK(t.scalar_type() == at::kInt && t.numel() == 2 && t.is_contiguous(),
              "copy_chunk: checksum_out must be a contiguous int32 tensor of 2 elements");
  return reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>());
}

void check_pair(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.is_cuda(), "copy_chunk: src must be a CUDA tensor");
  TORCH_CHECK(dst.is_contiguous(), "copy_chunk: dst must be contiguous");
  TORCH_CHECK(src.element_size() == dst.element_size(), "copy_chunk: src and dst views must have one element size");
  TORCH_CHECK(src.numel() == dst.numel(), "copy_chunk: src has ", src.numel(), " elements, dst ", dst.numel());
}

void check(cudaError_t code, const char* what) {
  TORCH_CHECK(code == cudaSuccess, "copy_chunk: ", what, " failed: ", cudaGetErrorString(code));
}

// src: a dense 1-D view; dst: contiguous, same element size and numel.
void copy_contiguous(const at::Tensor& src, const at::Tensor& dst, const std::optional<at::Tensor>& checksum_out,
                     int64_t max_blocks) {
  check_pair(src, dst);
  TORCH_CHECK(src.is_contiguous(), "copy_contiguous: src must be contiguous");
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.get_device()).stream();
  const int64_t nbytes = src.numel() * static_cast<int64_t>(src.element_size());
  check(dsr_copy::launch_copy_contiguous(src.data_ptr(), device_address(dst, src), nbytes, checksum_address(checksum_out, src),
                            static_cast<int>(max_blocks), stream),
        "dense copy kernel launch");
}

// src: a view whose elements sit at sum(index[d] * strides[d]) from src.data_ptr(), sizes outermost first.
void copy_strided(const at::Tensor& src, const at::Tensor& dst, const std::vector<int64_t>& sizes,
                  const std::vector<int64_t>& strides, const std::optional<at::Tensor>& checksum_out,
                  int64_t max_blocks) {
  check_pair(src, dst);
  TORCH_CHECK(sizes.size() == strides.size(), "copy_strided: ", sizes.size(), " sizes but ", strides.size(), " strides");
  TORCH_CHECK(!sizes.empty() && static_cast<int64_t>(sizes.size()) <= kMaxDims, "copy_strided: 1 to ", kMaxDims,
              " dims, got ", sizes.size());
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.get_device()).stream();
  check(dsr_copy::launch_copy_strided(src.data_ptr(), device_address(dst, src), src.numel(), static_cast<int>(src.element_size()),
                         static_cast<int>(sizes.size()), sizes.data(), strides.data(),
                         checksum_address(checksum_out, src), static_cast<int>(max_blocks), stream),
        "strided copy kernel launch");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_resilience copy kernel (csrc/copy_kernel.cu): chunk -> staging buffer with an optional checksum";
  m.def("copy_contiguous", &copy_contiguous, "dense copy (16-byte vectors where aligned, byte tail)",
        py::arg("src"), py::arg("dst"), py::arg("checksum_out") = py::none(), py::arg("max_blocks") = 0);
  m.def("copy_strided", &copy_strided, "strided copy, up to 8 collapsed dims, element strides", py::arg("src"),
        py::arg("dst"), py::arg("sizes"), py::arg("strides"), py::arg("checksum_out") = py::none(),
        py::arg("max_blocks") = 0);
}
