// Internal: the CPU backend. ops.cpp validates arguments and dispatches here.
#pragma once
#include "dflash2/ops.h"

namespace dflash2::cpu {

const char* gemm_isa();  // "avx2+fma" or "generic": what linear() runs on this machine
int num_threads();

void linear(const Tensor& x, const ops::Weight& w, Tensor& y, bool accumulate);
void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out);
void layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out);
void rope(Tensor& x, const Tensor& positions, double theta, ops::RopeStyle style);
void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out);
void softmax(const Tensor& x, Tensor& out, float scale);
void topk(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);
void embedding(const Tensor& table, const Tensor& ids, Tensor& out);

}  // namespace dflash2::cpu
