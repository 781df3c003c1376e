// pybind11 bindings of quant_core._C. Pointers, sizes and strides come from quant_core._cpp;
// nothing here knows about torch, and every kernel runs with the GIL released.
#include <pybind11/pybind11.h>

#include "kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "quant-core CPU kernels (private: call them through quant_core).";
  m.attr("__version__") = QUANT_CORE_VERSION;
  m.def("amax", &quant_core::amax, py::arg("x_MK"), py::arg("dtype"), py::arg("M"), py::arg("K"),
        py::arg("stride_row"), py::arg("stride_col"), py::arg("amax_out"), py::arg("num_threads"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cast_to_fp8", &quant_core::cast_to_fp8, py::arg("x_MK"), py::arg("dtype"), py::arg("M"),
        py::arg("K"), py::arg("stride_row"), py::arg("stride_col"), py::arg("scale"),
        py::arg("fp8_format"), py::arg("rowwise_MK"), py::arg("columnwise_KM"),
        py::arg("num_threads"), py::call_guard<py::gil_scoped_release>());
}
