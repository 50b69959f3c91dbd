#include "runtime/step_graphs.h"

#include <cstdio>
#include <exception>

#include "dflash2/error.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2::runtime {

#ifdef DFLASH2_WITH_CUDA

ForwardGraphs::ForwardGraphs(Device dev, CUstream_st* stream, size_t max_graphs)
    : dev_(dev), max_graphs_(max_graphs), stream_(stream) {
  DFLASH2_INTERNAL(dev.is_cuda(), "CUDA graphs on ", dev.str());
  if (!stream_) {
    stream_ = cuda::stream_create(dev.index);
    own_stream_ = true;
  }
}

ForwardGraphs::~ForwardGraphs() {
  for (auto& kv : graphs_) cuda::graph_destroy(kv.second.exec);
  if (own_stream_) cuda::stream_destroy(stream_, dev_.index);
}

void ForwardGraphs::run(const std::string& key, const std::function<void()>& fn) {
  cuda::StreamScope scope(stream_);
  auto it = graphs_.find(key);
  ++tick_;
  if (it == graphs_.end()) {  // first sight: warm up eagerly
    if (graphs_.size() >= max_graphs_ && !graphs_.empty()) {
      // full: the least recently used key without a graph goes, else the least recently used
      auto lru = graphs_.end();
      for (auto e = graphs_.begin(); e != graphs_.end(); ++e)
        if (!e->second.exec && (lru == graphs_.end() || e->second.last_use < lru->second.last_use)) lru = e;
      if (lru == graphs_.end()) {
        lru = graphs_.begin();
        for (auto e = graphs_.begin(); e != graphs_.end(); ++e)
          if (e->second.last_use < lru->second.last_use) lru = e;
      }
      cuda::graph_destroy(lru->second.exec);  // (a launched graph finishes first; the driver defers)
      graphs_.erase(lru);
    }
    Entry fresh;
    fresh.last_use = tick_;
    graphs_.emplace(key, fresh);
    count(&GraphStats::eager);
    return fn();
  }
  Entry& e = it->second;
  e.last_use = tick_;
  const uint64_t gen = cuda::scratch_generation();
  if (e.exec && e.generation == gen) {
    cuda::graph_launch(e.exec, stream_);
    count(&GraphStats::replayed);
    return;
  }
  if (e.exec) {  // the scratch moved since the capture: capture again (it is large enough now)
    cuda::graph_destroy(e.exec);
    e.exec = nullptr;
  }
  if (e.failures >= 2) {
    count(&GraphStats::eager);
    return fn();
  }
  std::string why;
  cuda::graph_begin_capture(stream_);
  try {
    fn();
  } catch (const std::exception& ex) {
    why = ex.what();
  } catch (...) {
    why = "an unknown exception";
  }
  std::string end_why;
  void* exec = cuda::graph_end_capture(stream_, &end_why);
  if (why.empty() && !exec) why = end_why;
  if (!why.empty()) {
    if (exec) cuda::graph_destroy(exec);
    ++e.failures;
    count(&GraphStats::failed, &why);
    if (!logged_) {
      std::fprintf(stderr, "dflash2: capturing a forward chunk as a CUDA graph failed; running it eagerly: %s\n",
                   why.c_str());
      logged_ = true;
    }
    count(&GraphStats::eager);
    return fn();  // nothing of the failed capture ran: the chunk's work runs now
  }
  e.exec = exec;
  e.generation = cuda::scratch_generation();
  count(&GraphStats::captured);
  cuda::graph_launch(exec, stream_);  // a capture records without running
}

#else

ForwardGraphs::ForwardGraphs(Device dev, CUstream_st* stream, size_t max_graphs)
    : dev_(dev), max_graphs_(max_graphs), stream_(stream) {
  fail(ErrorKind::Unsupported, "CUDA graphs need the CUDA backend, which this build does not have");
}
ForwardGraphs::~ForwardGraphs() = default;
void ForwardGraphs::run(const std::string&, const std::function<void()>& fn) { fn(); }

#endif

void StepRecorder::begin() {
  ++begun_;
  key_.clear();
  fns_.clear();
  on_ = true;
}

void StepRecorder::add(const std::string& key, std::function<void()> fn) {
  DFLASH2_INTERNAL(on_, "StepRecorder::add while not recording");
  key_ += key;
  key_ += '#';
  fns_.push_back(std::move(fn));
}

void StepRecorder::cancel() {
  fns_.clear();
  key_.clear();
  on_ = false;
}

void StepRecorder::flush(ForwardGraphs* graphs, int device) {
  DFLASH2_INTERNAL(on_, "StepRecorder::flush while not recording");
  std::vector<std::function<void()>> fns;
  fns.swap(fns_);
  on_ = false;
  const auto run_all = [&] {
    for (auto& f : fns) f();
  };
#ifdef DFLASH2_WITH_CUDA
  if (graphs) {
    cuda::OrderedStreamScope scope(graphs->stream(), device);
    graphs->run("step#" + key_, run_all);
    ++steps_;
    return;
  }
#else
  (void)graphs;
#endif
  (void)device;
  run_all();
  ++steps_;
}

GraphStats ForwardGraphs::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

void ForwardGraphs::count(int64_t GraphStats::*field, const std::string* failure) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  ++(stats_.*field);
  if (failure) stats_.last_failure = *failure;
}

void ForwardGraphs::key_add(std::string& key, const Tensor& t) {
  if (!t.defined()) {
    key += "-|";
    return;
  }
  key += std::to_string(reinterpret_cast<uintptr_t>(t.data()));
  key += ':';
  key += std::to_string(int(t.dtype()));
  for (int64_t d = 0; d < t.ndim(); ++d) {
    key += ',';
    key += std::to_string(t.shape(d));
    key += '/';
    key += std::to_string(t.stride(d));
  }
  key += '|';
}

void ForwardGraphs::key_add(std::string& key, int64_t v) {
  key += std::to_string(v);
  key += '|';
}

}  // namespace dflash2::runtime
