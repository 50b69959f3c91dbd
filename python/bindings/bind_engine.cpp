// Engine / Sequence / GenerationResult. Token lists cross as Python lists (or anything
// iterable of ints); logits and hidden states come back as numpy arrays (zero copy).
#include <mutex>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "dflash2/engine.h"
#include "dflash2/error.h"
#include "dflash2/ops.h"

namespace dflash2::py_bind {

namespace {

std::vector<int32_t> to_tokens(py::handle h, const char* arg) {
  if (py::isinstance<py::str>(h))
    fail(ErrorKind::InvalidArgument, "argument '", arg,
         "': text prompts need a tokenizer, which is not implemented yet; pass a list of token ids");
  std::vector<int32_t> out;
  for (auto v : h) {
    if (!py::isinstance<py::int_>(v) && !py::hasattr(v, "__index__"))
      fail(ErrorKind::InvalidArgument, "argument '", arg, "': token ids must be integers, found ",
           std::string(py::str(py::type::of(v).attr("__name__"))));
    int64_t t = py::reinterpret_borrow<py::object>(v).attr("__index__")().cast<int64_t>();
    if (t < INT32_MIN || t > INT32_MAX) fail(ErrorKind::InvalidArgument, "argument '", arg, "': token id ", t, " is out of range");
    out.push_back(int32_t(t));
  }
  return out;
}

// A Python object as the engine's TokenConstraint: masks(drafts: list[int], out: numpy int32
// [n + 1, words] over the engine's buffer, valid during the call only) -> int rows filled,
// commit(tokens: list[int]), done() -> bool. Called on the scheduler thread, which takes the
// GIL for each call; a Python exception becomes an InvalidArgument error of that request.
// Python objects whose last C++ owner went away on a thread without the GIL: their reference
// is dropped by the next thread that holds it (PyConstraint calls, new constraints). The
// destructor never waits for the GIL: it may run under the scheduler's locks, which a thread
// holding the GIL may be waiting for.
std::mutex g_orphans_mu;
std::vector<PyObject*> g_orphans;

void drop_orphans() {  // with the GIL held
  std::vector<PyObject*> v;
  {
    std::lock_guard<std::mutex> lk(g_orphans_mu);
    v.swap(g_orphans);
  }
  for (PyObject* o : v) Py_DECREF(o);
}

class PyConstraint final : public TokenConstraint {
 public:
  explicit PyConstraint(py::object o) : o_(std::move(o)) {
    drop_orphans();
    has_steer_ = py::hasattr(o_, "steer");
  }
  ~PyConstraint() override {
    PyObject* o = o_.release().ptr();
    if (Py_IsInitialized() && PyGILState_Check()) {
      Py_DECREF(o);
      return;
    }
    // (during interpreter shutdown it stays in the list: leaked, never touched again)
    std::lock_guard<std::mutex> lk(g_orphans_mu);
    g_orphans.push_back(o);
  }
  int64_t masks(const int32_t* drafts, int64_t n, uint32_t* rows, int64_t words) override {
    py::gil_scoped_acquire gil;
    drop_orphans();
    try {
      py::list d(n);
      for (int64_t i = 0; i < n; ++i) d[size_t(i)] = py::int_(drafts[i]);
      py::array_t<int32_t> out({n + 1, words}, {words * int64_t(sizeof(int32_t)), int64_t(sizeof(int32_t))},
                               reinterpret_cast<int32_t*>(rows), py::capsule(rows, [](void*) {}));
      py::object r = o_.attr("masks")(d, out);
      DFLASH2_CHECK_ARG(py::isinstance<py::int_>(r) && !py::isinstance<py::bool_>(r),
                        "the token constraint's masks() must return the number of rows it filled (int), found ",
                        std::string(py::str(py::type::of(r).attr("__name__"))));
      return r.cast<int64_t>();
    } catch (py::error_already_set& e) {
      fail(ErrorKind::InvalidArgument, "the token constraint's masks() raised ", e.what());
    }
  }
  int64_t steer(const int32_t* cand, int64_t n, int64_t C, int32_t* drafts) override {
    if (!has_steer_) return -1;
    py::gil_scoped_acquire gil;
    try {
      py::array_t<int32_t> c({n, C}, {C * int64_t(sizeof(int32_t)), int64_t(sizeof(int32_t))}, cand);  // a copy
      // the drafter's drafts, rewritten in place (valid during the call only)
      py::array_t<int32_t> out({n}, {int64_t(sizeof(int32_t))}, drafts, py::capsule(drafts, [](void*) {}));
      py::object r = o_.attr("steer")(c, out);
      DFLASH2_CHECK_ARG(py::isinstance<py::int_>(r) && !py::isinstance<py::bool_>(r),
                        "the token constraint's steer() must return the number of drafts it wrote (int), found ",
                        std::string(py::str(py::type::of(r).attr("__name__"))));
      return r.cast<int64_t>();
    } catch (py::error_already_set& e) {
      fail(ErrorKind::InvalidArgument, "the token constraint's steer() raised ", e.what());
    }
  }
  void commit(const int32_t* tokens, int64_t n) override {
    py::gil_scoped_acquire gil;
    try {
      py::list t(n);
      for (int64_t i = 0; i < n; ++i) t[size_t(i)] = py::int_(tokens[i]);
      o_.attr("commit")(t);
    } catch (py::error_already_set& e) {
      fail(ErrorKind::InvalidArgument, "the token constraint's commit() raised ", e.what());
    }
  }
  bool done() override {
    py::gil_scoped_acquire gil;
    try {
      return o_.attr("done")().cast<bool>();
    } catch (py::error_already_set& e) {
      fail(ErrorKind::InvalidArgument, "the token constraint's done() raised ", e.what());
    } catch (py::cast_error&) {
      fail(ErrorKind::InvalidArgument, "the token constraint's done() must return a bool");
    }
  }

 private:
  py::object o_;
  bool has_steer_ = false;
};

// A Sequence's release takes the engine's model lock: deleted without the GIL (the scheduler
// thread may hold that lock while it calls a Python token constraint).
struct SequenceDelete {
  void operator()(Sequence* s) const {
    if (Py_IsInitialized() && PyGILState_Check()) {
      ReleaseGil nogil;
      delete s;
    } else {
      delete s;
    }
  }
};
using SequenceHolder = std::unique_ptr<Sequence, SequenceDelete>;

py::object as_numpy(const Tensor& t) { return py::module_::import("numpy").attr("from_dlpack")(py::cast(t)); }

py::dict stats_dict(const GenerationStats& s) {
  py::dict d;
  d["prompt_tokens"] = s.prompt_tokens;
  d["generated_tokens"] = s.generated_tokens;
  d["steps"] = s.steps;
  d["prefill_s"] = s.prefill_s;
  d["decode_s"] = s.decode_s;
  d["tokens_per_second"] = s.tokens_per_second;
  d["acceptance_length"] = s.acceptance_length;
  d["verify_steps"] = s.verify_steps;
  d["accepted_per_position"] = s.accepted_per_position;
  d["draft_s"] = s.draft_s;
  d["verify_s"] = s.verify_s;
  d["host_s"] = s.host_s;
  d["prefill_wait_s"] = s.prefill_wait_s;
  d["accept_s"] = s.accept_s;
  d["prefill_rounds"] = s.prefill_rounds;
  d["cached_tokens"] = s.cached_tokens;
  return d;
}

SamplingParams sampling_params(int64_t max_new_tokens, float temperature, float top_p, int64_t top_k,
                               const py::object& seed, const py::object& stop_token_ids, const char* where,
                               const py::object& logprobs = py::none()) {
  SamplingParams sp;
  sp.max_new_tokens = max_new_tokens;
  sp.temperature = temperature;
  sp.top_p = top_p;
  sp.top_k = top_k;
  if (!seed.is_none()) {
    const int64_t s = seed.cast<int64_t>();
    DFLASH2_CHECK_ARG(s >= 0, where, ": seed must be >= 0, found ", s);
    sp.seed = s;
  }
  if (!stop_token_ids.is_none()) {
    sp.has_stop_tokens = true;
    sp.stop_token_ids = to_tokens(stop_token_ids, "stop_token_ids");
  }
  if (!logprobs.is_none()) {
    DFLASH2_CHECK_ARG(py::isinstance<py::int_>(logprobs) && !py::isinstance<py::bool_>(logprobs), where,
                      ": logprobs must be None or an integer in [0, ", kMaxLogprobs, "]");
    sp.logprobs = logprobs.cast<int64_t>();
    DFLASH2_CHECK_ARG(sp.logprobs >= 0, where, ": logprobs must be None or an integer in [0, ", kMaxLogprobs,
                      "], found ", sp.logprobs);
  }
  return sp;
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<TokenLogprobs>(m, "TokenLogprobs",
                            "One generated token's log-probabilities under the target (log-softmax of its logits, "
                            "before temperature / top-p / top-k): .logprob, and the most likely tokens' .top_ids / "
                            ".top_logprobs (best first).")
      .def_readonly("logprob", &TokenLogprobs::logprob)
      .def_readonly("top_ids", &TokenLogprobs::top_ids)
      .def_readonly("top_logprobs", &TokenLogprobs::top_logprobs)
      .def("__repr__", [](const TokenLogprobs& t) {
        return "TokenLogprobs(logprob=" + std::to_string(t.logprob) + ", " + std::to_string(t.top_ids.size()) + " top)";
      });

  py::class_<GenerationResult>(m, "GenerationResult")
      .def_readonly("token_ids", &GenerationResult::token_ids)
      .def_readonly("logprobs", &GenerationResult::logprobs)
      .def_readonly("finish_reason", &GenerationResult::finish_reason)
      .def_property_readonly("stats", [](const GenerationResult& r) { return stats_dict(r.stats); })
      .def("__repr__", [](const GenerationResult& r) {
        return "GenerationResult(" + std::to_string(r.token_ids.size()) + " tokens, finish_reason='" + r.finish_reason + "')";
      });

  py::class_<Proposal>(m, "Proposal", "One greedy draft block after a prefill (for debugging acceptance).")
      .def_readonly("anchor", &Proposal::anchor)
      .def_readonly("tokens", &Proposal::tokens)
      .def_readonly("candidates", &Proposal::candidates)
      .def("__repr__", [](const Proposal& p) {
        return "Proposal(anchor=" + std::to_string(p.anchor) + ", " + std::to_string(p.tokens.size()) + " tokens)";
      });

  py::class_<Sequence, SequenceHolder>(m, "Sequence", "A sequence with its own KV caches (main and MTP) inside an Engine.")
      .def_property_readonly("length", &Sequence::length)
      .def_property_readonly("mtp_length", &Sequence::mtp_length)
      .def(
          "extend",
          [](Sequence& s, py::handle tokens, std::vector<int64_t> hidden_layers, bool final_hidden) {
            std::vector<int32_t> t = to_tokens(tokens, "token_ids");
            std::vector<Tensor> hs;
            Tensor fh;
            Tensor lg;
            {
              ReleaseGil nogil;
              lg = s.extend(t, hidden_layers, &hs, final_hidden ? &fh : nullptr);
            }
            py::dict hd;
            for (size_t j = 0; j < hidden_layers.size(); ++j) hd[py::int_(hidden_layers[j])] = as_numpy(hs[j]);
            if (final_hidden) return py::tuple(py::make_tuple(as_numpy(lg), hd, as_numpy(fh)));
            return py::tuple(py::make_tuple(as_numpy(lg), hd));
          },
          py::arg("token_ids"), py::arg("hidden_layers") = std::vector<int64_t>{}, py::arg("final_hidden") = false,
          "Appends tokens; returns (logits [n, V], {layer: hidden after that layer [n, H]}[, final normed hidden]).")
      // (these take the engine's model lock: the GIL is released first, since the scheduler
      // thread may hold that lock while it calls a Python token constraint)
      .def(
          "rollback",
          [](Sequence& s, int64_t length) {
            ReleaseGil nogil;
            s.rollback(length);
          },
          py::arg("length"))
      .def("release",
           [](Sequence& s) {
             ReleaseGil nogil;
             s.release();
           })
      .def(
          "mtp_extend",
          [](Sequence& s, py::handle tokens, py::handle hidden_main) {
            std::vector<int32_t> t = to_tokens(tokens, "next_token_ids");
            Tensor hm = tensor_from_python(hidden_main, "hidden_main");
            Tensor lg;
            {
              ReleaseGil nogil;
              lg = s.mtp_extend(t, hm);
            }
            return as_numpy(lg);
          },
          py::arg("next_token_ids"), py::arg("hidden_main"))
      .def(
          "mtp_rollback",
          [](Sequence& s, int64_t length) {
            ReleaseGil nogil;
            s.mtp_rollback(length);
          },
          py::arg("length"));

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const std::string& target, py::object draft, const std::string& method, const std::string& device,
                       int64_t max_batch_size, int64_t max_seq_len, int64_t max_step_tokens, int64_t kv_block_size,
                       int64_t num_threads, int64_t mtp_draft_tokens, const std::string& speculation,
                       int64_t tensor_parallel, bool expert_parallel, const std::string& prefill_gemm,
                       const std::string& draft_gemm, const std::string& decode_gemm, bool cuda_graphs, int pad_to_buckets, int capture_at_load,
                       const std::string& kv_cache_dtype, int64_t prefill_tokens_per_step, bool prefix_caching) {
             DFLASH2_CHECK_ARG(num_threads >= 0 && num_threads <= ops::cpu_max_threads(),
                               "Engine: num_threads must be in [0, ", ops::cpu_max_threads(), "] (0 = all ",
                               ops::cpu_cores(), " cores), found ", num_threads);
             EngineConfig c;
             c.target = target;
             c.draft = draft.is_none() ? "" : py::str(draft).cast<std::string>();
             c.method = method;
             c.device = device;
             c.max_batch_size = max_batch_size;
             c.max_seq_len = max_seq_len;
             c.max_step_tokens = max_step_tokens;
             c.kv_block_size = kv_block_size;
             c.num_threads = int(num_threads);
             c.mtp_draft_tokens = mtp_draft_tokens;
             c.speculation = speculation;
             c.tensor_parallel = tensor_parallel;
             c.expert_parallel = expert_parallel;
             c.prefill_gemm = prefill_gemm;
             c.draft_gemm = draft_gemm;
             c.decode_gemm = decode_gemm;
             c.cuda_graphs = cuda_graphs;
             c.pad_to_buckets = pad_to_buckets;
             c.capture_at_load = capture_at_load;
             c.kv_cache_dtype = kv_cache_dtype;
             c.prefill_tokens_per_step = prefill_tokens_per_step;
             c.prefix_caching = prefix_caching;
             ReleaseGil nogil;
             return std::make_unique<Engine>(c);
           }),
           py::arg("target"), py::arg("draft") = py::none(), py::arg("method") = "", py::arg("device") = "cpu",
           py::arg("max_batch_size") = 8, py::arg("max_seq_len") = 0, py::arg("max_step_tokens") = 256,
           py::arg("kv_block_size") = 16, py::arg("num_threads") = 0, py::arg("mtp_draft_tokens") = 7,
           py::arg("speculation") = "fixed", py::arg("tensor_parallel") = 1, py::arg("expert_parallel") = false,
           py::arg("prefill_gemm") = "auto", py::arg("draft_gemm") = "auto", py::arg("decode_gemm") = "exact",
           py::arg("cuda_graphs") = true,
           py::arg("pad_to_buckets") = -1, py::arg("capture_at_load") = -1, py::arg("kv_cache_dtype") = "f32",
           py::arg("prefill_tokens_per_step") = -1, py::arg("prefix_caching") = true)
      .def(
          "logits",
          [](Engine& e, py::handle tokens) {
            std::vector<int32_t> t = to_tokens(tokens, "token_ids");
            Tensor lg;
            {
              ReleaseGil nogil;
              lg = e.logits(t);
            }
            return as_numpy(lg);
          },
          py::arg("token_ids"))
      .def(
          "prompt_logprobs",
          [](Engine& e, py::handle tokens, int64_t top) {
            std::vector<int32_t> t = to_tokens(tokens, "token_ids");
            ReleaseGil nogil;
            return e.prompt_logprobs(t, top);
          },
          py::arg("token_ids"), py::arg("top") = 0)
      .def(
          "generate",
          [](Engine& e, py::handle prompts, int64_t max_new_tokens, float temperature, float top_p, int64_t top_k,
             py::object seed, py::object stop_token_ids, py::object on_tokens) {
            if (py::isinstance<py::str>(prompts))
              fail(ErrorKind::InvalidArgument, "generate: 'prompts' must be a list of prompts (each a list of token ids)");
            std::vector<std::vector<int32_t>> ps;
            size_t i = 0;
            for (auto p : prompts) {
              std::string name = "prompts[" + std::to_string(i++) + "]";
              ps.push_back(to_tokens(p, name.c_str()));
            }
            SamplingParams sp =
                sampling_params(max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, "generate");
            TokenCallback cb;
            if (!on_tokens.is_none()) cb = on_tokens.cast<TokenCallback>();
            ReleaseGil nogil;
            return e.generate(ps, sp, cb);
          },
          py::arg("prompts"), py::arg("max_new_tokens") = 16, py::arg("temperature") = 0.0f, py::arg("top_p") = 1.0f,
          py::arg("top_k") = 0, py::arg("seed") = py::none(), py::arg("stop_token_ids") = py::none(),
          py::arg("on_tokens") = py::none())
      .def(
          "submit",
          [](Engine& e, py::handle prompt, int64_t max_new_tokens, float temperature, float top_p, int64_t top_k,
             py::object seed, py::object stop_token_ids, int64_t stream_index, py::object logprobs,
             float presence_penalty, float frequency_penalty, float repetition_penalty, int64_t min_tokens,
             py::object logit_bias, py::object constraint) {
            std::vector<int32_t> t = to_tokens(prompt, "prompt");
            SamplingParams sp =
                sampling_params(max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids, "submit", logprobs);
            sp.stream_index = stream_index;
            sp.presence_penalty = presence_penalty;
            sp.frequency_penalty = frequency_penalty;
            sp.repetition_penalty = repetition_penalty;
            sp.min_tokens = min_tokens;
            if (!logit_bias.is_none()) {
              DFLASH2_CHECK_ARG(py::isinstance<py::dict>(logit_bias), "submit: logit_bias must be a dict {token id: "
                                "bias} or None");
              for (auto kv : logit_bias.cast<py::dict>()) {
                DFLASH2_CHECK_ARG(py::isinstance<py::int_>(kv.first) && !py::isinstance<py::bool_>(kv.first),
                                  "submit: logit_bias keys must be token ids (int)");
                const int64_t id = kv.first.cast<int64_t>();
                DFLASH2_CHECK_ARG(id >= INT32_MIN && id <= INT32_MAX, "submit: logit_bias token ", id,
                                  " is outside the vocabulary");
                sp.logit_bias.emplace_back(int32_t(id), kv.second.cast<float>());
              }
            }
            if (!constraint.is_none()) {
              for (const char* m : {"masks", "commit", "done"})
                DFLASH2_CHECK_ARG(py::hasattr(constraint, m), "submit: constraint must have masks(), commit() and "
                                  "done() (a TokenConstraint), found ",
                                  std::string(py::str(py::type::of(constraint).attr("__name__"))), " without ", m,
                                  "()");
              sp.constraint = std::make_shared<PyConstraint>(constraint);
            }
            ReleaseGil nogil;
            return e.submit(t, sp);
          },
          py::arg("prompt"), py::arg("max_new_tokens") = 16, py::arg("temperature") = 0.0f, py::arg("top_p") = 1.0f,
          py::arg("top_k") = 0, py::arg("seed") = py::none(), py::arg("stop_token_ids") = py::none(),
          py::arg("stream_index") = 0, py::arg("logprobs") = py::none(), py::arg("presence_penalty") = 0.0f,
          py::arg("frequency_penalty") = 0.0f, py::arg("repetition_penalty") = 1.0f, py::arg("min_tokens") = 0,
          py::arg("logit_bias") = py::none(), py::arg("constraint") = py::none(), "Queues one request; returns its id.")
      .def(
          "poll",
          [](Engine& e, const std::vector<RequestId>& ids, double timeout, bool with_logprobs) {
            std::vector<RequestUpdate> ups;
            {
              ReleaseGil nogil;
              ups = e.poll(ids, timeout);
            }
            py::list out;
            for (auto& u : ups) {
              py::object res = u.finished ? py::cast(u.result) : py::none();
              if (with_logprobs)
                out.append(py::make_tuple(u.id, py::cast(u.new_tokens), u.finished, res, py::cast(u.new_logprobs)));
              else
                out.append(py::make_tuple(u.id, py::cast(u.new_tokens), u.finished, res));
            }
            return out;
          },
          py::arg("ids"), py::arg("timeout") = -1.0, py::arg("with_logprobs") = false,
          "[(id, new_token_ids, finished, GenerationResult or None)] for the ids with news, waiting up to "
          "timeout seconds (< 0: until there is news); with_logprobs: a fifth item, the new tokens' "
          "TokenLogprobs (empty unless the request asked for them).")
      .def(
          "cancel",
          [](Engine& e, RequestId id) {
            ReleaseGil nogil;
            e.cancel(id);
          },
          py::arg("id"))
      .def("close",
           [](Engine& e) {
             ReleaseGil nogil;
             e.close();
           })
      .def("tp_collectives",
           [](const Engine& e) {
             TpCollectives t;
             {
               ReleaseGil nogil;
               t = e.tp_collectives();
             }
             py::dict d;
             d["all_reduce_calls"] = t.all_reduce_calls;
             d["all_reduce_bytes"] = t.all_reduce_bytes;
             d["all_reduce_peer_calls"] = t.all_reduce_peer_calls;
             d["all_gather_calls"] = t.all_gather_calls;
             d["all_gather_bytes"] = t.all_gather_bytes;
             d["broadcast_calls"] = t.broadcast_calls;
             d["broadcast_bytes"] = t.broadcast_bytes;
             d["all_gather_peer_calls"] = t.all_gather_peer_calls;
             d["broadcast_peer_calls"] = t.broadcast_peer_calls;
             return d;
           })
      .def("metrics",
           [](const Engine& e) {
             EngineMetrics m;
             {
               ReleaseGil nogil;  // it takes the scheduler's lock
               m = e.metrics();
             }
             py::dict d;
             d["queue_length"] = m.queue_length;
             d["running"] = m.running;
             d["prefilling"] = m.prefilling;
             d["prefix_cache_pages"] = m.prefix_cache_pages;
             d["prefix_cache_query_tokens"] = m.prefix_cache_query_tokens;
             d["prefix_cache_hit_tokens"] = m.prefix_cache_hit_tokens;
             d["prefix_cache_evictions"] = m.prefix_cache_evictions;
             d["requests_total"] = m.requests_total;
             d["requests_finished"] = m.requests_finished;
             d["requests_cancelled"] = m.requests_cancelled;
             d["generated_tokens_total"] = m.generated_tokens_total;
             d["steps_total"] = m.steps_total;
             d["tokens_per_second"] = m.tokens_per_second;
             d["acceptance_length"] = m.acceptance_length;
             d["step_time_s"] = m.step_time_s;
             d["draft_len"] = m.draft_len;
             d["cache_pages_used"] = m.cache_pages_used;
             d["cache_pages_total"] = m.cache_pages_total;
             d["draft_cache_bytes"] = m.draft_cache_bytes;
             d["kv_cache_bytes"] = m.kv_cache_bytes;
             d["cuda_graphs_captured"] = m.cuda_graphs_captured;
             d["cuda_graphs_replayed"] = m.cuda_graphs_replayed;
             d["cuda_graphs_eager"] = m.cuda_graphs_eager;
             d["cuda_graphs_failed"] = m.cuda_graphs_failed;
             d["cuda_graphs_pdl_edges"] = m.cuda_graphs_pdl_edges;
             d["cuda_graphs_last_failure"] = m.cuda_graphs_last_failure;
             d["steps_as_one_unit"] = m.steps_as_one_unit;
             d["padding_rows"] = m.padding_rows;
             d["drafter_appends_in_step"] = m.drafter_appends_in_step;
             d["argmax_gather_steps"] = m.argmax_gather_steps;
             d["draft_head_gathers"] = m.draft_head_gathers;
             return d;
           })
      .def(
          "propose",
          [](Engine& e, py::handle tokens) {
            std::vector<int32_t> t = to_tokens(tokens, "token_ids");
            ReleaseGil nogil;
            return e.propose(t);
          },
          py::arg("token_ids"))
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("method", &Engine::method)
      .def_property_readonly("max_seq_len", [](const Engine& e) { return e.config().max_seq_len; })
      .def_property_readonly("num_threads", [](const Engine& e) { return e.config().num_threads; })
      .def_property_readonly("prefix_caching", [](const Engine& e) { return e.config().prefix_caching; })
      .def_property_readonly("prefix_cache_generated",
                             [](const Engine& e) { return e.config().prefix_cache_generated; })
      .def_property_readonly("prefill_tokens_per_step",
                             [](const Engine& e) { return e.config().prefill_tokens_per_step; })
      .def_property_readonly("tensor_parallel", [](const Engine& e) { return e.config().tensor_parallel; })
      .def_property_readonly("expert_parallel", [](const Engine& e) { return e.config().expert_parallel; })
      .def_property_readonly("prefill_gemm", [](const Engine& e) { return e.config().prefill_gemm; })
      .def_property_readonly("draft_gemm", [](const Engine& e) { return e.config().draft_gemm; })
      .def_property_readonly("draft_device", [](const Engine& e) { return e.draft_device(); })
      .def_property_readonly("draft_ranks", [](const Engine& e) { return e.draft_ranks(); })
      .def_property_readonly("decode_gemm", [](const Engine& e) { return e.config().decode_gemm; })
      .def_property_readonly("kv_cache_dtype", [](const Engine& e) { return e.config().kv_cache_dtype; })
      .def_property_readonly("experts_decode_gemm", [](const Engine& e) { return e.config().experts_decode_gemm; })
      .def_property_readonly("experts_prefill_gemm", [](const Engine& e) { return e.config().experts_prefill_gemm; })
      .def_property_readonly("cuda_graphs", [](const Engine& e) { return e.config().cuda_graphs; })
      .def_property_readonly("pad_to_buckets", [](const Engine& e) { return e.config().pad_to_buckets == 1; })
      .def_property_readonly("capture_at_load", [](const Engine& e) { return e.config().capture_at_load == 1; })
      .def(
          "new_sequence", [](Engine& e) { return SequenceHolder(e.new_sequence().release()); }, py::keep_alive<0, 1>())
      .def_property_readonly("vocab_size", &Engine::vocab_size)
      .def_property_readonly("hidden_size", &Engine::hidden_size)
      .def_property_readonly("num_layers", &Engine::num_layers)
      .def_property_readonly("has_mtp", &Engine::has_mtp)
      .def_property_readonly("config_json", &Engine::model_config_json);
}

}  // namespace dflash2::py_bind
