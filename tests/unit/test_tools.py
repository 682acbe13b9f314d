"""The tools (`dilocox.tools`: bench, plan, linkcheck, plot) stay outside the runtime and report bad arguments alike;
the runtime's imports stay light."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dilocox.cli import main

REPO = Path(__file__).resolve().parents[2]

RUNTIME_MODULES = (
    "dilocox.trainer",
    "dilocox.launch.local",
    "dilocox.launch.elastic",
    "dilocox.launch.torchrun",
    "dilocox.cli",
    "dilocox.sync",
    "dilocox.compress",
    "dilocox.net",
    "dilocox.checkpoint",
    "dilocox.metrics",
    "dilocox.evaluate",
)

_LOADED_TOOLS = (
    "json.dumps(sorted(name for name in sys.modules if name == 'dilocox.tools' or name.startswith('dilocox.tools.')))"
)
_HEAVY = "torch.distributed.pipelining"
"""Pulls in dynamo, DTensor and sympy (about 2 s per process here): only a rank of a pipeline of 2+ stages needs it."""


@pytest.mark.slow
def test_the_runtime_never_imports_the_tools_nor_torch_pipelining():
    # A fresh interpreter: this test process has imported the tools already. After the runtime, the same check must
    # see the tools once they are imported, or it could not fail.
    code = "; ".join(
        [
            "import importlib, json, sys",
            *(f"importlib.import_module({name!r})" for name in RUNTIME_MODULES),
            f"print({_LOADED_TOOLS})",
            f"print(json.dumps({_HEAVY!r} in sys.modules))",
            "importlib.import_module('dilocox.tools.bench')",
            f"print({_LOADED_TOOLS})",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    after_runtime, heavy_loaded, after_tools = (json.loads(line) for line in done.stdout.splitlines())
    assert after_runtime == []
    assert heavy_loaded is False, f"a runtime module imports {_HEAVY} at the top; import it where a pipeline is built"
    assert "dilocox.tools.bench" in after_tools


@pytest.mark.parametrize("command", ["bench", "plan", "linkcheck"])
def test_tool_commands_report_bad_arguments_alike(command, capsys):
    assert main([command, "--nonsense"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"dilocox: error: unrecognized arguments: --nonsense (see `dilocox {command} --help`)\n"


@pytest.mark.parametrize("command", ["bench", "plan", "linkcheck", "plot"])
def test_tool_commands_help_exits_0(command, capsys):
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: dilocox {command} ")
