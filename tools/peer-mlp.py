"""PyTorch's time for the prefill MLP `folio bench kernels` times (Qwen2.5-7B: 8192 tokens,
3584 -> 18944 -> 3584, bf16): each projection, SiLU(gate) * up, and the whole MLP with its
residual, on the same GPU, to put beside the bench's MLP rows. Run on the GPU machine:
`python3 tools/peer-mlp.py` (docs/performance.md, "The MLP")."""
import time, torch
n, h, i = 8192, 3584, 18944
dev, dt = "cuda", torch.bfloat16
x = torch.randn(n, h, device=dev, dtype=dt)
wg, wu, wd = (torch.randn(i, h, device=dev, dtype=dt), torch.randn(i, h, device=dev, dtype=dt), torch.randn(h, i, device=dev, dtype=dt))
g, u = torch.randn(n, i, device=dev, dtype=dt), torch.randn(n, i, device=dev, dtype=dt)
def t(f, reps=50):
    f(); torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(reps): f()
    torch.cuda.synchronize(); return (time.perf_counter() - s) / reps
for name, f, flops in [
    ("gate (or up) projection", lambda: x @ wg.T, 2 * n * h * i),
    ("down projection", lambda: g @ wd.T, 2 * n * h * i),
    ("SiLU(gate) * up", lambda: torch.nn.functional.silu(g) * u, 0),
    ("whole, residual included", lambda: x + (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T, 6 * n * h * i),
]:
    s = t(f)
    print(f"torch MLP {name:28s} {s*1e6:10.1f} us {flops/s/1e12 if flops else 0:8.1f} TFLOP/s")
