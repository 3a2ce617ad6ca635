// The Python module of the engine's native kernels (engine/kernels/native.py builds it from every source).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache");
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16, "the same, rounded to bf16 (fp32 q, bf16 cache)");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm(x) * weight, rounded to bf16");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; RMSNorm(residual) * weight");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "residual += delta (fp32 or bf16); RMSNorm(residual) * weight in bf16");
  m.def("rope_write_kv", &rope_write_kv, "rotate q and k, write K/V to their cache slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up (gate_up fp32 or bf16), rounded to bf16");
  m.def("int8_rows_prepare", &int8_rows_prepare, "the int8 tier's per-token scaling");
  m.def("int8_rows_finish_", &int8_rows_finish_, "the int8 tier's scale back and fp32 outlier channels");
  py::class_<DecodeLayers>(m, "DecodeLayers", "every layer of a decode-only step in one call")
      .def(py::init<double, int64_t, int64_t, int64_t, double>(), py::arg("eps"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("dim"), py::arg("scale"))
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_onednn_linear", &DecodeLayers::add_onednn_linear)
      .def("add_int8_linear", &DecodeLayers::add_int8_linear)
      // a step takes tens of ms: other Python threads (the server's event loop) run meanwhile
      .def("run", &DecodeLayers::run, py::call_guard<py::gil_scoped_release>())
      .def("run_linears", &DecodeLayers::run_linears, py::call_guard<py::gil_scoped_release>());
}
