// torch_ln._C: the differentiable operators (csrc/api.cpp) bound for Python's eager calls. torch.ops' generic entry
// converts each argument by the schema and calls the operator boxed; a typed binding reaches the same operator,
// through the same dispatcher, for less: a 4x8 float32 layer_norm took 5.6 us through torch.ops and 3.4 us bound
// here on the dev VM (see the README's per-call overhead).
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/python_numbers.h>
#include <torch/extension.h>
#include <torch_ln/torch_ln.h>

namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// The non-tensor arguments are taken as Python objects and converted here, so that a wrong one gets the same kind of
// error as the operators' own checks: the function, the argument, what was expected and what came. (The tensors
// need no such care: ops.py sends any call whose tensors are not plain tensors to the registered operators.)
[[noreturn]] void wrong_type(py::handle arg, const char* op, const char* name, const char* expected) {
  TORCH_CHECK_TYPE(false, op, ": expected ", name, " to be ", expected, ", but got ", Py_TYPE(arg.ptr())->tp_name);
}

// normalized_shape: an int or a sequence of ints (anything with __index__), as the Python functions take it.
std::vector<int64_t> shape_arg(py::handle shape, const char* op) {
  constexpr const char* kExpected = "an int or a sequence of ints";
  if (PyIndex_Check(shape.ptr())) return {THPUtils_unpackIndex(shape.ptr())};
  if (!PySequence_Check(shape.ptr())) wrong_type(shape, op, "normalized_shape", kExpected);
  std::vector<int64_t> sizes;
  for (const auto size : py::reinterpret_borrow<py::sequence>(shape)) {
    if (!PyIndex_Check(size.ptr())) wrong_type(size, op, "an element of normalized_shape", "an int");
    sizes.push_back(THPUtils_unpackIndex(size.ptr()));
  }
  return sizes;
}

// A float: anything with __float__ or __index__; nullopt for anything else.
std::optional<double> to_double(py::handle arg) {
  const double value = PyFloat_AsDouble(arg.ptr());
  if (value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return std::nullopt;
  }
  return value;
}

double float_arg(py::handle arg, const char* op, const char* name) {
  const auto value = to_double(arg);
  if (!value) wrong_type(arg, op, name, "a float");
  return *value;
}

std::optional<double> optional_float_arg(py::handle arg, const char* op, const char* name) {
  if (arg.is_none()) return std::nullopt;
  const auto value = to_double(arg);
  if (!value) wrong_type(arg, op, name, "a float or None");
  return value;
}

bool bool_arg(py::handle arg, const char* op, const char* name) {
  if (!PyBool_Check(arg.ptr())) wrong_type(arg, op, name, "a bool");
  return arg.ptr() == Py_True;
}

std::optional<at::ScalarType> optional_dtype_arg(py::handle arg, const char* op, const char* name) {
  if (arg.is_none()) return std::nullopt;
  if (!THPDtype_Check(arg.ptr())) wrong_type(arg, op, name, "a torch.dtype or None");
  return reinterpret_cast<THPDtype*>(arg.ptr())->scalar_type;
}

}  // namespace

// As torch's own bindings: c10 errors become their Python exceptions (TypeError, ValueError, ...) and TORCH_WARN a
// Python warning (wrap_pybind_function); the GIL is released while the operator runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm", torch::wrap_pybind_function([](const at::Tensor& input, py::handle shape, const OptTensor& weight,
                                                     const OptTensor& bias, py::handle eps, py::handle weight_offset) {
          constexpr const char* op = "torch_ln.layer_norm";
          const auto sizes = shape_arg(shape, op);
          const double eps_value = float_arg(eps, op, "eps");
          const double offset = float_arg(weight_offset, op, "weight_offset");
          py::gil_scoped_release no_gil;
          return torch_ln::layer_norm(input, sizes, weight, bias, eps_value, offset);
        }));
  m.def("rms_norm",
        torch::wrap_pybind_function([](const at::Tensor& input, py::handle shape, const OptTensor& weight,
                                       py::handle eps, py::handle weight_offset, py::handle round_normalized) {
          constexpr const char* op = "torch_ln.rms_norm";
          const auto sizes = shape_arg(shape, op);
          const auto eps_value = optional_float_arg(eps, op, "eps");
          const double offset = float_arg(weight_offset, op, "weight_offset");
          const bool round = bool_arg(round_normalized, op, "round_normalized");
          py::gil_scoped_release no_gil;
          return torch_ln::rms_norm(input, sizes, weight, eps_value, offset, round);
        }));
  m.def("add_layer_norm",
        torch::wrap_pybind_function([](const at::Tensor& input, const at::Tensor& residual, py::handle shape,
                                       const OptTensor& weight, const OptTensor& bias, py::handle eps,
                                       py::handle residual_dtype, py::handle weight_offset) {
          constexpr const char* op = "torch_ln.add_layer_norm";
          const auto sizes = shape_arg(shape, op);
          const double eps_value = float_arg(eps, op, "eps");
          const auto dtype = optional_dtype_arg(residual_dtype, op, "residual_dtype");
          const double offset = float_arg(weight_offset, op, "weight_offset");
          py::gil_scoped_release no_gil;
          return torch_ln::add_layer_norm(input, residual, sizes, weight, bias, eps_value, dtype, offset);
        }));
  m.def("add_rms_norm",
        torch::wrap_pybind_function([](const at::Tensor& input, const at::Tensor& residual, py::handle shape,
                                       const OptTensor& weight, py::handle eps, py::handle residual_dtype,
                                       py::handle weight_offset, py::handle round_normalized) {
          constexpr const char* op = "torch_ln.add_rms_norm";
          const auto sizes = shape_arg(shape, op);
          const auto eps_value = optional_float_arg(eps, op, "eps");
          const auto dtype = optional_dtype_arg(residual_dtype, op, "residual_dtype");
          const double offset = float_arg(weight_offset, op, "weight_offset");
          const bool round = bool_arg(round_normalized, op, "round_normalized");
          py::gil_scoped_release no_gil;
          return torch_ln::add_rms_norm(input, residual, sizes, weight, eps_value, dtype, offset, round);
        }));
}
