"""What it costs to make a large file's bytes readable by the GPU (issue #19's reopen at 1M).

Run on the GPU machine: `PROBE_GB=16 python3 tools/host-pinning-probe.py`. It writes a PROBE_GB
file under /tmp, reads it into the page cache, maps it read-only and times: registering the
mapping in place (cudaHostRegister, read-only | mapped | portable; whole, and from 4 and 16
threads), copies to the device from the registered mapping, allocating page-locked memory
(what the offloaded tier did before: a copy of every row), and copying from the page cache into
page-locked memory on 1, 4 and 16 threads. docs/performance.md ("Reopen to the first token")
cites its figures; the file is removed at the end.
"""
import torch, os, time, mmap, numpy as np, threading, subprocess
cudart = torch.cuda.cudart()
GB = 1 << 30
N = int(os.environ.get("PROBE_GB", "16")) * GB
path = "/tmp/big.bin"
t = time.time()
subprocess.run(["fallocate", "-l", str(N), path], check=True)
# fill with nonzero data quickly: write a 256 MB pattern repeatedly
pat = np.random.randint(0, 255, size=256 << 20, dtype=np.uint8).tobytes()
with open(path, "r+b") as f:
    for i in range(N // len(pat)):
        f.write(pat)
print(f"write {N/GB:.0f} GB: {time.time()-t:.1f} s", flush=True)
t = time.time(); subprocess.run(f"cat {path} > /dev/null", shell=True); print(f"cat (page cache) {time.time()-t:.2f} s", flush=True)
t = time.time(); subprocess.run(f"cat {path} > /dev/null", shell=True); print(f"cat again {time.time()-t:.2f} s", flush=True)
torch.cuda.init(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
f = open(path, "rb")
# plain mmap, read-only
t = time.time()
mm = mmap.mmap(f.fileno(), N, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000))
print(f"mmap populate {time.time()-t:.3f} s", flush=True)
arr = np.frombuffer(mm, dtype=np.uint8)
ptr = arr.ctypes.data
# register in 1 GiB pieces, read-only|mapped|portable
FLAGS = 0x01 | 0x02 | 0x08
t = time.time()
err = cudart.cudaHostRegister(ptr, N, FLAGS)
dt = time.time() - t
print(f"cudaHostRegister whole {N/GB:.0f} GB flags ro|mapped|portable: err {err} {dt:.3f} s = {N/GB/dt:.1f} GB/s", flush=True)
src = torch.from_numpy(arr)
print("is_pinned", src.is_pinned(), flush=True)
dst = torch.empty(GB, dtype=torch.uint8, device="cuda")
for rep in range(2):
    torch.cuda.synchronize(); t = time.time()
    for i in range(N // GB):
        dst.copy_(src[i * GB:(i + 1) * GB], non_blocking=True)
    torch.cuda.synchronize(); dt = time.time() - t
    print(f"H2D from registered mmap: {N/GB/dt:.1f} GB/s ({dt:.3f} s)", flush=True)
t = time.time(); err = cudart.cudaHostUnregister(ptr); print(f"unregister {time.time()-t:.3f} s err {err}", flush=True)
# register in parallel pieces on threads
def reg(lo, hi, out, i):
    s = time.time(); out[i] = (cudart.cudaHostRegister(ptr + lo, hi - lo, FLAGS), time.time() - s)
for nt in (4, 16):
    out = [None] * nt
    step = N // nt
    t = time.time()
    th = [threading.Thread(target=reg, args=(i * step, (i + 1) * step, out, i)) for i in range(nt)]
    [x.start() for x in th]; [x.join() for x in th]
    dt = time.time() - t
    print(f"register {nt} threads: {dt:.3f} s = {N/GB/dt:.1f} GB/s errs {[o[0] for o in out][:4]}", flush=True)
    for i in range(nt):
        cudart.cudaHostUnregister(ptr + i * step)
# pinned alloc
t = time.time(); pin = torch.empty(N // 4, dtype=torch.uint8, pin_memory=True); dt = time.time() - t
print(f"pinned alloc {N/4/GB:.0f} GB: {dt:.3f} s = {N/4/GB/dt:.1f} GB/s", flush=True)
# parallel memcpy page cache -> pinned, 16 threads, 4 GB
pn = pin.numpy()
def cp(lo, hi):
    np.copyto(pn[lo:hi], arr[lo:hi])
for nt in (1, 4, 16):
    step = (N // 4) // nt
    t = time.time()
    th = [threading.Thread(target=cp, args=(i * step, (i + 1) * step)) for i in range(nt)]
    [x.start() for x in th]; [x.join() for x in th]
    dt = time.time() - t
    print(f"memcpy page cache -> pinned {nt} threads: {N/4/GB/dt:.1f} GB/s", flush=True)
# device->host pageable? zero copy kernel read: sum via mapped pointer not available in torch; skip
os.remove(path)
