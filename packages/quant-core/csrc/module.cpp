// pybind11 bindings of quant_core._C. Pointers, sizes and strides come from quant_core._cpp;
// nothing here knows about torch, and every kernel runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "quant-core CPU kernels (private: call them through quant_core).";
  m.attr("__version__") = QUANT_CORE_VERSION;
  m.def("amax", &quant_core::amax, py::arg("x_MK"), py::arg("dtype"), py::arg("M"), py::arg("K"),
        py::arg("stride_row"), py::arg("stride_col"), py::arg("amax_out"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("amax_many", &quant_core::amax_many, py::arg("x_MKs"), py::arg("dtypes"), py::arg("Ms"), py::arg("Ks"),
        py::arg("stride_rows"), py::arg("stride_cols"), py::arg("amax_out"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cast_to_fp8", &quant_core::cast_to_fp8, py::arg("x_MK"), py::arg("dtype"), py::arg("M"),
        py::arg("K"), py::arg("stride_row"), py::arg("stride_col"), py::arg("scale"),
        py::arg("fp8_format"), py::arg("rowwise_MK"), py::arg("columnwise_KM"),
        py::arg("num_threads"), py::call_guard<py::gil_scoped_release>());

  // The scales, the block formats, dequantize, transposes and the Hadamard transform: positional
  // arguments exactly as declared in kernels.h.
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("fp8_scale", &quant_core::fp8_scale, release);
  m.def("delayed_fp8_scale", &quant_core::delayed_fp8_scale, release);
  m.def("quantize_mxfp8", &quant_core::quantize_mxfp8, release);
  m.def("quantize_fp8_blockwise", &quant_core::quantize_fp8_blockwise, release);
  m.def("quantize_nvfp4", &quant_core::quantize_nvfp4, release);
  m.def("quantize_fp8_chunks", &quant_core::quantize_fp8_chunks, release);
  m.def("dequantize_sum_fp8_chunks", &quant_core::dequantize_sum_fp8_chunks, release);
  m.def("dequantize_fp8", &quant_core::dequantize_fp8, release);
  m.def("dequantize_mxfp8", &quant_core::dequantize_mxfp8, release);
  m.def("dequantize_fp8_blockwise", &quant_core::dequantize_fp8_blockwise, release);
  m.def("dequantize_nvfp4", &quant_core::dequantize_nvfp4, release);
  m.def("transpose_bytes", &quant_core::transpose_bytes, release);
  m.def("transpose_nvfp4", &quant_core::transpose_nvfp4, release);
  m.def("hadamard_transform_16", &quant_core::hadamard_transform_16, release);
  m.def("hadamard_amaxes", &quant_core::hadamard_amaxes, release);

  py::class_<quant_core::AdamScalars>(m, "AdamScalars")
      .def(py::init<float, float, float, float, float, float, float, float, float>(), py::arg("decay"),
           py::arg("weight_decay"), py::arg("beta1"), py::arg("one_minus_beta1"), py::arg("beta2"),
           py::arg("one_minus_beta2"), py::arg("inv_bias_correction2_sqrt"), py::arg("eps"), py::arg("step_size"));
  m.def("adam_step", &quant_core::adam_step, release);
  m.def("adam_moment_amaxes", &quant_core::adam_moment_amaxes, release);
  m.def("has_non_finite", &quant_core::has_non_finite, release);
}
