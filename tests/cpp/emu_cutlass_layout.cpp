// test_cutlass_layout.cu compiled as C++ for builds without nvcc's CUDA language
// (DFLASH2_CUDA_EMULATE): the test is host code over CuTe's layouts, which GCC compiles.
#include "test_cutlass_layout.cu"
