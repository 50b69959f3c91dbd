// EMU_MEMCHECK (cpp/emu/emu_runtime.cpp), the emulator's memcheck: a kernel thread that
// reads or writes past an allocation's end, before its start, after cudaFree or past the
// launch's dynamic shared memory fails its launch with a message naming the kernel, the
// thread and the allocation; the process goes on and the next launches run; copies past an
// allocation's end are refused; a workspace arena's tensors are followed by red zones, checked
// when the arena resets (a write past a tensor inside the arena). Also CUDA's stream-capture
// rules as the emulator enforces them (allocations, synchronizing calls and waits on
// uncaptured events invalidate a capture; thread-local mode; captured events). Emulated build
// only (rewritten by rewrite_cu.py like the backend's .cu files); ctest runs it with EMU_MEMCHECK=1.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "dflash2/arena.h"
#include "testing.h"

namespace {

__global__ void scale_k(const float* a, float* out, int n, int shift) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = 2.0f * a[i + shift];
}

__global__ void fill_k(float* a, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) a[i] = float(i);
}

__global__ void vec4_k(const float* a, float* out) {  // a float4 load: a must be 16-byte aligned
  const float4 v = *reinterpret_cast<const float4*>(a);
  out[threadIdx.x] = v.x + v.y + v.z + v.w;
}

__global__ void smem_k(float* out, int reach) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x + reach];
}

// stderr of `fn`, captured through a temporary file.
template <class F>
std::string stderr_of(F fn) {
  std::fflush(stderr);
  char path[] = "/tmp/emu_memcheck_XXXXXX";
  const int fd = mkstemp(path);
  const int saved = dup(2);
  dup2(fd, 2);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string out;
  lseek(fd, 0, SEEK_SET);
  char buf[4096];
  ssize_t k;
  while ((k = read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(k));
  close(fd);
  unlink(path);
  std::fputs(out.c_str(), stdout);  // in the test's log
  return out;
}

bool has(const std::string& s, const char* sub) { return s.find(sub) != std::string::npos; }

struct Buffers {
  float* a = nullptr;
  float* out = nullptr;
  Buffers() {
    cudaMalloc(reinterpret_cast<void**>(&a), 256 * sizeof(float));
    cudaMalloc(reinterpret_cast<void**>(&out), 256 * sizeof(float));
    fill_k<<<2, 128>>>(a, 256);
  }
  ~Buffers() {
    cudaFree(a);
    cudaFree(out);
  }
};

}  // namespace

TEST(memcheck_is_on) {
  const char* e = std::getenv("EMU_MEMCHECK");
  CHECK(e && (std::string(e) == "1" || std::string(e) == "2"));
}

TEST(in_bounds_launch_runs) {
  Buffers b;
  scale_k<<<2, 128>>>(b.a, b.out, 256, 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  std::vector<float> h(256);
  CHECK(cudaMemcpy(h.data(), b.out, 1024, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(h[0] == 0.0f && h[255] == 510.0f);
}

TEST(read_past_the_end_fails_the_launch) {
  Buffers b;
  const std::string err = stderr_of([&] { scale_k<<<2, 128>>>(b.a, b.out, 256, 1); });
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(has(err, "scale_k"));
  CHECK(has(err, "invalid read"));
  CHECK(has(err, "thread (127, 0, 0)"));  // block 1's last thread reads a[256]
  CHECK(has(err, "block (1, 0, 0)"));
  CHECK(has(err, "offset 1024 of a 1024-byte allocation"));
  CHECK(has(err, "past its end"));
  // the process goes on: the next launch runs
  scale_k<<<2, 128>>>(b.a, b.out, 256, 0);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST(read_before_the_start_fails_the_launch) {
  Buffers b;
  // 1024 floats (4096 bytes) before the start: the data (1024 bytes) ends its page, so
  // this lands in the inaccessible page below that one
  const std::string err = stderr_of([&] { scale_k<<<1, 32>>>(b.a, b.out, 32, -1024); });
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(has(err, "before its start"));
}

TEST(write_past_the_end_fails_the_launch) {
  Buffers b;
  const std::string err = stderr_of([&] { fill_k<<<3, 128>>>(b.a, 300); });
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(has(err, "fill_k"));
  CHECK(has(err, "invalid write"));
  CHECK(has(err, "past its end"));
}

TEST(use_after_free_fails_the_launch) {
  float* a = nullptr;
  float* out = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&a), 1024);
  cudaMalloc(reinterpret_cast<void**>(&out), 1024);
  cudaFree(a);
  const std::string err = stderr_of([&] { scale_k<<<1, 64>>>(a, out, 64, 0); });
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(has(err, "freed 1024-byte allocation"));
  cudaFree(out);
}

TEST(shared_memory_past_the_end_fails_the_launch) {
  Buffers b;
  smem_k<<<1, 128, 128 * sizeof(float)>>>(b.out, 0);
  CHECK(cudaGetLastError() == cudaSuccess);
  const std::string err = stderr_of([&] { smem_k<<<1, 128, 128 * sizeof(float)>>>(b.out, 1); });
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(has(err, "smem_k"));
  CHECK(has(err, "offset 512 of the launch's dynamic shared memory"));
}

TEST(copies_past_the_end_are_refused) {
  Buffers b;
  std::vector<float> h(300, 1.0f);
  std::string err = stderr_of([&] { CHECK(cudaMemcpy(b.a, h.data(), 1028, cudaMemcpyHostToDevice) == cudaErrorInvalidValue); });
  CHECK(has(err, "cudaMemcpy's destination of 1028 bytes"));
  CHECK(has(err, "offset 1024 of a 1024-byte allocation"));
  cudaGetLastError();
  err = stderr_of([&] { CHECK(cudaMemset(b.a + 1, 0, 1024) == cudaErrorInvalidValue); });
  CHECK(has(err, "cudaMemset"));
  cudaGetLastError();
  CHECK(cudaMemcpy(b.a, h.data(), 1024, cudaMemcpyHostToDevice) == cudaSuccess);
}

TEST(arena_red_zone_catches_a_write_past_a_tensor) {
  using namespace dflash2;
  // the planner reserves the red zones too, so a planned arena still fits
  Arena plan = Arena::planner(Device::cuda(0));
  plan.alloc(DType::F32, {256});
  plan.alloc(DType::F32, {64});
  Arena a(plan.high_water(), Device::cuda(0));
  Tensor t = a.alloc(DType::F32, {256});
  Tensor u = a.alloc(DType::F32, {64});
  CHECK(a.used() == plan.high_water());
  CHECK(u.data_as<float>() >= t.data_as<float>() + 256 + 64);  // 256 bytes of red zone between them
  fill_k<<<1, 256>>>(t.data_as<float>(), 256);
  CHECK(cudaGetLastError() == cudaSuccess);
  a.reset();  // intact: no error
  Tensor t2 = a.alloc(DType::F32, {256});
  fill_k<<<1, 260>>>(t2.data_as<float>(), 260);  // 4 floats past its end: inside the arena, no fault
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK_THROWS(a.reset(), "wrote past the end of workspace arena tensor #0 (F32[256], 1024 bytes");
}

// A misaligned float4 load (an illegal-address error on a GPU, fine on x86-64) aborts the
// emulated run where the kernels are built with the alignment check (UBSan's): in a child
// process, whose stderr names the access.
TEST(misaligned_vector_load_aborts_the_run) {
#ifdef DFLASH2_EMU_ALIGNMENT_CHECK
  Buffers b;
  vec4_k<<<1, 32>>>(b.a + 4, b.out);  // 16-byte aligned: runs
  CHECK(cudaGetLastError() == cudaSuccess);
  int fds[2];
  CHECK(pipe(fds) == 0);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    vec4_k<<<1, 32>>>(b.a + 1, b.out);  // 4 bytes past an aligned address
    std::_Exit(0);                      // not reached with the check on
  }
  close(fds[1]);
  std::string err;
  char buf[4096];
  ssize_t k;
  while ((k = read(fds[0], buf, sizeof buf)) > 0) err.append(buf, size_t(k));
  close(fds[0]);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  std::fputs(err.c_str(), stdout);
  CHECK(!(WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(has(err, "misaligned address"));
  CHECK(has(err, "emu_memcheck.cu"));  // the kernel's own file and line
#else
  std::printf("  (built without the alignment check: nothing to test)\n");
#endif
}

// ---- CUDA's stream-capture rules, as the emulator enforces them (emu_runtime.cpp): what
// breaks a capture on a GPU breaks it here, so the engine's graph tests catch it without one.
namespace {
struct Capture {  // a non-blocking stream (as the backend's graph streams) and a capture on it
  cudaStream_t s = nullptr;
  cudaGraph_t g = nullptr;
  Capture() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~Capture() {
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(s);
  }
};
}  // namespace

TEST(capture_allocation_on_the_capturing_thread_invalidates_it) {
  Capture c;
  float* a = nullptr;
  CHECK(cudaMalloc(reinterpret_cast<void**>(&a), 256 * sizeof(float)) == cudaSuccess);
  CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  fill_k<<<1, 256, 0, c.s>>>(a, 256);
  void* p = nullptr;
  std::string err = stderr_of([&] { CHECK(cudaMalloc(&p, 64) == cudaErrorStreamCaptureUnsupported); });
  CHECK(has(err, "cudaMalloc while a stream capture is in progress"));
  CHECK(cudaFree(a) == cudaErrorStreamCaptureUnsupported);  // a free synchronizes too
  CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaErrorStreamCaptureInvalidated);
  CHECK(c.g == nullptr);
  cudaGetLastError();
  CHECK(cudaMalloc(&p, 64) == cudaSuccess);  // no capture: allowed again
  CHECK(cudaFree(p) == cudaSuccess);
  CHECK(cudaFree(a) == cudaSuccess);
}

TEST(capture_thread_local_mode_leaves_other_threads_free) {
  for (cudaStreamCaptureMode mode : {cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeGlobal}) {
    Capture c;
    CHECK(cudaStreamBeginCapture(c.s, mode) == cudaSuccess);
    cudaError_t other = cudaSuccess;
    std::string err = stderr_of([&] {
      std::thread t([&] {
        void* p = nullptr;
        other = cudaMalloc(&p, 64);
        if (other == cudaSuccess) cudaFree(p);
      });
      t.join();
    });
    const bool global = mode == cudaStreamCaptureModeGlobal;
    CHECK(other == (global ? cudaErrorStreamCaptureUnsupported : cudaSuccess));
    CHECK(cudaStreamEndCapture(c.s, &c.g) == (global ? cudaErrorStreamCaptureInvalidated : cudaSuccess));
    CHECK((c.g != nullptr) == !global);
    cudaGetLastError();
  }
}

TEST(capture_synchronizing_calls_invalidate_it) {
  Capture c;
  CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(cudaStreamSynchronize(c.s) == cudaErrorStreamCaptureUnsupported);
  CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaErrorStreamCaptureInvalidated);
  cudaGetLastError();
  std::vector<float> h(4);
  float* a = nullptr;
  CHECK(cudaMalloc(reinterpret_cast<void**>(&a), 16) == cudaSuccess);
  CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(cudaMemcpy(h.data(), a, 16, cudaMemcpyDeviceToHost) == cudaErrorStreamCaptureUnsupported);
  CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaErrorStreamCaptureInvalidated);
  cudaGetLastError();
  CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(cudaMemcpyAsync(h.data(), a, 16, cudaMemcpyDeviceToHost, c.s) == cudaSuccess);  // a node: fine
  CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaSuccess && c.g != nullptr);
  CHECK(cudaFree(a) == cudaSuccess);
}

TEST(capture_waits_only_on_its_own_or_external_events) {
  cudaEvent_t e = nullptr;
  CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  CHECK(cudaEventRecord(e, cudaStreamLegacy) == cudaSuccess);  // eager work
  {
    Capture c;
    CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    std::string err = stderr_of([&] { CHECK(cudaStreamWaitEvent(c.s, e, 0) == cudaErrorStreamCaptureIsolation); });
    CHECK(has(err, "recorded outside the capture"));
    CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();
  }
  {
    Capture c;  // as an external wait node
    CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    CHECK(cudaStreamWaitEvent(c.s, e, cudaEventWaitExternal) == cudaSuccess);
    CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaSuccess && c.g != nullptr);
  }
  {
    Capture c;  // recorded in the same capture: a join
    CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    CHECK(cudaEventRecord(e, c.s) == cudaSuccess);
    CHECK(cudaStreamWaitEvent(c.s, e, 0) == cudaSuccess);
    CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaSuccess && c.g != nullptr);
    // ... but the host cannot wait on or query an event last recorded inside a capture
    CHECK(cudaEventQuery(e) == cudaErrorCapturedEvent);
    CHECK(cudaEventSynchronize(e) == cudaErrorCapturedEvent);
    cudaGetLastError();
  }
  CHECK(cudaEventDestroy(e) == cudaSuccess);
}

TEST(capture_external_event_records_time_the_replays) {
  Capture c;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  CHECK(cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess);
  float* a = nullptr;
  CHECK(cudaMalloc(reinterpret_cast<void**>(&a), 1024) == cudaSuccess);
  CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  CHECK(cudaEventRecordWithFlags(e0, c.s, cudaEventRecordExternal) == cudaSuccess);
  fill_k<<<1, 256, 0, c.s>>>(a, 256);
  CHECK(cudaEventRecordWithFlags(e1, c.s, cudaEventRecordExternal) == cudaSuccess);
  CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaSuccess && c.g != nullptr);
  cudaGraphExec_t x = nullptr;
  CHECK(cudaGraphInstantiate(&x, c.g, 0) == cudaSuccess);
  CHECK(cudaGraphLaunch(x, c.s) == cudaSuccess);
  CHECK(cudaStreamSynchronize(c.s) == cudaSuccess);
  float ms = -1.0f;
  CHECK(cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms >= 0.0f);
  CHECK(cudaGraphExecDestroy(x) == cudaSuccess);
  CHECK(cudaEventDestroy(e0) == cudaSuccess && cudaEventDestroy(e1) == cudaSuccess);
  CHECK(cudaFree(a) == cudaSuccess);
}

TEST(capture_ends_on_the_thread_that_began_it) {
  Capture c;
  CHECK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  cudaError_t other = cudaSuccess;
  std::thread t([&] { other = cudaStreamEndCapture(c.s, &c.g); });
  t.join();
  CHECK(other == cudaErrorStreamCaptureWrongThread);
  CHECK(cudaStreamEndCapture(c.s, &c.g) == cudaSuccess && c.g != nullptr);
}

TEST_MAIN()
