// The moments kernel's arguments for a list of tensors, read from the tensors' C++ objects.
//
// From Python, each property of each tensor (device, layout, contiguity, negation bit, dtype,
// data pointer, element count) is one call through torch's bindings, some 0.1 us apiece: about
// 1 us per tensor per pass, more than the kernel's own pass over a small tensor. Here the whole
// list is read in one call, about 0.1 us per tensor (mostly the list's conversion).

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

namespace {

// Writes, for every tensor, its data pointer, element count and dtype code (float32_code or
// bfloat16_code) into the caller's arrays at the addresses given (each with room for one entry
// per tensor). Returns false, at the first tensor the kernel does not take: not a dense strided
// CPU tensor with storage, not contiguous, carrying a lazy negation, of another dtype, or
// non-empty without a data pointer (freed storage). The arrays are then partly written.
bool pack(const std::vector<at::Tensor>& tensors, uintptr_t addresses, uintptr_t numels, uintptr_t codes,
          int32_t float32_code, int32_t bfloat16_code) {
  auto* xs = reinterpret_cast<uint64_t*>(addresses);
  auto* ns = reinterpret_cast<int64_t*>(numels);
  auto* cs = reinterpret_cast<int32_t*>(codes);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || !t.device().is_cpu() || t.layout() != c10::kStrided || !t.has_storage() ||
        t.unsafeGetTensorImpl()->is_python_dispatch() || !t.is_contiguous() || t.is_neg()) {
      return false;
    }
    const auto dtype = t.scalar_type();
    if (dtype == c10::ScalarType::Float) {
      cs[i] = float32_code;
    } else if (dtype == c10::ScalarType::BFloat16) {
      cs[i] = bfloat16_code;
    } else {
      return false;
    }
    const int64_t n = t.numel();
    const void* data = t.const_data_ptr();
    if (n != 0 && data == nullptr) {
      return false;
    }
    xs[i] = reinterpret_cast<uint64_t>(data);
    ns[i] = n;
  }
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "The moments kernel's arguments for a list of tensors (see tensor_lists.py).");
}
