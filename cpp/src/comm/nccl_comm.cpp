// The NCCL communicator: one rank per GPU, all driven by one process (one thread per rank),
// created together with ncclCommInitAll. libnccl.so.2 is loaded on first use (dlopen), so
// the library and the Python package work on machines without NCCL; only nccl.h (from the
// nvidia-nccl-cu13 wheel) is needed at build time, for the types and function signatures.
//
// Collectives are stream-ordered: each call enqueues on this thread's current CUDA stream
// (cuda::current_stream()) and returns; the result is complete when the stream reaches it.
// Unlike the CPU communicator, NCCL's reduction order is its own (ring or tree), fixed for a
// given group and size but not rank order: results agree across ranks, not bit for bit with
// a host sum of more than two terms.
//
// All-reduces up to cuda::p2p::default_max_bytes() (8 MiB: every all-reduce of a decode
// step's hidden states up to ~340 rows of GLM-5.3) take the kernels over peer memory instead
// (backend/cuda/p2p_allreduce.h: one kernel, one-shot to 512 KiB then two-shot, no NCCL
// protocol, the CPU communicator's rank order, so bit for bit the CPU communicator's sums)
// when every pair of the group's GPUs has peer access; DFLASH2_P2P_ALLREDUCE_MAX_KB=0 keeps
// NCCL for all.
//
// Status: compiled in CI; never run on a GPU yet (tests/cpp/test_nccl.cpp is the check).
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "dflash2/error.h"

#if defined(DFLASH2_WITH_CUDA) && defined(DFLASH2_WITH_NCCL)
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <mutex>

#include "backend/cuda/cuda_api.h"
#include "backend/cuda/p2p_allreduce.h"
#if defined(DFLASH2_CUDA_EMULATED)
#include "cpp/emu/nccl_emu.h"
#endif

namespace dflash2::comm {
namespace {

// The entry points used, typed from nccl.h and resolved from the loaded library.
struct Nccl {
  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclCommInitAll) CommInitAll = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
  void* handle = nullptr;
  std::string error;  // why loading failed (empty when loaded)
  std::string path;
};

// Candidates, in order: $DFLASH2_NCCL_LIBRARY, the library found at build time, and the
// loader's own search (LD_LIBRARY_PATH, ldconfig) for libnccl.so.2.
const Nccl& nccl() {
  static Nccl n;
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(DFLASH2_CUDA_EMULATED)
    // the CPU emulator's build: its in-process NCCL over the emulated devices (cpp/emu)
    n.GetVersion = &emu::nccl::GetVersion;
    n.GetErrorString = &emu::nccl::GetErrorString;
    n.CommInitAll = &emu::nccl::CommInitAll;
    n.CommDestroy = &emu::nccl::CommDestroy;
    n.CommAbort = &emu::nccl::CommAbort;
    n.CommGetAsyncError = &emu::nccl::CommGetAsyncError;
    n.AllReduce = &emu::nccl::AllReduce;
    n.AllGather = &emu::nccl::AllGather;
    n.ReduceScatter = &emu::nccl::ReduceScatter;
    n.Broadcast = &emu::nccl::Broadcast;
    n.handle = &n;  // not a library
    n.path = "the CPU emulator (cpp/emu/nccl_emu.cpp)";
    return;
#endif
    std::vector<std::string> paths;
    if (const char* env = std::getenv("DFLASH2_NCCL_LIBRARY"); env && *env) paths.emplace_back(env);
#ifdef DFLASH2_NCCL_LIBRARY_PATH
    paths.emplace_back(DFLASH2_NCCL_LIBRARY_PATH);
#endif
    paths.emplace_back("libnccl.so.2");
    std::string tried;
    for (const std::string& p : paths) {
      n.handle = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (n.handle) {
        n.path = p;
        break;
      }
      const char* e = dlerror();
      tried += "\n  " + p + ": " + (e ? e : "not found");
    }
    if (!n.handle) {
      n.error = "cannot load NCCL (pip install nvidia-nccl-cu13, or set DFLASH2_NCCL_LIBRARY to libnccl.so.2); tried:" +
                tried;
      return;
    }
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(n.handle, name));
      if (!fn) {
        ok = false;
        n.error += std::string(n.error.empty() ? "" : ", ") + name;
      }
    };
    sym(n.GetVersion, "ncclGetVersion");
    sym(n.GetErrorString, "ncclGetErrorString");
    sym(n.CommInitAll, "ncclCommInitAll");
    sym(n.CommDestroy, "ncclCommDestroy");
    sym(n.CommAbort, "ncclCommAbort");
    sym(n.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(n.AllReduce, "ncclAllReduce");
    sym(n.AllGather, "ncclAllGather");
    sym(n.ReduceScatter, "ncclReduceScatter");
    sym(n.Broadcast, "ncclBroadcast");
    if (!ok) {
      n.error = n.path + " lacks the NCCL entry points " + n.error;
      dlclose(n.handle);
      n.handle = nullptr;
    }
  });
  return n;
}

const Nccl& loaded() {
  const Nccl& n = nccl();
  DFLASH2_CHECK(n.handle, ErrorKind::Backend, n.error);
  return n;
}

void check(ncclResult_t r, const char* what, int rank) {
  if (r == ncclSuccess) return;
  fail(ErrorKind::Backend, "NCCL ", what, " on rank ", rank, " failed: ", loaded().GetErrorString(r), " (", int(r),
       ")");
}

void check_cuda(cudaError_t e, const char* what) {
  DFLASH2_CHECK(e == cudaSuccess, ErrorKind::Backend, what, ": ", cudaGetErrorString(e));
}

class NcclComm final : public Communicator {
 public:
  NcclComm(ncclComm_t c, int rank, int size, int device, std::shared_ptr<cuda::p2p::Group> p2p)
      : c_(c), rank_(rank), size_(size), dev_(device), p2p_(std::move(p2p)) {}
  ~NcclComm() override {
    if (c_) loaded().CommDestroy(c_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  void all_reduce_sum(Tensor& x) override {
    need(x, "all_reduce_sum", "x", true);
    stats_.all_reduce_calls++;
    stats_.all_reduce_bytes += int64_t(x.nbytes());
    enter();
    if (peer_words(x.nbytes(), {x.data()})) {
      stats_.all_reduce_p2p_calls++;
      p2p_->all_reduce_sum(rank_, static_cast<float*>(x.data()), x.numel());
      return;
    }
    check(loaded().AllReduce(x.data(), x.data(), size_t(x.numel()), ncclFloat32, ncclSum, c_, stream()),
          "all_reduce_sum", rank_);
  }
  bool all_reduce_sum_add(Tensor& x, Tensor& acc, const Tensor* x2) override {
    // the peer-memory kernels only, over what they read as flat F32 arrays (else the caller's steps)
    auto flat_like_x = [&](const Tensor& t) {
      return t.defined() && t.is_contiguous() && t.dtype() == DType::F32 && t.numel() == x.numel() &&
             t.device() == x.device();
    };
    if (!peer_words(x.nbytes(), {x.data()}) || !flat_like_x(acc) || (x2 && !flat_like_x(*x2))) return false;
    need(x, "all_reduce_sum_add", "x", true);
    stats_.all_reduce_calls++;
    stats_.all_reduce_bytes += int64_t(x.nbytes());
    enter();
    stats_.all_reduce_p2p_calls++;
    p2p_->all_reduce_sum(rank_, static_cast<float*>(x.data()), x.numel(), static_cast<float*>(acc.data()),
                         x2 ? static_cast<const float*>(x2->data()) : nullptr);
    return true;
  }
  void all_gather(const Tensor& in, Tensor& out) override {
    need(in, "all_gather", "in", false);
    need(out, "all_gather", "out", false);
    DFLASH2_CHECK_ARG(in.dtype() == out.dtype() && out.numel() == in.numel() * size_,
                      "comm::all_gather: out must hold size x the elements of in, found ", in.describe(), " and ",
                      out.describe());
    stats_.all_gather_calls++;
    stats_.all_gather_bytes += int64_t(out.nbytes());
    enter();
    if (peer_words(in.nbytes(), {in.data(), out.data()})) {
      stats_.all_gather_p2p_calls++;
      p2p_->all_gather(rank_, in.data(), int64_t(in.nbytes() / 4), out.data());
      return;
    }
    check(loaded().AllGather(in.data(), out.data(), in.nbytes(), ncclChar, c_, stream()), "all_gather", rank_);
  }
  void reduce_scatter_sum(const Tensor& in, Tensor& out) override {
    need(in, "reduce_scatter_sum", "in", true);
    need(out, "reduce_scatter_sum", "out", true);
    DFLASH2_CHECK_ARG(in.numel() == out.numel() * size_, "comm::reduce_scatter_sum: in must hold size x out's ",
                      "elements, found ", in.describe(), " and ", out.describe());
    stats_.reduce_scatter_calls++;
    stats_.reduce_scatter_bytes += int64_t(in.nbytes());
    enter();
    check(loaded().ReduceScatter(in.data(), out.data(), size_t(out.numel()), ncclFloat32, ncclSum, c_, stream()),
          "reduce_scatter_sum", rank_);
  }
  void broadcast(Tensor& x, int root) override {
    DFLASH2_CHECK_ARG(root >= 0 && root < size_, "comm::broadcast: root ", root, " outside [0, ", size_, ")");
    need(x, "broadcast", "x", false);
    stats_.broadcast_calls++;
    stats_.broadcast_bytes += int64_t(x.nbytes());
    enter();
    if (peer_words(x.nbytes(), {x.data()})) {
      stats_.broadcast_p2p_calls++;
      p2p_->broadcast(rank_, x.data(), int64_t(x.nbytes() / 4), root);
      return;
    }
    check(loaded().Broadcast(x.data(), x.data(), x.nbytes(), ncclChar, root, c_, stream()), "broadcast", rank_);
  }
  // a one-element all-reduce, then waiting for this rank's stream
  void barrier() override {
    stats_.barrier_calls++;
    enter();
    if (!flag_.defined()) flag_ = Tensor::zeros(DType::F32, {1}, Device::cuda(dev_));
    check(loaded().AllReduce(flag_.data(), flag_.data(), 1, ncclFloat32, ncclSum, c_, stream()), "barrier", rank_);
    check_cuda(cudaStreamSynchronize(stream()), "comm::barrier: cudaStreamSynchronize");
  }
  void abort() override {
    if (p2p_) p2p_->abort();
    if (c_) loaded().CommAbort(c_);
    c_ = nullptr;
  }
  void reset() override {
    DFLASH2_CHECK(c_, ErrorKind::Unsupported,
                  "an aborted NCCL group cannot be reset: its communicators are gone; create the group again");
  }

 private:
  static cudaStream_t stream() { return reinterpret_cast<cudaStream_t>(cuda::current_stream()); }
  // whether a move of `bytes` per rank at these addresses takes the peer-memory kernels
  // (whole 4-byte words at 4-byte aligned addresses, within the group's limit)
  bool peer_words(size_t bytes, std::initializer_list<const void*> ptrs) const {
    if (!p2p_ || bytes % 4 != 0 || bytes > p2p_->max_bytes()) return false;
    for (const void* q : ptrs)
      if (reinterpret_cast<uintptr_t>(q) % 4 != 0) return false;
    return true;
  }
  void need(const Tensor& t, const char* op, const char* arg, bool f32) const {
    DFLASH2_CHECK_ARG(t.defined() && t.device().is_cuda() && t.device().index == dev_ && t.is_contiguous() &&
                          (!f32 || t.dtype() == DType::F32),
                      "comm::", op, ": '", arg, "' must be a contiguous ", f32 ? "F32 " : "", "tensor on cuda:", dev_,
                      " (rank ", rank_, "), found ", t.describe());
  }
  void enter() {
    DFLASH2_CHECK(c_, ErrorKind::Backend, "NCCL communicator of rank ", rank_, " was aborted");
    // another rank failed mid-step and aborted the group: this rank is a bystander (the step
    // reports the failing rank's error, not this one)
    if (p2p_ && p2p_->aborted()) throw CollectiveAborted();
    check_cuda(cudaSetDevice(dev_), "comm: cudaSetDevice");
    ncclResult_t async = ncclSuccess;
    check(loaded().CommGetAsyncError(c_, &async), "async error query", rank_);
    check(async, "an earlier collective (asynchronous error)", rank_);
    if (p2p_) {
      const std::string e = p2p_->error();
      DFLASH2_CHECK(e.empty(), ErrorKind::Backend, "rank ", rank_, ": an earlier collective over peer memory failed: ", e);
    }
  }
  ncclComm_t c_;
  int rank_, size_, dev_;
  std::shared_ptr<cuda::p2p::Group> p2p_;  // collectives up to its max_bytes (nullptr: NCCL for all)
  Tensor flag_;
};

}  // namespace

bool nccl_available(std::string* why) {
  const Nccl& n = nccl();
  if (!n.handle) {
    if (why) *why = n.error;
    return false;
  }
  std::string cw;
  if (!cuda::available(&cw)) {
    if (why) *why = "NCCL loaded from " + n.path + " but no CUDA device is usable: " + cw;
    return false;
  }
  if (why) *why = "";
  return true;
}

std::string nccl_version() {
  const Nccl& n = nccl();
  if (!n.handle) return "";
  int v = 0;
  if (n.GetVersion(&v) != ncclSuccess) return "";
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& devices) {
  DFLASH2_CHECK_ARG(!devices.empty(), "make_nccl_group: at least one device is needed");
  std::string why;
  DFLASH2_CHECK(nccl_available(&why), ErrorKind::Backend, "NCCL tensor parallelism: ", why);
  const int count = cuda::device_count();
  for (size_t i = 0; i < devices.size(); ++i) {
    DFLASH2_CHECK_ARG(devices[i] >= 0 && devices[i] < count, "make_nccl_group: ", devices.size(),
                      " ranks need as many GPUs; device ", devices[i], " does not exist (this machine has ", count,
                      ")");
    for (size_t j = 0; j < i; ++j)
      DFLASH2_CHECK_ARG(devices[i] != devices[j], "make_nccl_group: device ", devices[i], " is listed twice");
  }
  const int n = int(devices.size());
  std::vector<ncclComm_t> comms(size_t(n), nullptr);
  check(loaded().CommInitAll(comms.data(), n, devices.data()), "ncclCommInitAll", 0);
  // the collectives over peer memory where every pair of GPUs has peer access (one rank: nothing to move)
  std::shared_ptr<cuda::p2p::Group> p2p;
  std::string p2p_why = "one rank";
  if (n > 1) {
    try {
      p2p = cuda::p2p::Group::create(devices, cuda::p2p::default_max_bytes(), cuda::p2p::default_timeout_s(),
                                     &p2p_why);
    } catch (const Error& e) {  // e.g. no memory for its buffers: NCCL still does everything
      p2p_why = std::string("the collectives over peer memory could not be set up: ") + e.what();
      std::fprintf(stderr, "dflash2: %s\n", p2p_why.c_str());
    }
  }
  if (p2p) {  // checked once before any step relies on it: NCCL for everything if it fails
    const std::string bad = p2p->self_check();
    if (!bad.empty()) {
      p2p_why = "the load-time check of the collectives over peer memory failed (" + bad + ")";
      std::fprintf(stderr, "dflash2: %s: every collective goes through NCCL\n", p2p_why.c_str());
      p2p.reset();
    }
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    auto c = std::make_unique<NcclComm>(comms[size_t(r)], r, n, devices[size_t(r)], p2p);
    c->set_peer_all_reduce(p2p ? "" : p2p_why);
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace dflash2::comm

#else  // built without CUDA or without nccl.h

namespace dflash2::comm {

bool nccl_available(std::string* why) {
  if (why)
    *why = "this build has no NCCL support (build with the CUDA backend and the nvidia-nccl-cu13 wheel installed)";
  return false;
}

std::string nccl_version() { return ""; }

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>&) {
  fail(ErrorKind::Unsupported,
       "NCCL tensor parallelism: this build has no NCCL support (build with the CUDA backend and the "
       "nvidia-nccl-cu13 wheel installed)");
}

}  // namespace dflash2::comm

#endif
