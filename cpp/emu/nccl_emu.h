// cpp/emu/nccl_emu.h: the emulated NCCL entry points (nccl_emu.cpp), which comm/nccl_comm.cpp
// takes instead of loading libnccl.so.2 in the CPU emulator's build (DFLASH2_CUDA_EMULATED).
#pragma once
#include <nccl.h>

namespace emu::nccl {
ncclResult_t GetVersion(int* v);
const char* GetErrorString(ncclResult_t r);
ncclResult_t CommInitAll(ncclComm_t* comms, int ndev, const int* devlist);
ncclResult_t CommDestroy(ncclComm_t comm);
ncclResult_t CommAbort(ncclComm_t comm);
ncclResult_t CommGetAsyncError(ncclComm_t comm, ncclResult_t* async);
ncclResult_t AllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                       cudaStream_t stream);
ncclResult_t AllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                       cudaStream_t stream);
ncclResult_t ReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t Broadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                       cudaStream_t stream);
}  // namespace emu::nccl
