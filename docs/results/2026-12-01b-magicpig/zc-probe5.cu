// The table walk's reads as the lists lie (a table's members sorted by (code, segment, key): one
// code's runs over the 16 segments of 1M keys side by side, ~2 KiB), 28 layers x 4 KV heads x 83
// tables x 2 MiB in a THP mmap registered with the GPU, 28 query heads a layer, 512 MB of device
// writes between layers. W1: a block per (segment, head) reads its 128 B run of each table
// (today's lsh_walk); W2: a warp per (head, table) reads the code's whole 2 KiB, 16 B a lane;
// W3: the same, 8 B a lane. Then the attention's rows (18 heads x 2048 picks, K and V apart):
// one pick at a time a warp (today) against two and four picks' loads issued together.
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <cuda_runtime.h>
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("%s: error %d\n", #x, (int)e); return 1; } } while (0)
const size_t N = 1 << 20, D = 128, KVH = 4;
const int LAYERS = 28, TABLES = 83, SEGS = 16, WALK_HEADS = 28, GROUP = 7, RUN = 2048;
const size_t TABLE_BYTES = N * 2, TABLE_LAYER = KVH * TABLES * TABLE_BYTES;
const size_t LAYER_BYTES = 2 * KVH * N * D * 2, TOTAL = LAYER_BYTES * LAYERS;
// codes: [layer][head][table] the run's byte offset within its table (2 KiB aligned here).
__global__ void walk_seg(const char* tables, const uint32_t* at, float* out) {
    const int s = blockIdx.x, h = blockIdx.y, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const size_t kvh = h / GROUP;
    float acc = 0.f;
    for (int l = warp; l < TABLES; l += blockDim.x / 32) {
        const char* run = tables + (kvh * TABLES + l) * TABLE_BYTES + at[h * TABLES + l] + s * (RUN / SEGS);
        acc += (float)(((const uint32_t*)run)[lane] & 0xff);
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + t] = acc;
}
template <int W>
__global__ void walk_run(const char* tables, const uint32_t* at, float* out) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int l = blockIdx.x * (blockDim.x / 32) + warp;
    if (l >= TABLES) return;
    const size_t kvh = h / GROUP;
    const char* run = tables + (kvh * TABLES + l) * TABLE_BYTES + at[h * TABLES + l];
    float acc = 0.f;
    if (W == 16) {
        for (int i = 0; i < RUN / 512; ++i) { uint4 x = ((const uint4*)run)[i * 32 + lane]; acc += (float)((x.x ^ x.y ^ x.z ^ x.w) & 0xff); }
    } else {
        for (int i = 0; i < RUN / 256; ++i) { uint2 x = ((const uint2*)run)[i * 32 + lane]; acc += (float)((x.x ^ x.y) & 0xff); }
    }
    out[(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
const int HEADS = 18, PICKS = 2048, WARPS = 8, BLOCKS = 8;
template <int U>
__global__ void attend(const uint2* base, const uint32_t* p, float* out) {
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int W = BLOCKS * WARPS, c = blockIdx.x * WARPS + warp;
    const size_t kvh = h / GROUP;
    p += (size_t)h * PICKS;
    float acc = 0.f;
    for (int j = c; j < PICKS; j += W * U) {
        uint2 x[U], y[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int jj = j + u * W;
            if (jj < PICKS) {
                const size_t r = p[jj];
                x[u] = base[(kvh * N + r) * (D / 4) + lane];
                y[u] = base[(KVH * N + kvh * N + r) * (D / 4) + lane];
            } else { x[u] = y[u] = make_uint2(0, 0); }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc += __uint_as_float(x[u].x << 16) * __uint_as_float(y[u].y & 0xffff0000u);
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
    float* out; char* flush; uint32_t* at;
    CK(cudaMalloc(&out, 1 << 24)); CK(cudaMalloc(&flush, 512 << 20));
    { std::vector<uint32_t> a((size_t)LAYERS * WALK_HEADS * TABLES); for (auto& x : a) x = (rng() % (TABLE_BYTES / RUN)) * RUN;
      CK(cudaMalloc(&at, a.size() * 4)); CK(cudaMemcpy(at, a.data(), a.size() * 4, cudaMemcpyHostToDevice)); }
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
    const double bytes = (double)LAYERS * WALK_HEADS * TABLES * RUN;
    auto show = [&](const char* n, float m) { printf("walk, %-42s: %6.2f ms a step, %5.1f GB/s\n", n, m, bytes / m / 1e6); };
    show("a block a segment, 128 B each (today)", timed([&](int l) { walk_seg<<<dim3(SEGS, WALK_HEADS), 512>>>(dev + l * TABLE_LAYER, at + (size_t)l * WALK_HEADS * TABLES, out); }));
    show("a warp a table's 2 KiB, 16 B a lane", timed([&](int l) { walk_run<16><<<dim3((TABLES + 7) / 8, WALK_HEADS), 256>>>(dev + l * TABLE_LAYER, at + (size_t)l * WALK_HEADS * TABLES, out); }));
    show("a warp a table's 2 KiB, 8 B a lane", timed([&](int l) { walk_run<8><<<dim3((TABLES + 7) / 8, WALK_HEADS), 256>>>(dev + l * TABLE_LAYER, at + (size_t)l * WALK_HEADS * TABLES, out); }));
    CK(cudaGetLastError());
    std::vector<uint32_t> picks((size_t)LAYERS * HEADS * PICKS);
    for (size_t i = 0; i < picks.size(); i += PICKS) {
        for (int j = 0; j < PICKS; ++j) picks[i + j] = rng() % N;
        std::sort(picks.begin() + i, picks.begin() + i + PICKS);
    }
    uint32_t* dp; CK(cudaMalloc(&dp, picks.size() * 4)); CK(cudaMemcpy(dp, picks.data(), picks.size() * 4, cudaMemcpyHostToDevice));
    const double rows = (double)LAYERS * HEADS * PICKS * 512;
    auto arow = [&](const char* n, float m) { printf("attend, %-28s: %6.2f ms a step, %5.1f GB/s\n", n, m, rows / m / 1e6); };
    arow("a pick at a time (today)", timed([&](int l) { attend<1><<<dim3(BLOCKS, HEADS), 32 * WARPS>>>((const uint2*)(dev + l * LAYER_BYTES), dp + (size_t)l * HEADS * PICKS, out); }));
    arow("two picks' loads together", timed([&](int l) { attend<2><<<dim3(BLOCKS, HEADS), 32 * WARPS>>>((const uint2*)(dev + l * LAYER_BYTES), dp + (size_t)l * HEADS * PICKS, out); }));
    arow("four picks' loads together", timed([&](int l) { attend<4><<<dim3(BLOCKS, HEADS), 32 * WARPS>>>((const uint2*)(dev + l * LAYER_BYTES), dp + (size_t)l * HEADS * PICKS, out); }));
    CK(cudaGetLastError());
    return 0;
}
