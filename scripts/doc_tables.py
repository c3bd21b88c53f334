"""The docs' tables of measured numbers, made from the data the benchmarks kept in docs/data/
(the same data scripts/plots.py draws the figures beside them from), so that a table, its
figure and the data cannot disagree. A table sits in its page between two lines,

    <!-- table NAME: made by scripts/doc_tables.py from docs/data/..., do not edit -->
    ...
    <!-- end table NAME -->

and is written whole, with the line saying which runs it comes from: the command, the load
average when it started and the CPU it ran on (scripts/plots.py records both beside the data).
A NAME may also be a sentence of numbers that prose quotes (the torch backend's summary).

    /usr/bin/python3 scripts/doc_tables.py           # rewrites the docs' tables from docs/data
    /usr/bin/python3 scripts/doc_tables.py --check   # exit 1 naming each table that differs

Needs nothing but Python's standard library; scripts/plots.py runs it after drawing, and
tests/test_docs.c runs --check in the suite."""
import argparse
import json
import os
import re
import statistics
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DATA = os.path.join(ROOT, "docs", "data")


def rows(name):
    with open(os.path.join(DATA, name + ".jsonl")) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def runs(name):
    """The commands that made docs/data/NAME.jsonl, from its .txt: [(command, load, cpu)]. The
    CPU is the one scripts/plots.py noted beside the command, or else the one the benchmark's
    own heading names (bench_cpu_name's "NAME (family F model M; features)")."""
    out = []
    with open(os.path.join(DATA, name + ".txt")) as f:
        for line in f:
            line = line.rstrip()
            m = re.match(r"\$ (.*?)   \(load average ([0-9. ]+?)(?:; CPU (.*))?\)$", line)
            if m:
                out.append([m.group(1), m.group(2), m.group(3)])
            elif out and not out[-1][2] and re.search(r"\(family \S+ model \S+;", line):
                out[-1][2] = line
    return out


def provenance(name):
    """Which runs a table comes from, in words."""
    rs = runs(name)
    if not rs:
        return "(no record of the runs in docs/data/%s.txt)" % name
    cmds = sorted(set(r[0] for r in rs))
    cpus = sorted(set(r[2] or "not recorded" for r in rs))
    loads = ", ".join(r[1].split()[0] for r in rs)
    times = "%d runs of " % len(rs) if len(rs) > 1 else ""
    return "%s`%s` (load average %s at the start%s; CPU: %s)" % (
        times, "`, `".join(cmds), loads, " of each" if len(rs) > 1 else "", "; ".join(cpus))


def size_label(nbytes):
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return "%d %s" % (nbytes // div, unit)
    return "%d B" % nbytes


def num(x):
    """Three significant digits, as the tables have always shown bandwidths."""
    if x >= 100:
        return "%.0f" % x
    return ("%.3g" % x) if x >= 0.01 else ("%.2g" % x)


def ratio(x):
    return "%.2fx" % x


def grouped(rs, key):
    groups = {}
    for r in rs:
        groups.setdefault(key(r), []).append(r)
    return groups


def median(group, field):
    return statistics.median(r[field] for r in group)


def runs_list(group, field):
    return ", ".join("%.2f" % r[field] for r in group)


# ---- the tables ----------------------------------------------------------------------------


def torch_allreduce():
    ar = grouped([r for r in rows("torch_backend") if r["bench"] == "torch_allreduce"],
                 lambda r: r["bytes"])
    out = ["From %s." % provenance("torch_backend"), "",
           "| all_reduce, f32 sum | gloo (us) | gloo busbw (GB/s) | tandem (us) | tandem busbw "
           "(GB/s) | tandem / gloo (runs) |",
           "|---:|---:|---:|---:|---:|---:|"]
    for size in sorted(ar):
        g = ar[size]
        out.append("| %s | %s | %s | %s | %s | %s (%s) |" % (
            size_label(size), num(median(g, "gloo_us")), num(median(g, "gloo_busbw")),
            num(median(g, "tandem_us")), num(median(g, "tandem_busbw")),
            ratio(median(g, "tandem_over_gloo")), runs_list(g, "tandem_over_gloo")))
    return out


def torch_ddp():
    ddp = grouped([r for r in rows("torch_backend") if r["bench"] == "torch_ddp"],
                  lambda r: r["model"])
    out = ["| DDP, global batch 128 | gloo (samples/s) | tandem | no comm (ceiling) | "
           "tandem / gloo (runs) | ceiling / gloo (runs) |",
           "|---|---:|---:|---:|---|---|"]
    for model in sorted(ddp, key=lambda m: (m != "cnn", m)):
        g = ddp[model]
        out.append("| %s | %s | %s | %s | %s (%s) | %s (%s) |" % (
            model.upper(), num(median(g, "gloo_samples_per_s")),
            num(median(g, "tandem_samples_per_s")), num(median(g, "nocomm_samples_per_s")),
            ratio(median(g, "tandem_over_gloo")), runs_list(g, "tandem_over_gloo"),
            ratio(median(g, "nocomm_over_gloo")), runs_list(g, "nocomm_over_gloo")))
    return out


def torch_summary():
    """The sentence the README and docs/torch.md quote: the ranges of the medians."""
    rs = rows("torch_backend")
    ar = grouped([r for r in rs if r["bench"] == "torch_allreduce"], lambda r: r["bytes"])
    ddp = grouped([r for r in rs if r["bench"] == "torch_ddp"], lambda r: r["model"])
    meds = [median(g, "tandem_over_gloo") for g in ar.values()]
    worst = min(r["tandem_over_gloo"] for g in ar.values() for r in g)
    cnn, mlp = ddp["cnn"], ddp["mlp"]
    return ["`torch.distributed.all_reduce` over tandem runs %.1fx to %.1fx as fast as over gloo "
            "(medians of the runs, %s to %s; every single run at least %.1fx), and PyTorch's DDP "
            "%s (the CNN) and %s (the MLP) gloo's speed, where training with no communication "
            "at all reaches %s and %s." % (
                min(meds), max(meds), size_label(min(ar)), size_label(max(ar)), worst,
                ratio(median(cnn, "tandem_over_gloo")), ratio(median(mlp, "tandem_over_gloo")),
                ratio(median(cnn, "nocomm_over_gloo")), ratio(median(mlp, "nocomm_over_gloo")))]


def allreduce():
    shm = {r["bytes"]: r for r in rows("allreduce") if r.get("bench") == "allreduce"}
    torch = grouped([r for r in rows("torch_backend") if r["bench"] == "torch_allreduce"],
                    lambda r: r["bytes"])
    out = ["From %s, and %s; bus bandwidth in GB/s, medians." % (
        provenance("allreduce"), provenance("torch_backend")), "",
           "| size | shm | shm-reg | mpi backend | MPI_Allreduce | torch over tandem | torch over "
           "gloo |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sorted(set(shm) | set(torch)):
        cells = [num(shm[size][k + "_busbw"]) if size in shm else ""
                 for k in ("shm", "shm-reg", "mpi-backend", "MPI_Allreduce")]
        cells += [num(median(torch[size], k)) if size in torch else ""
                  for k in ("tandem_busbw", "gloo_busbw")]
        out.append("| %s | %s |" % (size_label(size), " | ".join(cells)))
    return out


def train():
    rs = [r for r in rows("train") if "comm" in r]
    names = {"net": "Net", "mlp": "MLP", "cnn": "CNN", "resnet": "ResNet"}
    out = ["From %s; each cell the median of the windows, medians over the repeats." %
           provenance("train"), "",
           "| model | precision | world | tandem samples/s | PyTorch samples/s | tandem / PyTorch | "
           "vs f32 | world 2 / world 1 |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rs:
        world = "1" if r["world"] == 1 else "%d (DDP)" % r["world"] if r["comm"] else \
            "%d, no comm" % r["world"]
        out.append("| %s | %s | %s | %.0f | %s | %s | %s | %s |" % (
            names.get(r["model"], r["model"]), r["amp"], world, r["tandem"],
            "%.0f" % r["pytorch"] if r["pytorch"] > 0 else "",
            ratio(r["tandem"] / r["pytorch"]) if r["pytorch"] > 0 else "",
            ratio(r["vs_f32"]) if r["vs_f32"] > 0 else "",
            ratio(r["scaling"]) if r["scaling"] > 0 else ""))
    return out


def torch_targets():
    """What the targets (all-reduce 2x gloo from 64 KB, DDP 1.5x) come to in this data."""
    rs = rows("torch_backend")
    ar = grouped([r for r in rs if r["bench"] == "torch_allreduce"], lambda r: r["bytes"])
    ddp = grouped([r for r in rs if r["bench"] == "torch_ddp"], lambda r: r["model"])
    short = [size_label(b) for b in sorted(ar) if median(ar[b], "tandem_over_gloo") < 2]
    allreduce = ("meets the 2x target at every size" if not short else
                 "misses the 2x target at %s" % ", ".join(short))
    met = [m.upper() for m in sorted(ddp) if median(ddp[m], "tandem_over_gloo") >= 1.5]
    ceiling = max(median(g, "nocomm_over_gloo") for g in ddp.values())
    if met:
        ddp_words = "DDP meets the 1.5x target for the %s" % " and the ".join(met)
    elif ceiling < 1.5:
        ddp_words = ("DDP does not meet the 1.5x target, and on this machine no backend could: "
                     "training the halves with no communication at all is at most %s gloo's "
                     "DDP, so even a free all-reduce would stop there" % ratio(ceiling))
    else:
        ddp_words = "DDP does not meet the 1.5x target, below a ceiling of %s" % ratio(ceiling)
    return ["`torch.distributed.all_reduce` over tandem %s (medians of the runs). %s." % (
        allreduce, ddp_words)]


TABLES = {
    "allreduce": ("README.md", allreduce, "allreduce, torch_backend"),
    "train": ("README.md", train, "train"),
    "torch_summary": ("README.md docs/torch.md", torch_summary, "torch_backend"),
    "torch_allreduce": ("docs/torch.md", torch_allreduce, "torch_backend"),
    "torch_ddp": ("docs/torch.md", torch_ddp, "torch_backend"),
    "torch_targets": ("docs/torch.md", torch_targets, "torch_backend"),
}


def begin(name):
    return "<!-- table %s: made by scripts/doc_tables.py from docs/data/%s, do not edit -->" % (
        name, TABLES[name][2])


def end(name):
    return "<!-- end table %s -->" % name


def rewrite(text, name, lines, page):
    """text with the table `name` replaced by `lines`; an error when the page lacks it."""
    pattern = re.compile(r"<!-- table %s:[^\n]*-->\n(?:.*?\n)?<!-- end table %s -->" % (name, name),
                         re.S)
    if not pattern.search(text):
        raise SystemExit("%s has no table %s (%s ... %s)" % (page, name, begin(name), end(name)))
    block = "\n".join([begin(name)] + lines + [end(name)])
    return pattern.sub(lambda m: block, text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = p.parse_args()
    pages, changed, differ = {}, set(), []
    for name, (where, make, _) in TABLES.items():
        lines = make()
        for page in where.split():
            if page not in pages:
                with open(os.path.join(ROOT, page)) as f:
                    pages[page] = f.read()
            new = rewrite(pages[page], name, lines, page)
            if new != pages[page]:
                differ.append("%s: table %s differs from docs/data" % (page, name))
                pages[page] = new
                changed.add(page)
    if args.check:
        for line in differ:
            print(line)
        print("%d table(s) checked, %d differ%s" % (
            sum(len(w.split()) for w, _, _ in TABLES.values()), len(differ),
            " (/usr/bin/python3 scripts/doc_tables.py rewrites them)" if differ else ""))
        return 1 if differ else 0
    for page in sorted(changed):
        with open(os.path.join(ROOT, page), "w") as f:
            f.write(pages[page])
        print("rewrote the tables of %s" % page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
