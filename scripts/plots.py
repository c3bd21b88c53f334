"""The benchmarks' --json output drawn as PNG figures (Debian's python3-matplotlib), for the docs
to show beside their tables:

  allreduce_busbw.png    all-reduce bus bandwidth against message size on one host: tandem's
                         shm backend (out of place, and in place on td_comm_alloc memory), its
                         mpi backend and Open MPI's MPI_Allreduce (bench/allreduce under mpirun),
                         and torch.distributed.all_reduce over tandem and over gloo
                         (bench/torch_backend.py)
  multihost.png          two emulated hosts x two ranks on a fast and a slow link: the mpi and
                         ucx backends, flat and hierarchical, against MPI_Allreduce, and the CNN's
                         DDP flat, hierarchical and DDP2 against the no-communication ceiling
                         (bench/multihost, as root)
  ddp_scaling.png        samples/s of one process, of two with DDP, and of two with no
                         communication (the ceiling), tandem beside PyTorch (bench/train)
  amp_speedup.png        mixed precision O1-O3 over f32, and PyTorch's autocast over its f32
                         (bench/train)
  deterministic_cost.png deterministic DDP against the default (bench/train)
  pipeline_timeline.png  GPipe and 1F1B as per-stage timelines of a step, from the traces
                         bench/pipeline --trace writes (each micro-batch's forward and
                         backward on each stage): the bubble is the white
  torch_backend.png      PyTorch over tandem against over gloo: all-reduce bus bandwidth and
                         DDP samples/s beside the no-communication ceiling
                         (bench/torch_backend.py)
  job_trace.png          one step of a job's merged trace (tandemrun --trace): a row per rank
                         and thread, collectives joined to the rank that arrived last

    sh scripts/plots.sh                        # make plots: the benchmarks, then the figures
    /usr/bin/python3 scripts/plots.py          # draws docs/img/*.png from docs/data/
    /usr/bin/python3 scripts/plots.py --run [--only train,pipeline]
                                               # runs the benchmarks into docs/data/ first

--run needs the build (make), Open MPI, Debian's python3-torch and the torch backend
(sh scripts/deps.sh bench torch plots); bench/multihost needs root and is left out otherwise.
It takes about 40 minutes on two cores. A benchmark that fails keeps its earlier data (and the run
ends with status 1 naming it). Lines of a benchmark's output that are not JSON (its tables) go
to the .jsonl files' neighbours (*.txt), headed by the command, the load average and the CPU.
Then scripts/doc_tables.py rewrites the docs' tables of these numbers from the same data.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DPI = 80
COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "transfer": "#55a868",
          "compute": "#8172b2", "comm": "#c44e52", "ddp": "#937860"}

# Each benchmark: the file its JSON lines go to, and its commands (run from the repository root,
# one after the other, their lines appended).
TORCH_BACKEND = ["/usr/bin/python3", "-W", "ignore", "bench/torch_backend.py", "--json"]
RUNS = [
    ("allreduce", [["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                    "build/bench/allreduce", "--repeat", "3", "--json"]]),
    ("torch_backend", [TORCH_BACKEND] * 3),
    ("pipeline", [["build/bench/pipeline", "--repeat", "3", "--trace", "docs/data/pipeline",
                   "--json"]]),
    ("train", [["build/bench/train", "--amp", "O0,O1,O2,O3", "--repeat", "3", "--json"]]),
    ("multihost", [["build/bench/multihost", "--repeat", "3", "--json"]]),
]


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_name():
    """The CPU as the benchmarks' headings name it (bench/bench.h's bench_cpu_name): its model
    name, family and model, and the vector features the kernels choose by."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
            if key == "flags":
                break
    flags = info.get("flags", "").split()
    found = [x for x in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if x in flags]
    return "%s (family %s model %s; %s)" % (info.get("model name", "unknown CPU"),
                                            info.get("cpu family", "?"), info.get("model", "?"),
                                            " ".join(found) or "no avx512")


def run_benchmarks(data, only):
    """Runs the benchmarks named in `only` (all when empty); returns the names that failed."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "build", "python"), OMP_NUM_THREADS="1")
    failed = []
    for name, cmds in RUNS:
        if only and name not in only:
            continue
        if name == "multihost" and os.geteuid() != 0:
            print("# bench/multihost needs root for its network namespaces: left as it was")
            continue
        js, txt = [], []
        for cmd in cmds:
            line = " ".join(cmd)
            print("$ " + line, flush=True)
            txt.append("$ %s   (load average %s; CPU %s)\n" % (line, load_average(), cpu_name()))
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print("# %s failed (exit %d): its data stays as it was" % (name, done.returncode))
                failed.append(name)
                break
            for out in done.stdout.splitlines():
                (js if out.startswith("{") else txt).append(out + "\n")
        else:
            for ext, lines in ((".jsonl", js), (".txt", txt)):
                with open(os.path.join(data, name + ext), "w") as f:
                    f.writelines(lines)
    if not only or "job_trace" in only:
        # Four steps of the training example under tandemrun --trace, for the job trace figure.
        tmp = os.path.join(data, "job")
        done = subprocess.run(["build/bin/tandemrun", "--trace", tmp, "--trace-ops",
                               "--nproc-per-node", "2", "build/examples/mnist", "--model", "net",
                               "--epochs", "1", "--max-steps", "4", "--no-eval"], cwd=ROOT,
                              env=env, stdout=subprocess.DEVNULL)
        if done.returncode == 0:
            shutil.move(os.path.join(tmp, "trace.json"), os.path.join(data, "job_trace.json"))
        else:
            failed.append("job_trace")
        shutil.rmtree(tmp, ignore_errors=True)
    return failed


def rows(data, name):
    path = os.path.join(data, name + ".jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    shown = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
    print("wrote %s (%d KB)" % (shown, os.path.getsize(path) // 1024))


def size_label(nbytes):
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return "%d %s" % (nbytes // div, unit)
    return "%d B" % nbytes


def medians(rs, key, fields):
    """Rows grouped by key(row): the median of each field over the group's rows."""
    groups = {}
    for r in rs:
        groups.setdefault(key(r), []).append(r)
    return {k: {f: statistics.median(r[f] for r in g) for f in fields} for k, g in groups.items()}


def plot_allreduce(data, out):
    keys = ["shm_busbw", "shm-reg_busbw", "mpi-backend_busbw", "MPI_Allreduce_busbw"]
    runs = [r for r in rows(data, "allreduce") if r.get("bench") == "allreduce"]
    present = [k for k in keys if runs and all(k in r for r in runs)]
    ar = sorted(({"bytes": b, **m} for b, m in
                 medians(runs, lambda r: r["bytes"], present).items()), key=lambda r: r["bytes"])
    tb = medians([r for r in rows(data, "torch_backend") if r["bench"] == "torch_allreduce"],
                 lambda r: r["bytes"], ["gloo_busbw", "tandem_busbw"])
    if not ar and not tb:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [("shm_busbw", "tandem shm", "-o"), ("shm-reg_busbw", "tandem shm, td_comm_alloc", "-s"),
              ("mpi-backend_busbw", "tandem mpi backend", "-^"),
              ("MPI_Allreduce_busbw", "Open MPI MPI_Allreduce", "--v")]
    for key, label, style in series:
        pts = [(r["bytes"], r[key]) for r in ar if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    if tb:
        sizes = sorted(tb)
        ax.plot(sizes, [tb[s]["tandem_busbw"] for s in sizes], "-D",
                label="torch.distributed over tandem")
        ax.plot(sizes, [tb[s]["gloo_busbw"] for s in sizes], "--x",
                label="torch.distributed over gloo")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["bytes"] for r in ar} | set(tb))
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(t) for t in ticks], rotation=45)
    ax.set_xlabel("message size (f32 sum, 2 ranks; medians of the runs)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("all-reduce: tandem's paths and their peers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out, "allreduce_busbw.png")


def plot_multihost(data, out):
    rs = rows(data, "multihost")
    ar = [r for r in rs if r["bench"] == "multihost_allreduce"]
    cnn = [r for r in rs if r["bench"] == "multihost_cnn"]
    links = list(dict.fromkeys(r["link"] for r in ar))
    if not links:
        return
    fig, axes = plt.subplots(1, len(links) + 1, figsize=(4.2 * (len(links) + 1), 4.2))
    series = [("mpi_busbw", "Open MPI MPI_Allreduce", "--v"), ("flat_busbw", "mpi backend, flat", "-^"),
              ("hier_busbw", "mpi backend, hierarchical", "-o"),
              ("ucx_flat_busbw", "ucx backend, flat", "-s"),
              ("ucx_hier_busbw", "ucx backend, hierarchical", "-D")]
    for ax, link in zip(axes, links):
        pts = sorted((r for r in ar if r["link"] == link), key=lambda r: r["bytes"])
        for key, label, style in series:
            ax.plot([r["bytes"] for r in pts], [r[key] for r in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["bytes"] for r in pts])
        ax.set_xticklabels([size_label(r["bytes"]) for r in pts], rotation=45)
        ax.set_ylim(bottom=0)
        ax.set_title("all-reduce, " + link, fontsize=10)
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    ways = [("flat", "DDP flat"), ("hier", "DDP hierarchical"), ("ddp2", "DDP2"),
            ("nocomm", "no comm\n(ceiling)")]
    width = 0.8 / len(ways)
    for i, (key, label) in enumerate(ways):
        ax.bar([k + i * width for k in range(len(cnn))], [r[key] for r in cnn], width,
               label=label.replace("\n", " "), color="#cccccc" if key == "nocomm" else None)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cnn))])
    ax.set_xticklabels([r["link"] for r in cnn], fontsize=8)
    ax.set_ylabel("samples/s")
    ax.set_title("the CNN, global batch 128", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("two emulated hosts x two ranks (bench/multihost)")
    fig.tight_layout()
    save(fig, out, "multihost.png")


def train_rows(data):
    return [r for r in rows(data, "train") if "amp" in r]


def plot_ddp_scaling(data, out):
    rs = [r for r in train_rows(data) if r["amp"] == "f32"]
    if not rs:
        return
    models = list(dict.fromkeys(r["model"] for r in rs))
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 4))
    for ax, m in zip(axes if len(models) > 1 else [axes], models):
        get = {(r["world"], r["comm"]): r for r in rs if r["model"] == m}
        bars = [("1 process", get.get((1, True), {}).get("tandem")),
                ("2, DDP", get.get((2, True), {}).get("tandem")),
                ("2, no comm\n(ceiling)", get.get((2, False), {}).get("tandem"))]
        peer = [get.get((1, True), {}).get("pytorch"), get.get((2, True), {}).get("pytorch")]
        xs = range(len(bars))
        ax.bar(xs, [b[1] or 0 for b in bars], color=["#4c72b0", "#55a868", "#cccccc"],
               label="tandem")
        ax.plot([0, 1], [p or 0 for p in peer], "k--o", label="PyTorch (gloo)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([b[0] for b in bars], fontsize=8)
        ax.set_title(m)
        ax.set_ylabel("samples/s")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = (axes[0] if len(models) > 1 else axes).get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.93), fontsize=8,
               ncol=2, frameon=False)
    fig.suptitle("DDP at 2 ranks against one process and the no-communication ceiling")
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    save(fig, out, "ddp_scaling.png")


def plot_amp(data, out):
    rs = train_rows(data)
    levels = [a for a in dict.fromkeys(r["amp"] for r in rs) if a != "f32"]
    if not levels:
        return
    models = list(dict.fromkeys(r["model"] for r in rs))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, world in zip(axes, (1, 2)):
        width = 0.8 / (len(levels) + 1)
        for i, lv in enumerate(levels):
            vals = [next((r["vs_f32"] for r in rs if r["model"] == m and r["amp"] == lv and
                          r["world"] == world and r["comm"]), 0) for m in models]
            ax.bar([k + i * width for k in range(len(models))], vals, width, label="tandem " + lv)
        # PyTorch's autocast against its own f32 rows (one autocast row serves every level).
        peer = []
        for m in models:
            f32 = next((r["pytorch"] for r in rs if r["model"] == m and r["amp"] == "f32" and
                        r["world"] == world and r["comm"]), 0)
            auto = next((r["pytorch"] for r in rs if r["model"] == m and r["amp"] != "f32" and
                         r["world"] == world and r["comm"] and r["pytorch"] > 0), 0)
            peer.append(auto / f32 if f32 > 0 and auto > 0 else 0)
        ax.bar([k + len(levels) * width for k in range(len(models))], peer, width, color="#999999",
               label="PyTorch autocast bf16")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(models))])
        ax.set_xticklabels(models)
        ax.set_title("world %d" % world)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("speed-up over f32")
    axes[0].legend(fontsize=7)
    fig.suptitle("mixed precision against f32 (samples/s ratio)")
    fig.tight_layout()
    save(fig, out, "amp_speedup.png")


def plot_deterministic(data, out):
    rs = [r for r in rows(data, "train") if "deterministic" in r]
    if not rs:
        return
    labels = ["%s, world %d" % (r["model"], r["world"]) for r in rs]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rs))
    ax.bar([x - 0.2 for x in xs], [r["default"] for r in rs], 0.4, label="default DDP")
    ax.bar([x + 0.2 for x in xs], [r["deterministic"] for r in rs], 0.4,
           label="deterministic (%d shards)" % rs[0]["shards"])
    for x, r in zip(xs, rs):
        ax.text(x + 0.2, r["deterministic"], "%.2fx" % r["ratio"], ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s")
    ax.set_title("the deterministic mode's cost")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out, "deterministic_cost.png")


def load_trace(paths):
    """Chrome trace files -> complete events ('X') and the flow events, one list each."""
    spans, flows, names = [], [], {}
    for p in paths:
        with open(p) as f:
            for e in json.load(f)["traceEvents"]:
                if e["ph"] == "X":
                    spans.append(e)
                elif e["ph"] in ("s", "f"):
                    flows.append(e)
                elif e["ph"] == "M" and e["name"] in ("process_name", "thread_name"):
                    names[(e["pid"], e["tid"] if e["name"] == "thread_name" else None)] = \
                        e["args"]["name"]
    return spans, flows, names


def nth_step(spans, index):
    """The window of the example's index-th step on every rank: from the first rank's start of
    its forward to the last rank's end of its optimizer step; None if there is no such step."""
    t0, t1 = [], []
    for pid in sorted({e["pid"] for e in spans}):
        mine = sorted((e for e in spans if e["pid"] == pid and e["cat"] == "compute"),
                      key=lambda e: e["ts"])
        fwd = [e for e in mine if e["name"] == "forward"]
        opt = [e for e in mine if e["name"] == "optimizer"]
        if len(fwd) <= index or len(opt) <= index:
            return None
        t0.append(fwd[index]["ts"])
        t1.append(opt[index]["ts"] + opt[index]["dur"])
    return (min(t0), max(t1)) if t0 else None


def plot_pipeline(data, out):
    schedules = [s for s in ("gpipe", "1f1b")
                 if glob.glob(os.path.join(data, "pipeline.%s.rank*.json" % s))]
    if not schedules:
        return
    fig, axes = plt.subplots(len(schedules), 1, figsize=(9, 1.2 + 1.2 * len(schedules)))
    for ax, sched in zip(axes if len(schedules) > 1 else [axes], schedules):
        spans, _, _ = load_trace(sorted(glob.glob(os.path.join(data, "pipeline.%s.rank*.json"
                                                               % sched))))
        stage_spans = [e for e in spans if e["cat"] in ("forward", "backward")]
        # Steps start at stage 0's forward of micro-batch 0 and end with the last span before
        # the next; drawn is the shortest, the one other work on the machine disturbed least.
        starts = sorted(e["ts"] for e in stage_spans if e["name"] == "forward 0" and e["pid"] == 0)
        steps = []
        for k, t0 in enumerate(starts):
            nxt = starts[k + 1] if k + 1 < len(starts) else float("inf")
            steps.append((max(e["ts"] + e["dur"] for e in stage_spans if t0 <= e["ts"] < nxt), t0))
        t1, t0 = min(steps, key=lambda w: w[0] - w[1])
        stages = sorted({e["pid"] for e in stage_spans})
        for e in stage_spans:
            if e["ts"] < t0 or e["ts"] > t1:
                continue
            y, x, w = stages.index(e["pid"]), (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), color=COLORS[e["cat"]], edgecolor="white")
            if w > (t1 - t0) / 1e3 / 60:  # "F2", "B0": the micro-batch, where it fits
                ax.text(x + w / 2, y, e["cat"][0].upper() + e["name"].split()[-1], ha="center",
                        va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(stages)))
        ax.set_yticklabels(["stage %d" % s for s in stages])
        ax.set_xlim(0, (t1 - t0) / 1e3)
        ax.set_title("%s, the shortest step (M = 4 micro-batches): the bubble is the white" %
                     ("GPipe" if sched == "gpipe" else "1F1B"), fontsize=10)
        ax.invert_yaxis()
    (axes[-1] if len(schedules) > 1 else axes).set_xlabel("ms")
    handles = [matplotlib.patches.Patch(color=COLORS[c], label=c) for c in ("forward", "backward")]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    save(fig, out, "pipeline_timeline.png")


def plot_torch_backend(data, out):
    rs = rows(data, "torch_backend")
    ar = medians([r for r in rs if r["bench"] == "torch_allreduce"], lambda r: r["bytes"],
                 ["gloo_busbw", "tandem_busbw", "tandem_over_gloo"])
    ddp_rows = [r for r in rs if r["bench"] == "torch_ddp"]
    fields = ["gloo_samples_per_s", "tandem_samples_per_s", "tandem_over_gloo"]
    if ddp_rows and all("nocomm_samples_per_s" in r for r in ddp_rows):
        fields += ["nocomm_samples_per_s", "nocomm_over_gloo"]
    ddp = medians(ddp_rows, lambda r: r["model"], fields)
    if not ar and not ddp:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    sizes = sorted(ar)
    a.plot(sizes, [ar[s]["tandem_busbw"] for s in sizes], "-o", label="over tandem")
    a.plot(sizes, [ar[s]["gloo_busbw"] for s in sizes], "--x", label="over gloo")
    a.plot(sizes, [2 * ar[s]["gloo_busbw"] for s in sizes], ":", color="#999999",
           label="2x gloo (the target from 64 KB)")
    for s in sizes:
        a.annotate("%.1fx" % ar[s]["tandem_over_gloo"], (s, ar[s]["tandem_busbw"]),
                   textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    top = max(ar[s]["tandem_busbw"] for s in sizes)
    a.set_ylim(top=top * 2.5)  # room for the ratios above the points
    a.set_xticks(sizes)
    a.set_xticklabels([size_label(s) for s in sizes], rotation=45)
    a.set_ylabel("bus bandwidth (GB/s)")
    a.set_title("torch.distributed.all_reduce, 2 ranks (medians of the runs)", fontsize=10)
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)
    # DDP as speed-up over gloo: the models' rates differ tenfold, their ratios do not.
    models = sorted(ddp)
    xs = range(len(models))
    bars = [("gloo", lambda m: 1.0, "#999999", "gloo_samples_per_s"),
            ("tandem", lambda m: ddp[m]["tandem_over_gloo"], "#1f77b4", "tandem_samples_per_s")]
    if "nocomm_over_gloo" in fields:
        bars.append(("no comm (ceiling)", lambda m: ddp[m]["nocomm_over_gloo"], "#cccccc",
                     "nocomm_samples_per_s"))
    width = 0.8 / len(bars)
    for i, (label, value, color, rate) in enumerate(bars):
        pos = [x + (i - (len(bars) - 1) / 2) * width for x in xs]
        b.bar(pos, [value(m) for m in models], width, label=label, color=color)
        for x, m in zip(pos, models):
            b.text(x, value(m), "%.2fx\n%.0f/s" % (value(m), ddp[m][rate]), ha="center",
                   va="bottom", fontsize=6)
    b.axhline(1.5, color="k", ls=":", lw=0.8, label="1.5x (the target)")
    b.set_ylim(0, max(1.7, max(v(m) for _, v, _, _ in bars for m in models)) * 1.45)
    b.set_xticks(list(xs))
    b.set_xticklabels(models)
    b.set_ylabel("samples/s over gloo's")
    b.set_title("PyTorch DDP, 2 ranks, batch 128", fontsize=10)
    b.grid(True, axis="y", alpha=0.3)
    b.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    save(fig, out, "torch_backend.png")


def plot_job_trace(data, out):
    path = os.path.join(data, "job_trace.json")
    if not os.path.exists(path):
        return
    spans, flows, names = load_trace([path])
    window = nth_step(spans, 2)  # the example's third step
    if not window:
        return
    t0, t1 = window
    rows_ = sorted({(e["pid"], e["tid"]) for e in spans if t0 <= e["ts"] <= t1})
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(rows_)))
    for e in spans:
        if not (t0 <= e["ts"] <= t1) or e["name"] in ("forward", "backward"):
            continue  # the example's forward/backward spans hold the graph's op spans
        y = rows_.index((e["pid"], e["tid"]))
        ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1) / 1e3)], (y, 0.8),
                       color=COLORS.get(e["cat"], "#999999"), edgecolor="white", linewidth=0.3)
    starts = {f["id"]: f for f in flows if f["ph"] == "s"}
    for f in flows:
        s = starts.get(f["id"])
        if f["ph"] != "f" or not s or not (t0 <= s["ts"] <= t1):
            continue
        ys, yf = rows_.index((s["pid"], s["tid"])), rows_.index((f["pid"], f["tid"]))
        ax.annotate("", xy=((f["ts"] - t0) / 1e3, yf + 0.4), xytext=((s["ts"] - t0) / 1e3,
                    ys + 0.4), arrowprops={"arrowstyle": "->", "color": "k", "lw": 0.7})
    ax.set_yticks([i + 0.4 for i in range(len(rows_))])
    ax.set_yticklabels(["%s: %s" % (names.get((p, None), "rank %d" % p).split(" (")[0],
                                    names.get((p, t), "thread %d" % t)) for p, t in rows_],
                       fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [matplotlib.patches.Patch(color=COLORS[c], label=c)
               for c in ("forward", "backward", "comm", "ddp", "compute")]
    ax.legend(handles=handles, fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0),
              frameon=False)
    fig.suptitle("one step of the Net on 2 ranks (tandemrun --trace --trace-ops; each op a span); "
                 "arrows: from each collective's last arrival", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    save(fig, out, "job_trace.png")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    p.add_argument("--run", action="store_true", help="run the benchmarks into --data first")
    p.add_argument("--only", default="", help="with --run: these benchmarks alone (" +
                   ", ".join([n for n, _ in RUNS] + ["job_trace"]) + ")")
    args = p.parse_args()
    os.makedirs(args.data, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    failed = run_benchmarks(args.data, [o for o in args.only.split(",") if o]) if args.run else []
    for plot in (plot_allreduce, plot_multihost, plot_ddp_scaling, plot_amp, plot_deterministic,
                 plot_pipeline, plot_torch_backend, plot_job_trace):
        plot(args.data, args.out)
    if args.data == os.path.join(ROOT, "docs", "data"):
        # The docs' tables of these numbers, from the same data as the figures.
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "doc_tables.py")], check=True)
    if failed:
        print("plots: these benchmarks failed and kept their earlier data: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
