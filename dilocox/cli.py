"""The `dilocox` command: train, eval, prepare-data, bench, plan, linkcheck, flavors, env.

    dilocox train                                   # the embedded default: 2 clusters over an emulated 1 Gbps link
    dilocox train --config configs/debug.toml --sync.kind=allreduce
    dilocox eval runs/dilocox --json

User errors end with one `dilocox: error: ...` line and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import platform
import sys
import textwrap
from pathlib import Path

USAGE = """usage: dilocox <command> [options]

commands:
  train     train a model across emulated (or real, under torchrun) clusters
  eval      evaluate a run's latest checkpoint on its validation split or on any text
  prepare-data  tokenize a large corpus once into memory-mapped token files (then --data.path=DIR)
  bench     run strategies side by side on one setting: table, results.json, plots
  plan      project tokens/s of AllReduce, DiLoCo and DiLoCoX at sizes this machine cannot run
  linkcheck time real transfers over a Linux link shaped with tc against the emulated link (root only)
  flavors   list the model flavors and their parameter counts
  env       print versions of dilocox, torch and the platform (for bug reports)

`dilocox <command> --help` describes a command."""


def _error(message: str) -> int:
    print(f"dilocox: error: {message}", file=sys.stderr)
    return 2


def train_help() -> str:
    from dilocox.config import options

    lines = [
        "usage: dilocox train [--config FILE] [--section.key=VALUE ...]",
        "",
        "Train a model. Options come from the defaults below, then the TOML file of --config, then these flags.",
        "Run as it is, it starts num_clusters x dp_degree x pp_degree ranks on this machine; under torchrun",
        "(RANK, WORLD_SIZE, MASTER_ADDR set) it runs as the one rank torchrun gave it.",
        "",
        "  --config FILE   a TOML file with sections like [train] and [sync] (see configs/)",
    ]
    section = None
    for name, typ, default, doc in options():
        head = name.split(".")[0]
        if head != section:
            section = head
            lines += ["", f"[{section}]"]
        shown = (
            json.dumps(default)
            if isinstance(default, str)
            else str(default).lower()
            if isinstance(default, bool)
            else default
        )
        lines.append(f"  --{name}={typ.__name__.upper()}  (default {shown})")
        lines += textwrap.wrap(doc, width=110, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def cmd_train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(train_help())
        return 0
    config_path = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                return _error("--config needs a file: --config FILE")
            config_path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1

    from dilocox.config import load_config
    from dilocox.launch import launch_local, launch_torchrun, preflight, prepare_run_dir, under_torchrun

    try:
        cfg = load_config(config_path, rest)
        if under_torchrun():
            return launch_torchrun(cfg)
        data, resume = preflight(cfg)
        prepare_run_dir(cfg, data, resume)
    except ValueError as exc:
        return _error(str(exc))
    return launch_local(cfg, data, resume)


EVAL_USAGE = """usage: dilocox eval RUN_DIR [--data.path PATH] [--checkpoint DIR] [--max-batches N] [--json]

Load the newest complete checkpoint of RUN_DIR (or --checkpoint DIR) with the run's tokenizer and print the mean
token loss and perplexity on the run's validation split, or on the text at --data.path (.txt/.md/.jsonl/.parquet,
a directory or a glob)."""


def cmd_eval(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="dilocox eval", usage=EVAL_USAGE, add_help=False)
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--data.path", dest="data_path", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--max-batches", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    args, unknown = parser.parse_known_args(argv)
    if args.help:
        print(EVAL_USAGE)
        return 0
    if unknown:
        return _error(f"unknown option(s) for eval: {' '.join(unknown)}\n{EVAL_USAGE}")
    if not args.run_dir:
        return _error(f"eval needs a run directory\n{EVAL_USAGE}")
    from dilocox.evaluate import evaluate_run

    try:
        result = evaluate_run(
            Path(args.run_dir), data_path=args.data_path, checkpoint=args.checkpoint, max_batches=args.max_batches
        )
    except ValueError as exc:
        return _error(str(exc))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['source']}: loss {result['loss']:.4f}  perplexity {result['perplexity']:,.2f}  "
            f"({result['tokens']:,} tokens, checkpoint step {result['step']})"
        )
    return 0


PREPARE_USAGE = """usage: dilocox prepare-data SRC --out DIR [--tokenizer PATH] [--vocab-size N] [--val-fraction F]
                            [--text-field F] [--seed N] [--reader auto|files|datasets] [--tokens-per-file N]
                            [--overwrite]

Tokenize SRC once, streaming (.txt/.md/.jsonl/.parquet files, a directory or a glob, as --data.path takes them;
or a Hugging Face `save_to_disk` directory), into DIR: tokenizer.json, train-*.bin and val-*.bin (raw uint16 ids,
uint32 above 65,536 ids) and dilocox-index.json. Without --tokenizer a byte-level BPE of --vocab-size (default
2048) is trained on at most 32 Mi characters of training text. --val-fraction (default 0.05) of the documents and
--seed (default 0) fix the split. --reader=datasets streams the files through Hugging Face datasets (pip install
'dilocox[datasets]'); --tokens-per-file (default 268,435,456) sizes the .bin files; --overwrite replaces earlier
prepared data in DIR. Then train with --data.path=DIR: each rank reads only its windows."""


def cmd_prepare_data(argv: list[str]) -> int:
    import argparse

    from dilocox.data.prepare import TOKENS_PER_FILE, prepare_dataset

    parser = argparse.ArgumentParser(prog="dilocox prepare-data", usage=PREPARE_USAGE, add_help=False)

    def refuse(message: str):
        raise ValueError(f"prepare-data: {message}")

    parser.error = refuse  # one `dilocox: error:` line, not argparse's usage dump and exit
    parser.add_argument("source", nargs="?")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokenizer", default="")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reader", default="auto")
    parser.add_argument("--tokens-per-file", type=int, default=TOKENS_PER_FILE)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    try:
        args, unknown = parser.parse_known_args(argv)
    except ValueError as exc:
        return _error(str(exc))
    if args.help:
        print(PREPARE_USAGE)
        return 0
    if unknown:
        return _error(f"unknown option(s) for prepare-data: {' '.join(unknown)}\n{PREPARE_USAGE}")
    if args.source is None or not args.out:
        return _error(f"prepare-data needs SRC and --out DIR\n{PREPARE_USAGE}")
    try:
        index = prepare_dataset(
            args.source,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            text_field=args.text_field,
            seed=args.seed,
            overwrite=args.overwrite,
            reader=args.reader,
            tokens_per_file=args.tokens_per_file,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
    except ValueError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"--out {args.out}: {exc.strerror or exc} ({exc.filename}); choose a writable --out")
    tokens, documents = index["num_tokens"], index["num_documents"]
    print(
        f"{args.out}: {tokens['train']:,} train tokens ({documents['train']:,} documents, "
        f"{len(index['files']['train'])} files), {tokens['val']:,} validation tokens ({documents['val']:,} "
        f"documents), {index['dtype']}, vocabulary {index['vocab_size']:,}; train with --data.path={args.out}"
    )
    return 0


def cmd_flavors(argv: list[str]) -> int:
    from dilocox.models import count_parameters, list_flavors, model_args

    print(f"{'flavor':<16}{'layers':>7}{'dim':>7}{'heads':>7}{'kv':>5}{'ffn':>8}{'vocab':>9}{'params':>16}")
    for name in list_flavors():
        args = model_args(name, vocab_size=2048)
        print(
            f"{name:<16}{args.num_layers:>7}{args.dim:>7}{args.num_heads:>7}{args.num_kv_heads:>5}{args.ffn_dim:>8}"
            f"{args.vocab_size:>9}{count_parameters(args):>16,}"
        )
    print("(small flavors take the tokenizer's vocabulary; 2048 shown, the default BPE)")
    return 0


def cmd_env(argv: list[str]) -> int:
    import torch

    import dilocox

    print(f"dilocox {dilocox.__version__}")
    print(f"python {platform.python_version()} ({sys.executable})")
    print(
        f"torch {torch.__version__}  cuda: {torch.cuda.is_available()}  gloo: {torch.distributed.is_gloo_available()}"
        f"  nccl: {torch.distributed.is_nccl_available()}"
    )
    from dilocox.device import describe, resolve_device

    for index in range(torch.cuda.device_count()):
        print(f"gpu {index}: {describe(torch.device('cuda', index))}")
    print(f"run.device = auto would use {describe(resolve_device('auto', local_rank=0))} for local rank 0")
    print(f"platform {platform.platform()}  cpus {__import__('os').cpu_count()}")
    return 0


def cmd_bench(argv: list[str]) -> int:
    from dilocox.tools.bench.bench_cli import main as bench_main

    return bench_main(argv)


def cmd_plan(argv: list[str]) -> int:
    from dilocox.tools.bench.plan_cli import main as plan_main

    return plan_main(argv)


def cmd_linkcheck(argv: list[str]) -> int:
    from dilocox.tools.linkcheck.cli import main as linkcheck_main

    return linkcheck_main(argv)


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "prepare-data": cmd_prepare_data,
    "bench": cmd_bench,
    "plan": cmd_plan,
    "linkcheck": cmd_linkcheck,
    "flavors": cmd_flavors,
    "env": cmd_env,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        return _error(f"unknown command {argv[0]!r}\n{USAGE}")
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
