// MagicPIG's GPU reads at 1M as a decode step makes them, on the host tier's memory (a THP mmap
// registered with the GPU): 28 layers of 2 GiB (K and V of 4 KV heads x 1M rows of 256 B), a
// launch a layer over 18 query heads (3 KV heads) x 2048 sorted random picks, 512 MB of device
// writes between layers. Variants: K and V apart (today), K and V of a row side by side (one
// 512 B read: one page's translation a pick instead of two), K alone; then the table walk's
// reads: per (layer, query head, table, segment) a start (8 B) then its 128 B run, with the
// starts in host memory (today) or in device memory.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <cuda_runtime.h>
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("%s: error %d\n", #x, (int)e); return 1; } } while (0)
const size_t N = 1 << 20, D = 128, KVH = 4;
const int HEADS = 18, GROUP = 7, PICKS = 2048, WARPS = 8, BLOCKS = 8, LAYERS = 28;
const size_t LAYER_BYTES = 2 * KVH * N * D * 2, TOTAL = LAYER_BYTES * LAYERS;
// mode 0: K and V apart; 1: side by side (row r of head h at (h N + r) 512 B); 2: K alone.
__global__ void attend(const uint2* base, const uint32_t* p, float* out, int mode) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int W = BLOCKS * WARPS, c = blockIdx.x * WARPS + warp;
    const size_t kvh = h / GROUP;
    p += (size_t)h * PICKS;
    float acc = 0.f;
    for (int j = c; j < PICKS; j += W) {
        const size_t r = p[j];
        uint2 x, y;
        if (mode == 0) {
            x = base[(kvh * N + r) * (D / 4) + lane];
            y = base[(KVH * N + kvh * N + r) * (D / 4) + lane];
        } else if (mode == 1) {
            x = base[(kvh * N + r) * (D / 2) + lane];
            y = base[(kvh * N + r) * (D / 2) + 32 + lane];
        } else {
            x = base[(kvh * N + r) * (D / 4) + lane];
            y = x;
        }
        acc += __uint_as_float(x.x << 16) * __uint_as_float(y.y & 0xffff0000u);
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
const int TABLES = 83, SEGS = 16, WALK_HEADS = 28;
// A block per (segment, head): thread l < TABLES reads table l's start for (code, segment), then
// the block reads each table's 128 B run (a warp a table at a time).
__global__ void walk(const char* tables, const uint32_t* starts, const uint32_t* codes, float* out) {
    __shared__ uint32_t from[TABLES];
    const int s = blockIdx.x, h = blockIdx.y, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const size_t kvh = h / GROUP;
    if (t < TABLES) {
        const uint32_t c = codes[h * TABLES + t] & 1023;
        from[t] = starts[(kvh * TABLES + t) * 16385 + c * SEGS + s];
    }
    __syncthreads();
    float acc = 0.f;
    for (int l = warp; l < TABLES; l += blockDim.x / 32) {
        const size_t at = (kvh * TABLES + l) * (N * 2) + (size_t)(from[l] % (N * 2 / 128)) * 128;
        acc += (float)(((const uint32_t*)(tables + at))[lane] & 0xff);
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + t] = acc;
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
    CK(cudaMalloc(&out, 1 << 24)); CK(cudaMalloc(&flush, 512 << 20));
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    auto timed = [&](auto launch) {
        std::vector<float> ms;
        for (int r = 0; r < 6; ++r) {
            cudaEventRecord(e0);
            for (int l = 0; l < LAYERS; ++l) { cudaMemsetAsync(flush, r + l, 512 << 20); launch(l); }
            cudaEventRecord(e1); cudaEventSynchronize(e1);
            float m; cudaEventElapsedTime(&m, e0, e1); if (r) ms.push_back(m);
        }
        cudaEventRecord(e0); for (int l = 0; l < LAYERS; ++l) cudaMemsetAsync(flush, l, 512 << 20); cudaEventRecord(e1); cudaEventSynchronize(e1);
        float f; cudaEventElapsedTime(&f, e0, e1);
        std::sort(ms.begin(), ms.end());
        return ms[2] - f;
    };
    const char* names[] = {"K and V apart (today)", "K and V side by side", "K alone"};
    for (int mode = 0; mode < 3; ++mode) {
        const float m = timed([&](int l) { attend<<<dim3(BLOCKS, HEADS), 32 * WARPS>>>((const uint2*)(dev + l * LAYER_BYTES), dp + (size_t)l * HEADS * PICKS, out, mode); });
        const double reads = (double)LAYERS * HEADS * PICKS * (mode == 2 ? 1 : 2);
        printf("attend, %-24s: %6.2f ms a step, %5.1f GB/s, %6.1f M reads of 256 B/s\n", names[mode], m, reads * 256 / m / 1e6, reads / m / 1e3);
    }
    CK(cudaGetLastError());
    // The walk: tables over the first 18.6 GB of the map (4 KV heads x 83 tables x 2 MB a layer).
    const size_t TABLE_LAYER = KVH * TABLES * N * 2, STARTS = KVH * TABLES * 16385;
    uint32_t* codes; CK(cudaMalloc(&codes, (size_t)LAYERS * WALK_HEADS * TABLES * 4));
    { std::vector<uint32_t> c((size_t)LAYERS * WALK_HEADS * TABLES); for (auto& x : c) x = rng(); CK(cudaMemcpy(codes, c.data(), c.size() * 4, cudaMemcpyHostToDevice)); }
    uint32_t* dstarts; CK(cudaMalloc(&dstarts, (size_t)LAYERS * STARTS * 4));
    { std::vector<uint32_t> st((size_t)LAYERS * STARTS); for (auto& x : st) x = rng(); CK(cudaMemcpy(dstarts, st.data(), st.size() * 4, cudaMemcpyHostToDevice));
      // Host starts: after the tables in the map.
      memcpy(h + LAYERS * TABLE_LAYER, st.data(), st.size() * 4); }
    const uint32_t* hstarts = (const uint32_t*)(dev + LAYERS * TABLE_LAYER);
    for (int on_dev = 0; on_dev < 2; ++on_dev) {
        const float m = timed([&](int l) { walk<<<dim3(SEGS, WALK_HEADS), 512>>>(dev + l * TABLE_LAYER, (on_dev ? dstarts : hstarts) + (size_t)l * STARTS, codes + (size_t)l * WALK_HEADS * TABLES, out); });
        const double runs = (double)LAYERS * WALK_HEADS * TABLES * SEGS;
        printf("walk, starts in %-6s memory: %6.2f ms a step, %5.1f M runs/s (%.1f GB/s of runs)\n", on_dev ? "device" : "host", m, runs / m / 1e3, runs * 128 / m / 1e6);
    }
    CK(cudaGetLastError());
    return 0;
}
