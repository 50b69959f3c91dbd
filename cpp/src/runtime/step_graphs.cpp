#include "runtime/step_graphs.h"

#include <cstdio>
#include <exception>

#include "dflash2/error.h"
#ifdef DFLASH2_WITH_CUDA
#include "backend/cuda/cuda_api.h"
#endif

namespace dflash2::runtime {

namespace {
// Makes room for one more key in a graph cache of at most max keys: the least recently used
// key without a graph goes, else the least recently used one (drop releases its graphs).
template <class Map, class HasGraph, class Drop>
void make_room(Map& m, size_t max, HasGraph has_graph, Drop drop) {
  if (m.size() < max || m.empty()) return;
  auto lru = m.end();
  for (auto e = m.begin(); e != m.end(); ++e)
    if (!has_graph(e->second) && (lru == m.end() || e->second.last_use < lru->second.last_use)) lru = e;
  if (lru == m.end()) {
    lru = m.begin();
    for (auto e = m.begin(); e != m.end(); ++e)
      if (e->second.last_use < lru->second.last_use) lru = e;
  }
  drop(lru->second);  // (a launched graph finishes first; the driver defers)
  m.erase(lru);
}
}  // namespace

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
    make_room(graphs_, max_graphs_, [](const Entry& e) { return e.exec != nullptr; },
              [](Entry& e) { cuda::graph_destroy(e.exec); });
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
  int64_t pdl_edges = 0;
  void* exec = cuda::graph_end_capture(stream_, &end_why, &pdl_edges);
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
  count(&GraphStats::pdl_edges, nullptr, pdl_edges);
  cuda::graph_launch(exec, stream_);  // a capture records without running
}

GroupGraphs::GroupGraphs(std::vector<Device> devs, std::vector<CUstream_st*> streams, size_t max_graphs)
    : devs_(std::move(devs)), streams_(std::move(streams)), max_graphs_(max_graphs) {
  DFLASH2_INTERNAL(streams_.size() == devs_.size() && !devs_.empty(), "GroupGraphs over ", devs_.size(), " devices");
  own_.assign(devs_.size(), false);
  for (size_t r = 0; r < devs_.size(); ++r)
    if (!streams_[r]) {
      streams_[r] = cuda::stream_create(devs_[r].index);
      own_[r] = true;
    }
}

GroupGraphs::~GroupGraphs() {
  for (auto& kv : graphs_) drop(kv.second);
  for (size_t r = 0; r < devs_.size(); ++r)
    if (own_[r]) cuda::stream_destroy(streams_[r], devs_[r].index);
}

void GroupGraphs::drop(Entry& e) {
  for (void* x : e.exec) cuda::graph_destroy(x);
  e.exec.clear();
}

void GroupGraphs::run(const std::string& key, const All& all, const std::function<void(int)>& prep,
                      const std::function<void(int)>& fn, comm::Communicator* comm0) {
  const int n = int(devs_.size());
  // every round: each rank on its graphs' stream, in order with its legacy stream
  auto round = [&](const std::function<void(int)>& job) {
    all([&](int r) {
      cuda::OrderedStreamScope scope(streams_[size_t(r)], devs_[size_t(r)].index);
      job(r);
    });
  };
  auto eager = [&] {
    round([&](int r) {
      prep(r);
      fn(r);
    });
  };
  auto it = graphs_.find(key);
  ++tick_;
  if (it == graphs_.end()) {  // first sight: every rank warms up eagerly
    make_room(graphs_, max_graphs_, [](const Entry& e) { return !e.exec.empty(); }, [this](Entry& e) { drop(e); });
    Entry fresh;
    fresh.last_use = tick_;
    graphs_.emplace(key, fresh);
    count(&GraphStats::eager);
    return eager();
  }
  Entry& e = it->second;
  e.last_use = tick_;
  const uint64_t gen = cuda::scratch_generation();
  if (!e.exec.empty() && e.generation == gen) {  // every rank replays
    round([&](int r) {
      prep(r);
      cuda::graph_launch(e.exec[size_t(r)], streams_[size_t(r)]);
    });
    if (comm0) comm0->count_replay(e.collectives);
    count(&GraphStats::replayed);
    return;
  }
  drop(e);  // none yet, or captured before the scratch moved
  if (e.failures >= 2) {
    count(&GraphStats::eager);
    return eager();
  }
  // every rank captures; launched only if all succeeded
  std::vector<void*> exec(size_t(n), nullptr);
  std::vector<std::string> why(static_cast<size_t>(n));
  std::vector<int64_t> pdl_edges(size_t(n), 0);
  const comm::CommStats before = comm0 ? comm0->stats() : comm::CommStats{};
  try {
    round([&](int r) {
      prep(r);
      CUstream_st* s = streams_[size_t(r)];
      cuda::graph_begin_capture(s);
      try {
        fn(r);
      } catch (const std::exception& ex) {
        why[size_t(r)] = ex.what();
      } catch (...) {
        why[size_t(r)] = "an unknown exception";
      }
      std::string end_why;
      exec[size_t(r)] = cuda::graph_end_capture(s, &end_why, &pdl_edges[size_t(r)]);
      if (why[size_t(r)].empty() && !exec[size_t(r)]) why[size_t(r)] = end_why;
    });
  } catch (...) {  // a rank's prep failed: the others' captures are never launched
    for (void* x : exec) cuda::graph_destroy(x);
    throw;
  }
  std::string failure;
  for (int r = 0; r < n && failure.empty(); ++r)
    if (!why[size_t(r)].empty()) failure = "rank " + std::to_string(r) + ": " + why[size_t(r)];
  if (!failure.empty()) {
    for (void* x : exec) cuda::graph_destroy(x);
    ++e.failures;
    count(&GraphStats::failed, &failure);
    if (!logged_) {
      std::fprintf(stderr, "dflash2: capturing a forward chunk as CUDA graphs on every rank failed; running it "
                   "eagerly on every rank: %s\n", failure.c_str());
      logged_ = true;
    }
    count(&GraphStats::eager);
    // nothing of the failed captures ran: what they counted is taken back, and every rank
    // runs the chunk now (prep ran), counting its collectives once
    if (comm0) comm0->count_replay(comm::Communicator::diff(before, comm0->stats()));
    round(fn);
    return;
  }
  e.exec = exec;
  e.generation = cuda::scratch_generation();
  if (comm0) e.collectives = comm::Communicator::diff(comm0->stats(), before);
  count(&GraphStats::captured);
  for (int64_t v : pdl_edges) count(&GraphStats::pdl_edges, nullptr, v);
  round([&](int r) { cuda::graph_launch(e.exec[size_t(r)], streams_[size_t(r)]); });
}

#else

ForwardGraphs::ForwardGraphs(Device dev, CUstream_st* stream, size_t max_graphs)
    : dev_(dev), max_graphs_(max_graphs), stream_(stream) {
  fail(ErrorKind::Unsupported, "CUDA graphs need the CUDA backend, which this build does not have");
}
ForwardGraphs::~ForwardGraphs() = default;
void ForwardGraphs::run(const std::string&, const std::function<void()>& fn) { fn(); }

GroupGraphs::GroupGraphs(std::vector<Device> devs, std::vector<CUstream_st*> streams, size_t max_graphs)
    : devs_(std::move(devs)), streams_(std::move(streams)), max_graphs_(max_graphs) {
  fail(ErrorKind::Unsupported, "CUDA graphs need the CUDA backend, which this build does not have");
}
GroupGraphs::~GroupGraphs() = default;
void GroupGraphs::drop(Entry&) {}
void GroupGraphs::run(const std::string&, const All& all, const std::function<void(int)>& prep,
                      const std::function<void(int)>& fn, comm::Communicator*) {
  all([&](int r) {
    prep(r);
    fn(r);
  });
}

#endif

GraphStats GroupGraphs::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

void GroupGraphs::count(int64_t GraphStats::*field, const std::string* failure, int64_t by) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_.*field += by;
  if (failure) stats_.last_failure = *failure;
}

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
  fns_.push_back({false, [f = std::move(fn)](int) { f(); }});
}

void StepRecorder::add_ranks(const std::string& key, std::function<void(int)> fn) {
  DFLASH2_INTERNAL(on_, "StepRecorder::add_ranks while not recording");
  key_ += "all:";
  key_ += key;
  key_ += '#';
  fns_.push_back({true, std::move(fn)});
}

void StepRecorder::cancel() {
  fns_.clear();
  key_.clear();
  on_ = false;
}

std::vector<StepRecorder::Queued> StepRecorder::take() {
  std::vector<Queued> fns;
  fns.swap(fns_);
  on_ = false;
  return fns;
}

void StepRecorder::flush(ForwardGraphs* graphs, int device) {
  DFLASH2_INTERNAL(on_, "StepRecorder::flush while not recording");
  const std::vector<Queued> fns = take();
  const auto run_all = [&] {
    for (auto& f : fns) f.fn(0);
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

void StepRecorder::flush_group(GroupGraphs* group, const GroupGraphs::All& all, comm::Communicator* comm0) {
  DFLASH2_INTERNAL(on_, "StepRecorder::flush_group while not recording");
  const std::vector<Queued> fns = take();
  // rank r's part of the step: rank 0 runs every piece, the others the every-rank ones
  const std::function<void(int)> rank_part = [&](int r) {
    for (auto& f : fns)
      if (r == 0 || f.every_rank) f.fn(r);
  };
  if (group)
    group->run("step#" + key_, all, [](int) {}, rank_part, comm0);
  else
    all(rank_part);
  ++steps_;
}

GraphStats ForwardGraphs::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

void ForwardGraphs::count(int64_t GraphStats::*field, const std::string* failure, int64_t by) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_.*field += by;
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
