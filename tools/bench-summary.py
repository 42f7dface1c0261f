#!/usr/bin/env python3
"""One line per method of `folio bench --shape --json` output (mean, median, p90, floor, peak and
planned VRAM; the K/V dtype, the emulated link, peak RSS against the host budget; on the file
tier its cache, the disk's rate and each step's disk bytes, hits and overlap), and with `--profile` where a step's time goes: the host's time queueing the step
against the step, and the spans with the most device time.

usage: python3 tools/bench-summary.py BENCH.jsonl...
"""
import json
import sys

SPANS = 12  # spans listed per profiled method

for path in sys.argv[1:]:
    print("==", path)
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if "decode_ms_mean" not in d:
            print(line[:300])
            continue
        print("%-6s %-10s vram %-6s mean %6.2f med %6.2f p90 %6.2f floor %5.2f peakVRAM %5.2f GiB planned %5.2f GiB" % (
            d.get("weights"), d["method"], round((d.get("vram_budget") or 0) / 2**30, 1), d["decode_ms_mean"],
            d["decode_ms_median"], d["decode_ms_p90"], d["floor_ms"], (d.get("peak_device_bytes") or 0) / 2**30,
            (d.get("planned_device_bytes") or 0) / 2**30))
        link = d.get("emulated_link")
        print("       kv %-5s link %-10s peakRSS %5.2f GiB of host budget %s; floor link %.2f ms, pcie4 floor %.2f ms" % (
            d.get("kv_dtype") or "tier", "%.1f GB/s" % (link / 1e9) if link else "as is",
            (d.get("peak_rss_bytes") or 0) / 2**30,
            "%.2f GiB" % (d["host_budget"] / 2**30) if d.get("host_budget") else "-",
            d.get("floor_link_ms", 0), d.get("pcie4_floor_ms", 0)))
        f = d.get("file")
        if f:
            print("       file tier: keys in memory %.2f GiB, cache %.2f GiB%s, disk %.2f GB/s seq; per step %.1f MiB in %.1f reads, %.2f ms reading (%.2f GB/s), hits %.1f%%, overlap with the step before %.1f%%" % (
                f.get("keys_in_memory", 0) / 2**30, f["cache_bytes"] / 2**30, "" if f["direct"] else " (page cache not bypassed)", f["disk_bandwidth"] / 1e9,
                f["disk_bytes_per_step"] / 2**20, f["disk_reads_per_step"], f["disk_read_ms_per_step"],
                f["disk_rate"] / 1e9, 100 * (f["hit_rate"] if f["hit_rate"] is not None else float("nan")),
                100 * (f["step_overlap"] if f["step_overlap"] is not None else float("nan"))))
            if f.get("state_reads_per_step"):
                print("       the method's state on disk (magicpig's bucket lists): %.1f MiB a step in %.0f reads" % (
                    f["state_bytes_per_step"] / 2**20, f["state_reads_per_step"]))
            if f.get("ahead_blocks_per_step"):
                print("       read ahead of the gathers: %.2f ms and %.0f blocks a step (beside the device's work); a read-ahead %.2f ms to its positions, %.2f ms to done" % (
                    f["ahead_read_ms_per_step"], f["ahead_blocks_per_step"], f.get("ahead_start_ms", 0), f.get("ahead_wall_ms", 0)))
            if f.get("emulated_disk") or f.get("device_gathers") is not None:
                e = f.get("emulated_disk")
                print("       %s; late reads %d; gathers by the device from the cache %s" % (
                    "disk emulated at %.2f GB/s, %.0fk reads/s" % (e[0] / 1e9, e[1] / 1e3) if e else "the machine's disk",
                    f.get("late_reads", 0),
                    "%.1f%%" % (100 * f["device_gathers"]) if f.get("device_gathers") is not None else "-"))
        p = d.get("profile")
        if p:
            print("   profile: host queued %.2f ms of step %.2f ms; synced step %.2f ms"
                  % (p["host_ms"], p["step_ms"], p["synced_step_ms"]))
            for s in sorted(p["spans"], key=lambda s: -s["device_ms"])[:SPANS]:
                print("     %-40s host %6.3f dev %6.3f calls %5.1f" % (s["name"], s["host_ms"], s["device_ms"], s["calls"]))
