// Scattered 256-byte K/V row reads by the GPU from host memory, one launch a "layer" as
// lsh_attend runs (2 KV heads x 7 query heads x 2200 sorted random picks of 1M rows, a warp a
// contiguous share), over LAYERS layers of 2 GiB each, by how the host memory was allocated:
//   A cuMemHostAlloc (mapped): today's host tier
//   B mmap + MADV_HUGEPAGE, touched, cuMemHostRegister (mapped): a registered mapping
//   C cuMemCreate on the host NUMA node (VMM), mapped for the device and the host
// Then the CPU's scattered reads of the same rows (16 threads) from each, to see that the host
// loses nothing.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <cuda.h>
#include <cuda_runtime.h>
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("%s: error %d\n", #x, (int)e); return 1; } } while (0)
const size_t N = 1 << 20, D = 128, KVH = 4;
const int HEADS = 14, GROUP = 7, PICKS = 2200, WARPS = 8, BLOCKS = 8, LAYERS = 14;
const size_t LAYER_BYTES = 2 * KVH * N * D * 2, TOTAL = LAYER_BYTES * LAYERS;
__global__ void attend(const uint2* k, const uint32_t* p, float* out) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int W = BLOCKS * WARPS, c = blockIdx.x * WARPS + warp;
    k += (size_t)(h / GROUP) * N * (D / 4);
    const uint2* v = k + KVH * N * (D / 4);
    p += (size_t)h * PICKS;
    float acc = 0.f;
    for (int j = PICKS * c / W; j < PICKS * (c + 1) / W; ++j) {
        uint2 x = k[(size_t)p[j] * (D / 4) + lane], y = v[(size_t)p[j] * (D / 4) + lane];
        acc += __uint_as_float(x.x << 16) * __uint_as_float(y.y & 0xffff0000u);
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
static double secs(std::chrono::steady_clock::time_point t) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(); }
static void touch(char* h) {
    std::vector<std::thread> ts;
    for (int t = 0; t < 16; ++t) ts.emplace_back([=] { for (size_t i = TOTAL / 16 * t; i < TOTAL / 16 * (t + 1); i += 4096) h[i] = (char)i; });
    for (auto& t : ts) t.join();
}
static int measure(const char* name, char* host, CUdeviceptr dev, const std::vector<uint32_t>& picks, uint32_t* dp, float* out) {
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    std::vector<float> ms;
    for (int r = 0; r < 6; ++r) {
        cudaEventRecord(e0);
        for (int l = 0; l < LAYERS; ++l)
            attend<<<dim3(BLOCKS, HEADS), 32 * WARPS>>>((const uint2*)(dev + l * LAYER_BYTES), dp + (size_t)l * HEADS * PICKS, out);
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float m; cudaEventElapsedTime(&m, e0, e1);
        if (r) ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    const double bytes = (double)LAYERS * HEADS * PICKS * 512;
    printf("%-44s GPU: %6.2f ms for %d layers (28 layers: %6.2f)  %5.1f GB/s\n", name, ms[2], LAYERS, ms[2] * 28 / LAYERS, bytes / ms[2] / 1e6);
    // The CPU: 16 threads, the same rows, K then V a pick at a time with 16 picks prefetched.
    auto t = std::chrono::steady_clock::now();
    std::vector<std::thread> ts; std::vector<double> sink(16);
    for (int th = 0; th < 16; ++th) ts.emplace_back([&, th] {
        double s = 0;
        for (int l = 0; l < LAYERS; ++l) for (int h = th; h < HEADS; h += 16) {
            const uint16_t* k = (const uint16_t*)(host + l * LAYER_BYTES) + (size_t)(h / GROUP) * N * D;
            const uint16_t* v = k + KVH * N * D;
            const uint32_t* p = picks.data() + ((size_t)l * HEADS + h) * PICKS;
            for (int j = 0; j < PICKS; ++j) {
                if (j + 16 < PICKS) for (int c = 0; c < 4; ++c) { __builtin_prefetch(k + (size_t)p[j + 16] * D + c * 32); __builtin_prefetch(v + (size_t)p[j + 16] * D + c * 32); }
                const uint16_t* kr = k + (size_t)p[j] * D; const uint16_t* vr = v + (size_t)p[j] * D;
                for (int i = 0; i < (int)D; i += 32) s += kr[i] + vr[i + 1];
            }
        }
        sink[th] = s;
    });
    for (auto& x : ts) x.join();
    const double took = secs(t);
    printf("%-44s CPU (14 threads, one head each): %6.2f ms  %5.1f GB/s\n", "", took * 1e3, (double)LAYERS * HEADS * PICKS * 512 / took / 1e9);
    return 0;
}
int main() {
    CK(cuInit(0)); CUdevice cd; CK(cuDeviceGet(&cd, 0)); CUcontext cx; CK(cuDevicePrimaryCtxRetain(&cx, cd)); CK(cuCtxSetCurrent(cx));
    std::mt19937 rng(7);
    std::vector<uint32_t> picks((size_t)LAYERS * HEADS * PICKS);
    for (size_t i = 0; i < picks.size(); i += PICKS) {
        for (int j = 0; j < PICKS; ++j) picks[i + j] = rng() % N;
        std::sort(picks.begin() + i, picks.begin() + i + PICKS);
    }
    uint32_t* dp; float* out;
    CK(cudaMalloc(&dp, picks.size() * 4)); CK(cudaMemcpy(dp, picks.data(), picks.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, HEADS * BLOCKS * WARPS * 32 * 4));
    {   // A
        auto t = std::chrono::steady_clock::now();
        char* h; CK(cudaHostAlloc((void**)&h, TOTAL, cudaHostAllocMapped | cudaHostAllocPortable)); touch(h);
        void* d; CK(cudaHostGetDevicePointer(&d, h, 0));
        printf("A allocated %zu GiB in %.1f s\n", TOTAL >> 30, secs(t));
        measure("A cuMemHostAlloc (today)", h, (CUdeviceptr)d, picks, dp, out);
        CK(cudaFreeHost(h));
    }
    {   // B
        auto t = std::chrono::steady_clock::now();
        char* h = (char*)mmap(nullptr, TOTAL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        printf("madvise %d\n", madvise(h, TOTAL, MADV_HUGEPAGE)); touch(h);
        CK(cudaHostRegister(h, TOTAL, cudaHostRegisterMapped | cudaHostRegisterPortable));
        void* d; CK(cudaHostGetDevicePointer(&d, h, 0));
        printf("B allocated in %.1f s\n", secs(t));
        measure("B mmap + THP + cuMemHostRegister", h, (CUdeviceptr)d, picks, dp, out);
        CK(cudaHostUnregister(h)); munmap(h, TOTAL);
    }
    {   // C
        auto t = std::chrono::steady_clock::now();
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA; prop.location.id = 0;
        size_t gmin = 0, grec = 0;
        CK(cuMemGetAllocationGranularity(&gmin, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        CK(cuMemGetAllocationGranularity(&grec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        printf("C granularity min %zu recommended %zu\n", gmin, grec);
        CUmemGenericAllocationHandle hd; CK(cuMemCreate(&hd, TOTAL, &prop, 0));
        CUdeviceptr va; CK(cuMemAddressReserve(&va, TOTAL, 1 << 30, 0, 0)); CK(cuMemMap(va, TOTAL, 0, hd, 0));
        CUmemAccessDesc acc[2] = {};
        acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE; acc[0].location.id = 0; acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        acc[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA; acc[1].location.id = 0; acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        CK(cuMemSetAccess(va, TOTAL, acc, 2));
        touch((char*)va);
        printf("C allocated in %.1f s\n", secs(t));
        measure("C cuMemCreate host NUMA 0 (VMM)", (char*)va, va, picks, dp, out);
    }
    return 0;
}
