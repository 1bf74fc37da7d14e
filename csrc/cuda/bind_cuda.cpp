// _kvcopy_cuda: Python bindings of the CUDA copy path (see kvcopy_cuda.cu).
// Compiled by the host compiler; links the nvcc-built kvcopy_cuda_core and a
// static cudart, so importing this module needs no CUDA library on the path
// (calls fail cleanly, and device_count() returns 0, where there is no driver).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <stdexcept>

#include "cuda/kvcopy_cuda.h"

namespace nb = nanobind;

namespace {

using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Geom = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
using Strides4 = std::tuple<int64_t, int64_t, int64_t, int64_t>;

// Completion of one enqueued copy (owns a cudaEvent_t).
class Event {
  public:
    Event(void* ev, int mode, int device) : ev_(ev), mode_(mode), device_(device) {}
    ~Event() { kvcopy_cuda::event_destroy(ev_); }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    bool query() const { return kvcopy_cuda::event_query(ev_); }
    void synchronize() const {
        nb::gil_scoped_release r;
        kvcopy_cuda::event_synchronize(ev_);
    }
    void wait(uintptr_t stream) const { kvcopy_cuda::stream_wait_event(stream, ev_); }
    const char* mode() const { return mode_ == kvcopy_cuda::kDma ? "dma" : "kernel"; }
    int device() const { return device_; }
    uintptr_t handle() const { return (uintptr_t)ev_; }

  private:
    void* ev_;
    int mode_;
    int device_;
};

Event* copy_blocks(bool to_store, U64 layer_ptrs, const Geom& geom, const Strides4& paged,
                   const Strides4& store, I64 block_ids, U64 block_ptrs, int mode,
                   uintptr_t stream, int device, int max_ctas) {
    kvcopy_cuda::Request r;
    std::tie(r.g.num_layers, r.g.num_kv, r.g.num_heads, r.g.block_size, r.g.row_bytes,
             r.g.num_blocks) = geom;
    std::tie(r.g.s_block, r.g.s_kv, r.g.s_head, r.g.s_tok) = paged;
    std::tie(r.g.t_layer, r.g.t_kv, r.g.t_head, r.g.t_tok) = store;
    if ((int64_t)layer_ptrs.shape(0) != r.g.num_layers)
        throw nb::value_error("kvcopy: one cache pointer per layer expected");
    if (block_ids.shape(0) != block_ptrs.shape(0))
        throw nb::value_error("kvcopy: block_ids and store blocks differ in length");
    if (mode < 0 || mode > 2) throw nb::value_error("kvcopy: mode must be 0 (auto), 1 (kernel) or 2 (dma)");
    if (max_ctas < 0) throw nb::value_error("kvcopy: max_ctas must be >= 0 (0: the default grid)");
    r.layer_ptrs = layer_ptrs.data();
    r.ids = block_ids.data();
    r.blocks = block_ptrs.data();
    r.n = (int64_t)block_ids.shape(0);
    r.to_store = to_store;
    r.mode = mode;
    r.stream = stream;
    r.device = device;
    r.max_ctas = max_ctas;
    int used = 0;
    void* ev;
    {
        nb::gil_scoped_release release;
        ev = kvcopy_cuda::copy(r, &used);
    }
    return new Event(ev, used, device);
}

}  // namespace

NB_MODULE(_kvcopy_cuda, m) {
    m.doc() = "kvstore CUDA copy kernels (one-launch gather/scatter, batched DMA)";
    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const std::out_of_range& e) {
            PyErr_SetString(PyExc_IndexError, e.what());
        } catch (const std::invalid_argument& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        }
    });
    nb::class_<Event>(m, "Event", "Completion of an enqueued copy (a CUDA event).")
        .def("query", &Event::query, "True once the copy has completed.")
        .def("synchronize", &Event::synchronize, "Block the calling thread until done.")
        .def("wait", &Event::wait, nb::arg("stream"),
             "Make `stream` (a cudaStream_t as int) wait for the copy, without blocking the host.")
        .def_prop_ro("mode", &Event::mode)
        .def_prop_ro("device", &Event::device)
        .def_prop_ro("handle", &Event::handle);
    m.def("copy_blocks", &copy_blocks, nb::arg("to_store"), nb::arg("layer_ptrs"),
          nb::arg("geom"), nb::arg("paged_strides"), nb::arg("store_strides"),
          nb::arg("block_ids"), nb::arg("block_ptrs"), nb::arg("mode") = 0,
          nb::arg("stream") = 0, nb::arg("device") = 0, nb::arg("max_ctas") = 0, nb::rv_policy::take_ownership,
          "Enqueue a gather (to_store=True) or scatter on `stream`; returns an Event.");
    m.def("device_count", &kvcopy_cuda::device_count);
    m.def("runtime_info", &kvcopy_cuda::runtime_info);
    m.def("set_dma_min_run", &kvcopy_cuda::set_dma_min_run, nb::arg("nbytes"),
          "mode='auto' uses DMA when contiguous runs are at least this long.");
    m.def("get_dma_min_run", &kvcopy_cuda::get_dma_min_run);
    m.def("set_use_batch_api", &kvcopy_cuda::set_use_batch_api, nb::arg("on"));
    m.attr("ABI_VERSION") = 1;
}
