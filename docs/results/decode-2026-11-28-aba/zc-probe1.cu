// Scattered 256-byte row reads by the GPU from page-locked mapped host memory: what binds
// MagicPIG's GPU half (~15 GB/s). A "layer": 2 KV heads x 7 query heads x PICKS sorted random
// positions of 1M rows; K and V rows 256 B each ([kvh][n][128] bf16). Orders: chunked (a warp a
// contiguous share of its head's picks: today's lsh_attend), strided (warp c reads picks c, c+W..:
// the grid sweeps positions together), sequential (consecutive rows: the link's bound).
// Footprint: the layers spread over the whole buffer, or all in the first layer's region.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
const size_t N = 1 << 20, D = 128, KVH = 4;
const int HEADS = 14, GROUP = 7, PICKS = 2200, WARPS = 8, BLOCKS = 8;
__global__ void attend(const uint2* kv, size_t layer_words, const uint32_t* picks, int mode, float* out, int layers) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int W = BLOCKS * WARPS, c = blockIdx.x * WARPS + warp;
    float acc = 0.f;
    for (int l = 0; l < layers; ++l) {
        const uint2* k = kv + (size_t)l * layer_words + (size_t)(h / GROUP) * N * (D / 4);
        const uint2* v = k + KVH * N * (D / 4);
        const uint32_t* p = picks + ((size_t)l * HEADS + h) * PICKS;
        int a, b, s;
        if (mode == 0) { a = PICKS * c / W; b = PICKS * (c + 1) / W; s = 1; }
        else { a = c; b = PICKS; s = W; }
        for (int j = a; j < b; j += s) {
            const size_t pos = mode == 2 ? (size_t)(l * 977 + h * 4099 + j) % N : p[j];
            uint2 x = k[pos * (D / 4) + lane], y = v[pos * (D / 4) + lane];
            acc += __uint_as_float(x.x << 16) * __uint_as_float(y.y & 0xffff0000u);
        }
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
int main(int argc, char** argv) {
    const int layers = 28;
    const size_t layer_bytes = 2 * KVH * N * D * 2;  // K and V of 4 KV heads: 2 GiB
    const size_t total = layer_bytes * layers;
    auto t0 = std::chrono::steady_clock::now();
    char* host;
    CK(cudaHostAlloc((void**)&host, total, cudaHostAllocMapped | cudaHostAllocPortable));
    for (size_t i = 0; i < total; i += 4096) host[i] = (char)i;
    uint2* dev;
    CK(cudaHostGetDevicePointer((void**)&dev, host, 0));
    printf("pinned %zu GiB in %.1f s\n", total >> 30, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::mt19937 rng(7);
    std::vector<uint32_t> picks((size_t)layers * HEADS * PICKS);
    for (size_t i = 0; i < picks.size(); i += PICKS) {
        for (int j = 0; j < PICKS; ++j) picks[i + j] = rng() % N;
        std::sort(picks.begin() + i, picks.begin() + i + PICKS);
    }
    uint32_t* dp; float* out;
    CK(cudaMalloc(&dp, picks.size() * 4));
    CK(cudaMemcpy(dp, picks.data(), picks.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, HEADS * BLOCKS * WARPS * 32 * 4));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    const char* names[] = {"chunked (today)", "strided", "sequential"};
    for (int spread = 1; spread >= 0; --spread)
        for (int mode = 0; mode < 3; ++mode) {
            const size_t lw = spread ? layer_bytes / 8 : 0;
            float best = 1e9, sum = 0; const int reps = 5;
            for (int r = 0; r <= reps; ++r) {
                cudaEventRecord(e0);
                attend<<<dim3(BLOCKS, HEADS), 32 * WARPS>>>(dev, lw, dp, mode, out, layers);
                cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
                float ms; cudaEventElapsedTime(&ms, e0, e1);
                if (r) { best = std::min(best, ms); sum += ms; }
            }
            const double bytes = (double)layers * HEADS * PICKS * 512;
            printf("%-18s footprint %5.1f GiB: %6.2f ms a step (mean %6.2f)  %5.1f GB/s\n", names[mode],
                   spread ? total / 1073741824.0 : layer_bytes / 1073741824.0, best, sum / reps, bytes / best / 1e6);
        }
    return 0;
}
