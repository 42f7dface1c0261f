// Host reads of 128 KB the GPU just wrote: page-locked by cuMemHostAlloc (mapped), malloc'd and
// registered (mapped), or in device memory copied to pageable memory. Run 0 in device-runs.log:
//   nvcc -O2 -o /tmp/probe pinned-probe.cu && /tmp/probe
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
__global__ void fill(unsigned* out, size_t n, unsigned v) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = v + i;
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static unsigned long long sum(const unsigned* p, size_t n) {
    unsigned long long s = 0;
    for (size_t i = 0; i < n; ++i) s += p[i];
    return s;
}
int main() {
    const size_t n = 32 * 1024;  // 128 KB: about a layer's picks at a 2048-token budget
    const int reps = 50;
    unsigned *a, *da;
    cudaHostAlloc((void**)&a, n * 4, cudaHostAllocMapped | cudaHostAllocPortable);
    cudaHostGetDevicePointer((void**)&da, a, 0);
    unsigned* b = (unsigned*)aligned_alloc(4096, n * 4);
    memset(b, 0, n * 4);
    unsigned* db;
    cudaHostRegister(b, n * 4, cudaHostRegisterMapped | cudaHostRegisterPortable);
    cudaHostGetDevicePointer((void**)&db, b, 0);
    unsigned* c = (unsigned*)malloc(n * 4);
    unsigned* dc;
    cudaMalloc((void**)&dc, n * 4);
    cudaEvent_t e;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    unsigned long long chk = 0;
    for (int kind = 0; kind < 3; ++kind) {
        double wait = 0, read = 0;
        for (int r = 0; r < reps; ++r) {
            unsigned* dst = kind == 0 ? da : kind == 1 ? db : dc;
            fill<<<64, 256>>>(dst, n, r);
            cudaEventRecord(e);
            double t0 = now();
            cudaEventSynchronize(e);
            double t1 = now();
            if (kind == 2) {
                cudaMemcpy(c, dc, n * 4, cudaMemcpyDeviceToHost);
                chk += sum(c, n);
            } else {
                chk += sum(kind == 0 ? a : b, n);
            }
            double t2 = now();
            wait += t1 - t0;
            read += t2 - t1;
        }
        printf("%-28s wait %7.1f us  read %7.1f us  (%.2f GB/s)\n",
               kind == 0 ? "cuMemHostAlloc (mapped)" : kind == 1 ? "malloc + cuMemHostRegister" : "device + memcpy to pageable",
               wait / reps * 1e6, read / reps * 1e6, n * 4 / (read / reps) / 1e9);
    }
    printf("check %llu\n", chk);
}
