// kvstore._blockio: the nanobind face of the batched block-file engine (blockio.hpp). The Python
// wrapper is kvstore/tiers/nvme/blockio.py; it builds the headers, checks what comes back, and owns
// every policy (what is a miss, what is removed, what is counted).
#include "blockio.hpp"

#include <memory>
#include <mutex>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <tuple>

namespace nb = nanobind;
using namespace nb::literals;
using namespace blockio;

namespace {

// Buffers held for one call (released with the GIL held, after the work).
struct Views {
    std::vector<Py_buffer> v;
    ~Views() {
        for (auto& b : v) PyBuffer_Release(&b);
    }
    uint8_t* get(nb::handle h, bool writable, size_t min_len, const char* what, bool direct) {
        Py_buffer b;
        if (PyObject_GetBuffer(h.ptr(), &b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) {
            PyErr_Clear();
            throw nb::value_error((std::string("blockio: ") + what + " must be a C-contiguous" +
                                   (writable ? " writable" : "") + " buffer").c_str());
        }
        v.push_back(b);
        if (size_t(b.len) < min_len)
            throw nb::value_error((std::string("blockio: ") + what + " of " + std::to_string(b.len) +
                                   " bytes, need " + std::to_string(min_len)).c_str());
        if (direct && ((uintptr_t(b.buf) % 4096) || (b.len % 4096)))
            throw nb::value_error((std::string("blockio: ") + what +
                                   " must be 4 KiB aligned in address and length for O_DIRECT").c_str());
        return static_cast<uint8_t*>(b.buf);
    }
    size_t len() const { return size_t(v.back().len); }
};

void same_len(size_t n, size_t m, const char* what) {
    if (n != m) throw nb::value_error((std::string("blockio: ") + what + " differ in length").c_str());
}

class Engine {
public:
    Engine(const std::string& backend, int depth, int threads)
        : depth_(depth < 1 ? 1 : depth), threads_(threads < 1 ? 1 : threads) {
        if (backend != "auto" && backend != "io_uring" && backend != "threads")
            throw nb::value_error("blockio: backend must be auto, io_uring or threads");
        if (backend != "threads") b_.reset(make_uring(depth_, threads_, reason_));
        if (!b_ && backend == "io_uring") throw std::runtime_error("blockio: io_uring unavailable: " + reason_);
        if (!b_) b_.reset(make_threads(depth_));
        if (backend == "threads") reason_ = "threads asked for";
    }

    std::vector<std::tuple<int, int>> write(int root_fd, int tmp_fd, const std::vector<std::string>& names,
                                            const std::vector<std::string>& tmp_names, nb::list payloads,
                                            const std::vector<int64_t>& payload_lens, nb::list headers,
                                            const std::vector<double>& mtimes, bool inline_hdr, bool o_direct,
                                            bool hash, const std::vector<bool>& reuse) {
        const size_t n = names.size();
        if (!reuse.empty()) same_len(n, reuse.size(), "names and reuse");
        same_len(n, tmp_names.size(), "names and tmp_names");
        same_len(n, nb::len(payloads), "names and payloads");
        same_len(n, payload_lens.size(), "names and payload_lens");
        same_len(n, nb::len(headers), "names and headers");
        same_len(n, mtimes.size(), "names and mtimes");
        if (hash && !have_xxhash()) throw nb::value_error("blockio: built without xxhash: write with hash=False");
        Views views;
        std::vector<WriteJob> jobs(n);
        for (size_t i = 0; i < n; ++i) {
            WriteJob& j = jobs[i];
            j.name = names[i].c_str();
            j.tmp_name = tmp_names[i].c_str();
            j.payload = views.get(payloads[i], false, 0, "payload", o_direct);
            j.payload_io = views.len();
            if (payload_lens[i] < 0 || size_t(payload_lens[i]) > j.payload_io)
                throw nb::value_error("blockio: a payload_len exceeds its payload buffer");
            j.payload_len = size_t(payload_lens[i]);
            j.hdr = views.get(headers[i], true, inline_hdr ? HEADER_BYTES : HEADER_CORE, "header",
                              o_direct && inline_hdr);
            j.mtime = mtimes[i];
            j.reuse = !reuse.empty() && reuse[i];
        }
        Ctx c;
        c.root_fd = root_fd;
        c.tmp_fd = tmp_fd;
        c.inline_hdr = inline_hdr;
        c.o_direct = o_direct;
        c.hash = hash;
        {
            nb::gil_scoped_release release;
            backend().write(jobs, c);
        }
        std::vector<std::tuple<int, int>> out(n);
        for (size_t i = 0; i < n; ++i) out[i] = {jobs[i].err, jobs[i].stage};
        return out;
    }

    std::vector<std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, uint64_t>> read(
        int root_fd, const std::vector<std::string>& names, nb::list dsts, nb::list headers,
        const std::vector<double>& mtimes, bool inline_hdr, bool o_direct, bool hash) {
        const size_t n = names.size();
        same_len(n, nb::len(dsts), "names and dsts");
        same_len(n, nb::len(headers), "names and headers");
        same_len(n, mtimes.size(), "names and mtimes");
        if (hash && !have_xxhash()) throw nb::value_error("blockio: built without xxhash: read with hash=False");
        Views views;
        std::vector<ReadJob> jobs(n);
        for (size_t i = 0; i < n; ++i) {
            ReadJob& j = jobs[i];
            j.name = names[i].c_str();
            j.dst = views.get(dsts[i], true, 0, "dst", o_direct);
            j.dst_len = views.len();
            j.hdr = views.get(headers[i], true, HEADER_BYTES, "header", o_direct && inline_hdr);
            j.mtime = mtimes[i];
        }
        Ctx c;
        c.root_fd = root_fd;
        c.inline_hdr = inline_hdr;
        c.o_direct = o_direct;
        c.hash = hash;
        {
            nb::gil_scoped_release release;
            backend().read(jobs, c);
        }
        std::vector<std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, uint64_t>> out(n);
        for (size_t i = 0; i < n; ++i) {
            const ReadJob& j = jobs[i];
            out[i] = {j.status, j.err, j.size, j.got, j.hdr_len, j.hashed, j.checksum};
        }
        return out;
    }

    void close() {
        std::unique_ptr<Backend> b;
        {
            std::lock_guard<std::mutex> g(m_);
            b.swap(b_);
        }
        nb::gil_scoped_release release;
        b.reset();  // joins the thread pool
    }

    std::string name() const { return b_ ? b_->name() : "closed"; }
    const std::string& reason() const { return reason_; }
    int depth() const { return depth_; }
    uint64_t helped() const { return b_ ? b_->helped() : 0; }
    uint64_t wait_errors() const { return b_ ? b_->wait_errors() : 0; }
    int threads() const { return b_ && std::string(b_->name()) == "io_uring" ? threads_ : 1; }

private:
    Backend& backend() {
        if (!b_) throw std::runtime_error("blockio: engine is closed");
        return *b_;
    }
    int depth_, threads_;
    std::string reason_;
    std::mutex m_;
    std::unique_ptr<Backend> b_;
};

}  // namespace

NB_MODULE(_blockio, m) {
    m.doc() = "Batched block-file I/O for the NVMe tier: io_uring at depth, or a pwritev/preadv thread pool";
#ifdef BLOCKIO_HAVE_URING
    m.attr("HAVE_URING") = true;
#else
    m.attr("HAVE_URING") = false;
#endif
    m.attr("HAVE_XXHASH") = have_xxhash();
    m.attr("HEADER_BYTES") = HEADER_BYTES;
    m.attr("HEADER_CORE") = HEADER_CORE;
    m.def("xxh3_64", [](nb::handle buf) {
        if (!have_xxhash()) throw nb::value_error("blockio: built without xxhash");
        Views v;
        const uint8_t* p = v.get(buf, false, 0, "buffer", false);
        const size_t n = v.len();
        nb::gil_scoped_release release;
        return xxh3(p, n);
    }, "buffer"_a, "xxh3-64 of a buffer (the same value as xxhash.xxh3_64_intdigest)");
    nb::class_<Engine>(m, "Engine")
        .def(nb::init<const std::string&, int, int>(), "backend"_a = "auto", "depth"_a = 8, "threads"_a = 1)
        .def_prop_ro("threads", &Engine::threads)
        .def_prop_ro("helped", &Engine::helped)
        .def_prop_ro("wait_errors", &Engine::wait_errors)
        .def_prop_ro("backend", &Engine::name)
        .def_prop_ro("reason", &Engine::reason)
        .def_prop_ro("depth", &Engine::depth)
        .def("write", &Engine::write, "root_fd"_a, "tmp_fd"_a, "names"_a, "tmp_names"_a, "payloads"_a,
             "payload_lens"_a, "headers"_a, "mtimes"_a, "inline"_a, "o_direct"_a, "hash"_a = true,
             "reuse"_a = std::vector<bool>())
        .def("read", &Engine::read, "root_fd"_a, "names"_a, "dsts"_a, "headers"_a, "mtimes"_a, "inline"_a,
             "o_direct"_a, "hash"_a = true)
        .def("close", &Engine::close);
}
