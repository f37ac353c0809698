"""PNG plots of a recorded benchmark run (matplotlib is optional: no plots without it)."""
from __future__ import annotations

from pathlib import Path


def plot(data: dict, out_dir: Path) -> list[Path]:
    """PNG plots; returns the files written (none when matplotlib is missing)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    tps = [(k, v) for k, v in data.items() if k.startswith("throughput_")]
    if tps:
        fig, axes = plt.subplots(1, len(tps), figsize=(6 * len(tps), 4), squeeze=False)
        for ax, (name, d) in zip(axes[0], tps):
            rows = d["workloads"]
            labels = [w for w in rows]
            values = [rows[w]["output_tok_s"] for w in labels]
            bars = ax.bar(labels, values, color="#4477aa")
            for bar, w in zip(bars, labels):
                ax.annotate(f"{rows[w]['ratio_to_base']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
            ax.set_title(f"output tokens/s by workload ({d['dtype']})")
            ax.set_ylabel("tokens/s")
            ax.tick_params(axis="x", labelrotation=20)
        save(fig, "throughput.png")
    if "peer_bfloat16" in data:
        t = data["peer_bfloat16"]["output_tok_s"]
        fig, ax = plt.subplots(figsize=(5, 4))
        xs = range(2)
        ax.bar([x - 0.2 for x in xs], [t["ours_eight"], t["ours_base"]], 0.4, label="loraserve")
        ax.bar([x + 0.2 for x in xs], [t["peft_eight"], t["peft_base"]], 0.4, label="HF + PEFT")
        ax.set_xticks(list(xs), ["8 adapters mixed", "base"])
        ax.set_ylabel("output tokens/s")
        ax.legend()
        save(fig, "peer.png")
    if "bandwidth_bfloat16" in data:
        sweep = data["bandwidth_bfloat16"]["decode_sweep"]["batches"]
        batches = [int(b) for b in sweep]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot(batches, [sweep[str(b)]["bound_tok_s"] for b in batches], "o--", label="bandwidth bound")
        if all("gemm_ceiling_tok_s" in sweep[str(b)] for b in batches):
            ax.plot(batches, [sweep[str(b)]["gemm_ceiling_tok_s"] for b in batches], "s:", label="base GEMMs only")
        ax.plot(batches, [sweep[str(b)]["decode_tok_s"] for b in batches], "o-", label="measured (base)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.legend()
        save(fig, "roofline.png")
    if "profile_decode_bfloat16" in data:
        rows = data["profile_decode_bfloat16"]["workloads"]
        fig, ax = plt.subplots(figsize=(5, 4))
        bottom = [0.0] * len(rows)
        for part in ("base_linear", "attention", "lora", "sampling", "other"):
            values = [rows[w]["parts_ms"][part] for w in rows]
            ax.bar(list(rows), values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("ms per decode step")
        ax.legend(fontsize=8)
        save(fig, "profile.png")
    if "hotload_bfloat16" in data:
        raw = data["hotload_bfloat16"]["raw_ms"]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.hist([raw["disk_to_host"], raw["host_to_slot"]], bins=20, label=["disk -> host", "host -> slot"])
        ax.set_xlabel("ms")
        ax.legend()
        save(fig, "hotload.png")
    return written
