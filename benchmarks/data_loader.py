"""Memory and speed of `dilocox prepare-data` and of the per-rank loaders: prepared (memory-mapped) vs in-RAM.

    python benchmarks/data_loader.py                                  # 32 MB and 320 MB corpora, 2 and 4 shards
    python benchmarks/data_loader.py --sizes-mb 8,64 --in-ram-mb 8    # a quicker look
    python benchmarks/data_loader.py --out benchmarks/results/data_loader

Generates a deterministic corpus of random words (a fixed 20,000-word vocabulary with Zipf frequencies, lines of 12
words, documents of 200-2,000 words, .jsonl files of 16 MB) in a temporary directory; the smaller sizes are the
first files of the largest. For each size it runs the real `dilocox prepare-data` (1 tokenizer thread) and
measures its peak RSS and time, then starts 2 and 4 "rank" processes at once, each opening the prepared directory as
the trainer does (`prepare_tokens(path=DIR)`) and pulling `--batches` mixed-shard batches of 16 x 256 tokens. The
in-RAM path (`data.path` = the text files: tokenized once into the cache, then each rank loads the whole train
array) is measured on the smallest size only; tokenizing the large corpus in memory would take several GB.

Per rank: RSS after `import dilocox` and torch (the baseline), peak RSS (VmHWM), and loader tokens/s. A prepared
directory's pages are mapped only while a batch is read, so they do not stay in a rank's RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FILE_BYTES = 16 << 20
SEQ_LEN, BATCH = 256, 16


def generate_corpus(directory: Path, total_mb: int, seed: int = 0) -> list[Path]:
    """jsonl files of ~16 MB of random-word documents, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    letter_p = np.linspace(2.0, 0.2, len(letters))
    letter_p /= letter_p.sum()
    vocabulary = np.array(["".join(rng.choice(letters, size=rng.integers(2, 10), p=letter_p)) for _ in range(20_000)])
    word_p = 1.0 / np.arange(1, len(vocabulary) + 1)
    word_p /= word_p.sum()
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for index in range(max(1, total_mb * (1 << 20) // FILE_BYTES)):
        file = directory / f"part-{index:04d}.jsonl"
        written = 0
        with open(file, "w", encoding="utf-8") as handle:
            while written < FILE_BYTES:
                words = vocabulary[rng.choice(len(vocabulary), size=int(rng.integers(200, 2_000)), p=word_p)]
                text = "\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12))
                line = json.dumps({"text": text}) + "\n"
                handle.write(line)
                written += len(line)
        files.append(file)
    return files


def run_measured(command: list[str], env: dict[str, str]) -> dict:
    """Run ``command``; its wall time, CPU time and peak RSS (from wait4, for exactly this process), and stdout."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr = process.stderr.read()
        out.seek(0)
        stdout = out.read()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{stderr[-3000:]}")
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "stdout": stdout,
    }


def run_ranks(source: str, num_shards: int, batches: int, env: dict[str, str], extra: list[str]) -> list[dict]:
    """``num_shards`` loader processes at once, as the ranks of a run; each reports its measurements as JSON."""
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-worker", source, str(index), str(num_shards), str(batches), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for index in range(num_shards)
    ]
    reports = []
    for process in processes:
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"rank worker failed:\n{stderr[-3000:]}")
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return reports


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rank_worker(source: str, shard_index: int, num_shards: int, batches: int, vocab_size: int) -> None:
    """One rank: open the data as the trainer does, pull batches, print a JSON line of measurements."""
    import torch

    from dilocox.data import ShardedTokenStream, prepare_tokens

    torch.set_num_threads(1)
    baseline = _status_mb("VmRSS")
    start = time.perf_counter()
    data = prepare_tokens(path=source, vocab_size=vocab_size)
    open_s = time.perf_counter() - start
    stream = ShardedTokenStream(
        data.train, seq_len=SEQ_LEN, batch_size=BATCH, shard_index=shard_index, num_shards=num_shards, seed=0
    )
    stream.next_batch()
    start = time.perf_counter()
    for _ in range(batches):
        inputs, targets = stream.next_batch()
    elapsed = time.perf_counter() - start
    report = {
        "baseline_rss_mb": baseline,
        "peak_rss_mb": _status_mb("VmHWM"),
        "rss_anon_mb": _status_mb("RssAnon"),
        "rss_file_mb": _status_mb("RssFile"),
        "open_s": open_s,
        "tokens_per_s": batches * BATCH * SEQ_LEN / elapsed,
        "train_tokens": len(data.train),
        "shard_windows": stream.num_windows,
    }
    print(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="32,320", help="corpus sizes, comma-separated; the last is generated")
    parser.add_argument("--in-ram-mb", type=int, default=32, help="the size the in-RAM path is measured at")
    parser.add_argument("--shards", default="2,4")
    parser.add_argument("--batches", type=int, default=1000, help="batches of 16 x 256 tokens each rank pulls")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", default="", help="directory for results.json and results.md")
    parser.add_argument("--rank-worker", nargs=4, metavar=("SOURCE", "SHARD", "NUM_SHARDS", "BATCHES"))
    args = parser.parse_args()
    if args.rank_worker:
        source, shard_index, num_shards, batches = args.rank_worker
        rank_worker(source, int(shard_index), int(num_shards), int(batches), args.vocab_size)
        return

    sizes = sorted(int(size) for size in args.sizes_mb.split(","))
    shard_counts = [int(n) for n in args.shards.split(",")]
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="dilocox-data-bench-") as tmp:
        root = Path(tmp)
        # One tokenizer thread: the machine is shared; the CPU seconds are what a wider machine divides.
        env = {**os.environ, "PYTHONPATH": str(repo), "RAYON_NUM_THREADS": "1", "DILOCOX_CACHE": str(root / "cache")}
        start = time.perf_counter()
        files = generate_corpus(root / "corpus", sizes[-1])
        print(f"generated {sizes[-1]} MB in {len(files)} files ({time.perf_counter() - start:.0f} s)", flush=True)
        rows: list[dict] = []
        for size in sizes:
            subset = root / f"corpus-{size}mb"
            subset.mkdir()
            for file in files[: max(1, size * (1 << 20) // FILE_BYTES)]:
                (subset / file.name).symlink_to(file)
            corpus_mb = sum(f.stat().st_size for f in subset.iterdir()) / 1e6
            prepared = root / f"prepared-{size}mb"
            command = [sys.executable, "-m", "dilocox", "prepare-data", str(subset), "--out", str(prepared)]
            result = run_measured([*command, "--vocab-size", str(args.vocab_size)], env)
            index = json.loads((prepared / "dilocox-index.json").read_text())
            row = {
                "path": "prepare-data",
                "corpus_mb": corpus_mb,
                "train_tokens": index["num_tokens"]["train"],
                "token_files_mb": sum(
                    (prepared / f["file"]).stat().st_size for s in ("train", "val") for f in index["files"][s]
                )
                / 1e6,
                **{k: result[k] for k in ("wall_s", "cpu_s", "peak_rss_mb")},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            for num_shards in shard_counts:
                for report in run_ranks(str(prepared), num_shards, args.batches, env, []):
                    rows.append({"path": "prepared rank", "corpus_mb": corpus_mb, "num_shards": num_shards, **report})
                    print(json.dumps(rows[-1]), flush=True)
            if size == args.in_ram_mb:
                code = (
                    "from dilocox.data import prepare_tokens; "
                    f"prepare_tokens(path={str(subset)!r}, vocab_size={args.vocab_size})"
                )
                result = run_measured([sys.executable, "-c", code], env)
                rows.append(
                    {"path": "in-RAM tokenize (cold)", "corpus_mb": corpus_mb}
                    | {k: result[k] for k in ("wall_s", "cpu_s", "peak_rss_mb")}
                )
                print(json.dumps(rows[-1]), flush=True)
                for num_shards in shard_counts:
                    for report in run_ranks(str(subset), num_shards, args.batches, env, []):
                        rows.append({"path": "in-RAM rank", "corpus_mb": corpus_mb, "num_shards": num_shards, **report})
                        print(json.dumps(rows[-1]), flush=True)

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), {platform.platform()}",
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "batch": f"{BATCH} x {SEQ_LEN} tokens, mixed shards, {args.batches} batches per rank",
        "vocab_size": args.vocab_size,
    }
    table = format_table(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (out / "results.md").write_text(format_report(meta, table))


def format_report(meta: dict, table: str) -> str:
    load = ", ".join(f"{value:.1f}" for value in meta["load_average"])
    return (
        f"# Data loaders: `benchmarks/data_loader.py`, {meta['date']}\n\n"
        f"{meta['machine']}, Python {meta['python']}, load average at the end {load} (other work shared the "
        f"cores). Rank processes pull {meta['batch']}; vocabulary {meta['vocab_size']}; tokenization on 1 thread. "
        f"Peak RSS is VmHWM (wait4 for prepare-data); 'above baseline' is a rank's peak minus its RSS after "
        f"importing torch and dilocox, before opening the data.\n\n{table}\n"
    )


def format_table(rows: list[dict]) -> str:
    lines = [
        "| path | corpus | shards | train tokens | peak RSS per process | above baseline | time / loader speed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        corpus = f"{row['corpus_mb']:.0f} MB"
        if "num_shards" in row:
            rank_rows = [r for r in rows if r["path"] == row["path"] and r["corpus_mb"] == row["corpus_mb"]]
            group = [r for r in rank_rows if r["num_shards"] == row["num_shards"]]
            if row is not group[0]:
                continue
            peak = max(r["peak_rss_mb"] for r in group)
            above = max(r["peak_rss_mb"] - r["baseline_rss_mb"] for r in group)
            speed = sum(r["tokens_per_s"] for r in group)
            lines.append(
                f"| {row['path']} | {corpus} | {row['num_shards']} | {row['train_tokens']:,} | {peak:.0f} MB (max of "
                f"{len(group)}) | {above:.1f} MB | {speed / 1e6:.2f} M tokens/s all ranks, "
                f"{min(r['tokens_per_s'] for r in group) / 1e6:.2f} M slowest rank |"
            )
        else:
            tokens = f"{row['train_tokens']:,}" if "train_tokens" in row else "-"
            lines.append(
                f"| {row['path']} | {corpus} | - | {tokens} | {row['peak_rss_mb']:.0f} MB | - | {row['wall_s']:.0f} s "
                f"wall, {row['cpu_s']:.0f} s CPU ({row['corpus_mb'] / row['cpu_s']:.2f} MB/CPU-s) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
