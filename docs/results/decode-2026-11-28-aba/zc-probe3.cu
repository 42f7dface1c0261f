// As lsh_attend reads in a decode step: 28 layers of 2 GiB (K, V of 4 KV heads x 1M rows of 256 B)
// in a THP mmap registered with the GPU (the host tier's allocation), one launch a layer over 14
// query heads x 2200 sorted random picks, with 512 MB of device writes between layers (the
// layer's weights pass through L2). Orders: chunked (a warp a contiguous share: today) and strided
// (warp c reads picks c, c + 64, ...: a head's warps sweep its positions together). Then the same
// with 14 CPU threads reading scattered rows of the same memory meanwhile (the CPU's half).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <cuda_runtime.h>
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("%s: error %d\n", #x, (int)e); return 1; } } while (0)
const size_t N = 1 << 20, D = 128, KVH = 4;
const int HEADS = 14, GROUP = 7, PICKS = 2200, WARPS = 8, BLOCKS = 8, LAYERS = 28;
const size_t LAYER_BYTES = 2 * KVH * N * D * 2, TOTAL = LAYER_BYTES * LAYERS;
__global__ void attend(const uint2* k, const uint32_t* p, float* out, int strided) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int W = BLOCKS * WARPS, c = blockIdx.x * WARPS + warp;
    k += (size_t)(h / GROUP) * N * (D / 4);
    const uint2* v = k + KVH * N * (D / 4);
    p += (size_t)h * PICKS;
    float acc = 0.f;
    const int a = strided ? c : PICKS * c / W, b = strided ? PICKS : PICKS * (c + 1) / W, s = strided ? W : 1;
    for (int j = a; j < b; j += s) {
        uint2 x = k[(size_t)p[j] * (D / 4) + lane], y = v[(size_t)p[j] * (D / 4) + lane];
        acc += __uint_as_float(x.x << 16) * __uint_as_float(y.y & 0xffff0000u);
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
int main() {
    char* h = (char*)mmap(nullptr, TOTAL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(h, TOTAL, MADV_HUGEPAGE);
    { std::vector<std::thread> ts; for (int t = 0; t < 16; ++t) ts.emplace_back([=] { for (size_t i = TOTAL / 16 * t; i < TOTAL / 16 * (t + 1); i += 4096) h[i] = (char)i; }); for (auto& t : ts) t.join(); }
    CK(cudaHostRegister(h, TOTAL, cudaHostRegisterMapped | cudaHostRegisterPortable));
    char* dev; CK(cudaHostGetDevicePointer((void**)&dev, h, 0));
    std::mt19937 rng(7);
    std::vector<uint32_t> picks((size_t)LAYERS * HEADS * PICKS);
    for (size_t i = 0; i < picks.size(); i += PICKS) {
        for (int j = 0; j < PICKS; ++j) picks[i + j] = rng() % N;
        std::sort(picks.begin() + i, picks.begin() + i + PICKS);
    }
    uint32_t* dp; float* out; char* flush;
    CK(cudaMalloc(&dp, picks.size() * 4)); CK(cudaMemcpy(dp, picks.data(), picks.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&out, HEADS * BLOCKS * WARPS * 32 * 4)); CK(cudaMalloc(&flush, 512 << 20));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (int contend = 0; contend < 2; ++contend) {
        std::atomic<bool> stop{false}; std::atomic<long> rows{0};
        std::vector<std::thread> cpu;
        auto started = std::chrono::steady_clock::now();
        if (contend) for (int t = 0; t < 14; ++t) cpu.emplace_back([&, t] {
            std::mt19937 r(t); long n = 0; unsigned long s = 0;
            std::vector<uint32_t> p(PICKS);
            while (!stop) {
                const int l = r() % LAYERS, kh = r() % KVH;
                const uint16_t* k = (const uint16_t*)(h + l * LAYER_BYTES) + (size_t)kh * N * D; const uint16_t* v = k + KVH * N * D;
                for (auto& x : p) x = r() % N; std::sort(p.begin(), p.end());
                for (int j = 0; j < PICKS; ++j) {
                    if (j + 16 < PICKS) for (int c = 0; c < 4; ++c) { __builtin_prefetch(k + (size_t)p[j + 16] * D + c * 32); __builtin_prefetch(v + (size_t)p[j + 16] * D + c * 32); }
                    for (int i = 0; i < (int)D; i += 32) s += k[(size_t)p[j] * D + i] + v[(size_t)p[j] * D + i + 1];
                }
                n += PICKS;
            }
            rows += n + (s == 42);
        });
        for (int strided = 0; strided < 2; ++strided) {
            std::vector<float> ms;
            for (int r = 0; r < 6; ++r) {
                cudaEventRecord(e0);
                for (int l = 0; l < LAYERS; ++l) {
                    cudaMemsetAsync(flush, r + l, 512 << 20);
                    attend<<<dim3(BLOCKS, HEADS), 32 * WARPS>>>((const uint2*)(dev + l * LAYER_BYTES), dp + (size_t)l * HEADS * PICKS, out, strided);
                }
                cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
                float m; cudaEventElapsedTime(&m, e0, e1); if (r) ms.push_back(m);
            }
            // The flush alone, to subtract.
            cudaEventRecord(e0); for (int l = 0; l < LAYERS; ++l) cudaMemsetAsync(flush, l, 512 << 20); cudaEventRecord(e1); cudaEventSynchronize(e1);
            float f; cudaEventElapsedTime(&f, e0, e1);
            std::sort(ms.begin(), ms.end());
            const double bytes = (double)LAYERS * HEADS * PICKS * 512;
            printf("%s%-8s: %6.2f ms a step (median; flush %.2f), reads %.2f ms = %5.1f GB/s\n", contend ? "CPU reading too, " : "GPU alone, ", strided ? "strided" : "chunked", ms[2], f, ms[2] - f, bytes / (ms[2] - f) / 1e6);
        }
        auto t0 = std::chrono::steady_clock::now();
        stop = true; for (auto& t : cpu) t.join();
        (void)t0;
        if (contend) printf("  the CPU's 14 threads meanwhile: %.1f GB/s\n", rows.load() * 512.0 / std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() / 1e9);
    }
    // The CPU alone for a fixed time, for its rate.
    {
        std::atomic<long> rows{0}; std::vector<std::thread> cpu; auto t0 = std::chrono::steady_clock::now();
        for (int t = 0; t < 14; ++t) cpu.emplace_back([&, t] {
            std::mt19937 r(t + 100); long n = 0; unsigned long s = 0; std::vector<uint32_t> p(PICKS);
            for (int it = 0; it < 200; ++it) {
                const int l = r() % LAYERS, kh = r() % KVH;
                const uint16_t* k = (const uint16_t*)(h + l * LAYER_BYTES) + (size_t)kh * N * D; const uint16_t* v = k + KVH * N * D;
                for (auto& x : p) x = r() % N; std::sort(p.begin(), p.end());
                for (int j = 0; j < PICKS; ++j) {
                    if (j + 16 < PICKS) for (int c = 0; c < 4; ++c) { __builtin_prefetch(k + (size_t)p[j + 16] * D + c * 32); __builtin_prefetch(v + (size_t)p[j + 16] * D + c * 32); }
                    for (int i = 0; i < (int)D; i += 32) s += k[(size_t)p[j] * D + i] + v[(size_t)p[j] * D + i + 1];
                }
                n += PICKS;
            }
            rows += n + (s == 42);
        });
        for (auto& t : cpu) t.join();
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("CPU alone (14 threads, incl. sorting picks): %.1f GB/s\n", rows.load() * 512.0 / sec / 1e9);
    }
    return 0;
}
