"""The `dilocox` command: train, eval, export, plot, prepare-data, bench, plan, linkcheck, lighthouse, flavors, env.

    dilocox train                                   # DiLoCoX (the dilocox preset): 2 clusters, an emulated 1 Gbps link
    dilocox train --preset allreduce                # a baseline on the same setting
    dilocox train --config configs/debug.toml --sync.kind=allreduce --print-config
    dilocox train --preset diloco --help            # every option with the value this run would use
    dilocox eval runs/dilocox --json
    dilocox export runs/dilocox --format hf --out hf/dilocox

User errors end with one `dilocox: error: ...` line and exit code 2, never a traceback. Output piped into a reader
that stops early (`dilocox flavors | head -1`) ends the command quietly.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import textwrap
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from dilocox.config import Config

USAGE = """usage: dilocox <command> [options]

commands:
  train     train a model across emulated (or real, under torchrun) clusters
  eval      evaluate a run's latest checkpoint on its validation split or on any text
  export    write a run's checkpoint as a Hugging Face model directory (transformers loads it)
  plot      plot runs side by side from their metrics.jsonl: loss, slow-link bytes, hidden link time, rank and H
  prepare-data  tokenize a large corpus once into memory-mapped token files (then --data.path=DIR)
  bench     run strategies side by side on one setting: table, results.json, plots
  plan      project tokens/s of AllReduce, DiLoCo and DiLoCoX at sizes this machine cannot run
  linkcheck time real transfers over a Linux link shaped with tc against the emulated link (root only)
  lighthouse  run the torchft Lighthouse where the machines of an elastic run meet
  flavors   list the model flavors and their parameter counts
  env       print versions of dilocox, torch and the platform (for bug reports)

`dilocox <command> --help` describes a command."""


def _error(message: str) -> int:
    print(f"dilocox: error: {message}", file=sys.stderr)
    return 2


def _show_value(value: object) -> str:
    """A value as a TOML file writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)


def train_help(argv: list[str] | None = None) -> str:
    """`dilocox train --help`: every option with the value `dilocox train ARGV` runs with (ARGV without --help: the
    default preset's values, resolved), where it comes from (the preset, auto and its rule), and the presets."""
    from dilocox.config import (
        AUTO,
        PRESETS,
        allowed_values,
        auto_options,
        flat_settings,
        layered_config,
        options,
        preset_summary,
        read_preset,
        to_dict,
    )

    config_path, rest = _take_option([a for a in (argv or []) if a not in ("-h", "--help")], "--config")
    unresolved, preset, layers = layered_config(config_path, rest)
    before, values = flat_settings(to_dict(unresolved)), flat_settings(to_dict(unresolved.resolve()))
    lines = [
        "usage: dilocox train [--preset NAME] [--config FILE] [--section.key=VALUE ...] [--print-config]",
        "",
        "Train a model. Settings come in layers, each overriding the one before: the field defaults, then a preset,",
        "then the TOML file of --config, then the --section.key flags. Every run starts from a preset: --preset NAME,",
        "or a --config file's top-level preset = \"NAME\", else dilocox. A kind is its preset's identity: a",
        "sync.kind that differs from the preset's runs that kind's own preset (sync.kind diloco runs what --preset",
        "diloco runs). An option that follows from others is auto until the layers are read, then set by the rule",
        "its line states; a value you set is kept. Pairs of options that do not work together are refused in one",
        "line before anything runs (docs/reference/configuration.md). Run as it is, it starts num_clusters x",
        "dp_degree x pp_degree ranks on this machine; under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) it runs as",
        "the one rank torchrun gave it.",
        "",
        f"  --preset NAME   start from a shipped preset (below): {', '.join(PRESETS)}",
        "  --config FILE   a TOML file with sections like [train] and [sync] (see configs/)",
        "  --print-config  print the resolved configuration (every option) as TOML and exit; nothing is written",
        "",
        "Environment:",
        "  DILOCOX_CACHE   where trained tokenizers and tokenized corpora are cached, so a second run on the same",
        "                  text skips tokenizing (default ~/.cache/dilocox; safe to delete; docs/design.md §12)",
        "",
        "Presets (dilocox/presets/NAME.toml; every other option keeps its field default or auto rule):",
    ]
    for name in PRESETS:
        title = f"{name}{' (this run)' if name == preset else ''}: {preset_summary(name)}"
        lines += textwrap.wrap(title, width=110, initial_indent="  ", subsequent_indent="      ")
        settings = [f"{key}={_show_value(value)}" for key, value in flat_settings(read_preset(name)).items()]
        lines += textwrap.wrap(" ".join(settings), width=110, initial_indent="      ", subsequent_indent="      ")
    lines += ["", f"Each option below shows the value this run uses (the {preset} preset, resolved):"]
    section = None
    user, autos = set().union(*layers[1:]), auto_options()
    for name, typ, _, doc in options():
        head = name.rpartition(".")[0]
        if head != section:
            section = head
            lines += ["", f"[{section}]"]
        choices = allowed_values(name)
        shown = "{" + ",".join(choices) + "}" if choices else typ.__name__.upper()
        if name in autos and not choices:
            shown += "|auto"
        value = _show_value(values[name])
        if before[name] == AUTO:
            origin = f"auto: {value}"
        elif name in layers[0] and name not in user:
            origin = f"{value}, preset {preset}"
        else:
            origin = value
        lines.append(f"  --{name}={shown}  ({origin})")
        lines += textwrap.wrap(doc, width=110, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def under_torchrun() -> bool:
    """This process is a rank that torchrun started (its environment names rank, world and master)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of `--name VALUE` or `--name=VALUE` in argv (None if absent) and the other arguments; ValueError
    when the option has no value."""
    value = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == name:
            if i + 1 >= len(argv):
                raise ValueError(f"{name} needs a value: {name} {name.lstrip('-').upper()}")
            value = argv[i + 1]
            i += 2
            continue
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _train_config(config_path: str | None, overrides: list[str]) -> Config:
    """The config `dilocox train` runs (`load_config`: a preset, the file, the flags; resolved, not yet validated)."""
    from dilocox.config import load_config

    return load_config(config_path, overrides)


def cmd_train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        try:
            print(train_help(argv))
        except ValueError as exc:
            return _error(str(exc))
        return 0
    print_config = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    try:
        config_path, rest = _take_option(argv, "--config")
    except ValueError:
        return _error("--config needs a file: --config FILE")
    if print_config:
        from dilocox.config import to_toml

        try:
            cfg = _train_config(config_path, rest)
            cfg.validate()
        except ValueError as exc:
            return _error(str(exc))
        print(to_toml(cfg), end="")
        return 0

    # torchft's Rust side (elastic runs) logs every quorum and commit at INFO; its warnings and errors still show
    os.environ.setdefault("RUST_LOG", "warn")
    torchrun = under_torchrun()
    if not torchrun:
        from dilocox import forkserver

        forkserver.start_early(config_path, rest)  # its imports run while this process imports and checks the config
    from dilocox.launch.local import launch_local
    from dilocox.launch.preflight import preflight
    from dilocox.launch.rundir import choose_run_dir, prepare_run_dir
    from dilocox.launch.torchrun import launch_torchrun

    try:
        cfg = _train_config(config_path, rest)
        if torchrun:
            return launch_torchrun(cfg)
        cfg.validate()
        moved = choose_run_dir(cfg)  # a finished run's or another setting's directory: the next free NAME-N
        data, resume = preflight(cfg)
        if moved:
            print(moved, flush=True)
        lock = prepare_run_dir(cfg, data, resume)  # takes the run directory's lock before writing into it
    except ValueError as exc:
        return _error(str(exc))
    try:
        return launch_local(cfg, data, resume)
    finally:
        lock.release()


EVAL_USAGE = """usage: dilocox eval RUN_DIR [--data.path PATH] [--step N | --checkpoint DIR] [--max-batches N] [--local]
                    [--json]

Load checkpoint N of RUN_DIR (default: the newest; or --checkpoint DIR) with the run's tokenizer and print the mean
token loss and perplexity on the run's validation split, or on the text at --data.path (.txt/.md/.jsonl/.parquet,
a directory or a glob). The model is the agreed model of the run, all pipeline stages together: the outer
parameters every cluster holds (diloco, dilocox), the model the training log's eval_loss and `dilocox export` use;
allreduce and cocktail runs keep every cluster equal. --local scores cluster 0's own parameters instead (the log's
eval_loss_local with eval.local = true), which inside a dilocox run differ from the agreed model. Runs on the run's
run.num_threads CPU threads. --max-batches N scores the first N batches of train.micro_batch_size sequences (the
log's eval uses eval.max_batches, its final eval eval.final_max_batches; 0: all). A checkpoint that does not verify is
refused in one line naming the steps to pass to --step, as by `dilocox export`."""


def _command_parser(command: str, usage: str):
    """The options parser of `dilocox COMMAND`, with -h/--help (which prints `usage`; `_parse`)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"dilocox {command}", usage=usage, add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def _parse(parser, argv: list[str]) -> tuple[Any, int | None]:
    """The options of `argv` and None, or the exit code once -h printed the usage or an unknown option is refused."""
    args, unknown = parser.parse_known_args(argv)
    if args.help:
        print(parser.usage)
        return args, 0
    if unknown:
        command = parser.prog.removeprefix("dilocox ")
        return args, _error(f"unknown option(s) for {command}: {' '.join(unknown)}\n{parser.usage}")
    return args, None


def cmd_eval(argv: list[str]) -> int:
    parser = _command_parser("eval", EVAL_USAGE)
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--data.path", dest="data_path", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--step", default=None)
    parser.add_argument("--max-batches", type=int, default=0)
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--json", action="store_true")
    args, code = _parse(parser, argv)
    if code is not None:
        return code
    if not args.run_dir:
        return _error(f"eval needs a run directory\n{EVAL_USAGE}")
    if args.step is not None and args.checkpoint:
        return _error("eval takes --step N or --checkpoint DIR, not both")
    from dilocox.evaluate import evaluate_run

    try:
        result = evaluate_run(
            Path(args.run_dir),
            data_path=args.data_path,
            checkpoint=args.checkpoint,
            step=_step(args.step),
            max_batches=args.max_batches,
            local=args.local,
        )
    except ValueError as exc:
        return _error(str(exc))
    line = (
        f"{result['source']}: loss {result['loss']:.4f}  perplexity {result['perplexity']:,.2f}  "
        f"({result['tokens']:,} tokens, checkpoint step {result['step']}, {result['model']} model)"
    )
    print(json.dumps(result) if args.json else line)
    return 0


EXPORT_USAGE = """usage: dilocox export RUN_DIR --out DIR [--format hf] [--step N] [--overwrite] [--json]

Write checkpoint N of RUN_DIR (default: the newest) as a Hugging Face model directory: config.json,
model.safetensors (fp32) and the run's tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json),
which transformers' AutoModelForCausalLM and AutoTokenizer load. A model with q/k/v biases (every flavor) is a
Qwen2ForCausalLM, one without (a Llama started with model.init_from) a LlamaForCausalLM. The weights are the
agreed model of the run: the outer parameters saved in the sync state (diloco, dilocox), which every cluster holds
after the last step and which are the last outer step's model inside training; allreduce and cocktail runs keep
every cluster equal and export cluster 0's. Pipeline stages are put together. Needs `pip install 'dilocox[hf]'`."""


def _step(value: str | None) -> int | None:
    """The checkpoint step of `--step` (None: the newest)."""
    try:
        return None if value is None else int(value)
    except ValueError:
        raise ValueError(
            f"--step {value!r} is not a step number; pass the step of a checkpoint, e.g. --step 100"
        ) from None


def cmd_export(argv: list[str]) -> int:
    parser = _command_parser("export", EXPORT_USAGE)
    parser.add_argument("run_dir", nargs="?")
    parser.add_argument("--out", default=None)
    parser.add_argument("--format", default="hf")
    parser.add_argument("--step", default=None)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--json", action="store_true")
    args, code = _parse(parser, argv)
    if code is not None:
        return code
    if not args.run_dir or not args.out:
        return _error(f"export needs a run directory and --out DIR\n{EXPORT_USAGE}")
    from dilocox.export import FORMATS, export_hf

    if args.format not in FORMATS:
        return _error(f"--format {args.format!r} is not supported; use --format hf")
    try:
        result = export_hf(Path(args.run_dir), Path(args.out), step=_step(args.step), overwrite=args.overwrite)
    except ValueError as exc:
        return _error(str(exc))
    line = (
        f"exported step {result['step']} ({result['weights']}, {result['num_params']:,} parameters) as "
        f"{result['architecture']} to {result['out']}"
    )
    print(json.dumps(result) if args.json else line)
    return 0


FLAVORS_USAGE = """usage: dilocox flavors

List the model flavors (model.flavor) with their shapes and parameter counts."""

ENV_USAGE = """usage: dilocox env

Print the versions of dilocox, Python and torch, the GPUs torch sees, the platform and the token cache
($DILOCOX_CACHE, default ~/.cache/dilocox) (for bug reports)."""


LIGHTHOUSE_USAGE = """usage: dilocox lighthouse [--bind HOST:PORT] [--verbose] [--config FILE] [--network.KEY=VALUE ...]

Run a torchft Lighthouse for an elastic run whose clusters are on several machines (topology.local_clusters), with
the timeouts of the run's [network]: a cluster silent for 2 x network.heartbeat is left out of the next round, and
the others wait up to network.stall_timeout (or network.timeout) for one that heartbeats but does not come. Start
it on a host every machine reaches (default --bind [::]:29510) and pass the URL it prints as --network.lighthouse
on every machine. One Lighthouse serves one run at a time. Ctrl+C (or SIGTERM) stops it. It prints torchft's warnings
and errors; --verbose also its INFO lines (each quorum's status, several a second while clusters meet)."""


def cmd_lighthouse(argv: list[str]) -> int:
    import signal
    import threading

    if any(a in ("-h", "--help") for a in argv):
        print(LIGHTHOUSE_USAGE)
        return 0
    from dilocox.config import load_config
    from dilocox.elastic.lighthouse import lighthouse_timeouts, lighthouse_url, start_lighthouse

    verbose = "--verbose" in argv
    argv = [a for a in argv if a != "--verbose"]
    # torchft's Rust side reads RUST_LOG when it starts: a user's own setting is kept unless --verbose
    os.environ["RUST_LOG"] = "info" if verbose else os.environ.get("RUST_LOG", "warn")
    try:
        bind, argv = _take_option(argv, "--bind")
        config_path, rest = _take_option(argv, "--config")
        cfg = load_config(config_path, rest)
        cfg.network.validate()
    except ValueError as exc:
        return _error(str(exc))
    timeouts = lighthouse_timeouts(cfg.network)
    bind = bind or "[::]:29510"
    try:
        lighthouse = start_lighthouse(bind=bind, **timeouts)
    except ImportError:
        return _error("the Lighthouse is torchft's: pip install 'dilocox[elastic]'")
    except Exception as exc:  # torchft's server says why it could not bind (a port in use, a bad address)
        return _error(f"the Lighthouse could not start on {bind}: {exc}")
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopped.set())
    host = bind.rpartition(":")[0].strip("[]")  # on every interface: torchft's URL, with this machine's hostname
    url = lighthouse.address() if host in ("", "::", "0.0.0.0") else lighthouse_url(lighthouse, host)
    print(
        f"dilocox: lighthouse at {url} (a cluster silent for {timeouts['heartbeat_timeout_s']:g}s is "
        f"left out; the others wait up to {timeouts['join_timeout_s']:g}s for one that beats but does not come); on "
        f"every machine pass --network.lighthouse={url}; Ctrl+C stops it",
        flush=True,
    )
    try:
        while not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.shutdown()
    print("dilocox: lighthouse stopped", flush=True)
    return 0


def _no_options(argv: list[str], usage: str) -> int | None:
    """For a command without options: 0 after printing its help, 2 for any argument, None to run it."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        return 0
    if argv:
        return _error(f"unexpected argument(s): {' '.join(argv)}\n{usage}")
    return None


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
    from dilocox.data.prepare import TOKENS_PER_FILE, prepare_dataset

    parser = _command_parser("prepare-data", PREPARE_USAGE)

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
    try:
        args, code = _parse(parser, argv)
    except ValueError as exc:
        return _error(str(exc))
    if code is not None:
        return code
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
    if (code := _no_options(argv, FLAVORS_USAGE)) is not None:
        return code
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
    if (code := _no_options(argv, ENV_USAGE)) is not None:
        return code
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
    from dilocox.data.dataset import cache_dir

    where = "$DILOCOX_CACHE" if os.environ.get("DILOCOX_CACHE") else "default; set DILOCOX_CACHE to move it"
    print(f"token cache: {cache_dir()} ({where}): trained tokenizers and tokenized corpora, safe to delete")
    return 0


def cmd_plot(argv: list[str]) -> int:
    from dilocox.tools.plot import main as plot_main

    return plot_main(argv)


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
    "export": cmd_export,
    "plot": cmd_plot,
    "prepare-data": cmd_prepare_data,
    "bench": cmd_bench,
    "plan": cmd_plan,
    "linkcheck": cmd_linkcheck,
    "lighthouse": cmd_lighthouse,
    "flavors": cmd_flavors,
    "env": cmd_env,
}


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings.showwarning` of the CLI: a config warning as one line, every other warning as Python prints it."""
    from dilocox.config import ConfigWarning

    if issubclass(category, ConfigWarning):
        print(f"dilocox: warning: {message}", file=sys.stderr if file is None else file)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    warnings.showwarning = _show_warning
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        return _error(f"unknown command {argv[0]!r}\n{USAGE}")
    try:
        code = command(argv[1:])
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader stopped early (`dilocox flavors | head -1`): stop quietly, as Unix tools do. Python would flush
        # stdout again at exit and report the broken pipe, so stdout goes to /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13  # the status of a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
