#!/usr/bin/env bash
# bench/device_check.sh: the one check to run on a machine with an NVIDIA GPU.
#
#   bash bench/device_check.sh            # from the repository root (or anywhere)
#
# Configures a CUDA build (DFLASH2_CUDA=ON, DFLASH2_CUDA_ARCHS=${DFLASH2_CUDA_ARCHS:-90a}),
# builds it, runs ctest (C++ tests, including tests/cpp/test_cuda_backend: the CUDA device
# layer and kernels against host references) and the op parity tests tests/test_ops.py
# (cpu and cuda parametrizations) with the CUDA engine tests, and, with a GPU, the bundled
# pair end to end on the GPU (bench/bench_default_pair.py --device cuda: tokens/s,
# acceptance, speedup over ar, draft / verify / host split), the op microbenchmarks
# (bench/cpp/bench_ops --quick, results in bench_ops.json), the CUDA op tests once more under
# compute-sanitizer memcheck, and tokens/s at concurrency 1, 8, 32 for ar / mtp / dflash /
# dflash2 on the pair and on the real-dimension slice (bench/bench_concurrency.py; one client
# thread keeps each level's requests in flight, DC_CONC_CLIENTS=threads for a thread each), and
# each op's own device time per decode step (bench/op_profile.py), in that order, then writes
# ${OUT:-bench/results}/device_check.json:
# GPU name/driver, cuda_available() and its reason, build ok, test counts, the op
# benchmark results, the failing step if any. Step logs go beside it in device_check_logs/.
# Every step has a time limit and the whole run a deadline (DC_DEADLINE, default 480 s, the
# build included): a step that would start with under 15 s left is skipped (listed in the
# report's skipped_steps), one that reaches its limit is stopped (exit 124 in its step), and
# the report is always written. A lent machine's device time is short: one run must fit.
#
# Environment: OUT (report folder), DFLASH2_CUDA_ARCHS (default 90a = H100/H200),
# BUILD_DIR (default build-device), JOBS (default nproc), PYTHON (default python3),
# DC_DEADLINE (seconds for everything, default 480), DC_ONLY (the steps to run after the
# build, e.g. "ctest pytest"; default all: ctest pytest e2e kvq stall bench_ops memcheck concurrency),
# DC_PYTEST_K (a pytest -k expression for the pytest and memcheck steps, e.g. "mla or moe"),
# DC_PYTEST_WORKERS (the pytest step in that many pytest-xdist processes, where installed),
# per-step limits in seconds: DC_CTEST_TIMEOUT (150), DC_PYTEST_TIMEOUT (240),
# DC_TEST_TIMEOUT (one Python test, 120, where pytest-timeout is installed), DC_E2E_TIMEOUT
# (75), DC_BENCH_TIMEOUT (bench_ops --quick, 75), DC_BENCH_FILTER (bench_ops --filter: only
# the cases whose name contains it, e.g. "exact_tc"), DC_MEMCHECK_TIMEOUT (120),
# DC_EMULATE=1 (a dry run of every step, the GPU ones included, against the CPU emulation of
# the CUDA backend in BUILD_DIR, default build-device-emu, with smaller benchmark workloads:
# checks this script, not a GPU; give it a larger DC_DEADLINE and step limits),
# DC_KVQ_TIMEOUT (kv_cache_quality.py, 60), DC_STALL_TIMEOUT (prefill_stall.py, 45),
# DC_OPPROF_TIMEOUT (the op profile, bench/op_profile.py: 90), DC_OPPROF_KV (its cache types: "f32 bf16"),
# DC_CONC_TIMEOUT / DC_CONC_BUDGET (the concurrency sweep: stopped after 75 s, no new level
# after 45 s or what the deadline leaves), DC_CONC_ARGS (more bench_concurrency.py options,
# e.g. "--decode-gemm auto" or "--exact-tc": the verify GEMMs on the tensor cores), DFLASH2_REQUIRE_GPU=1 (exit 3 when no GPU is
# usable; default: report and exit 0). bench/device_run.sh wraps this for the device tool.
#
# Exit status: 0 all steps passed (without a GPU: the CUDA tests skipped, said in the
# report); 1 a step failed (named in the report and on stderr); 3 no GPU but one was required.
# It only reads the GPU's state (nvidia-smi --query-gpu); it never resets or reconfigures it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT_DIR=${OUT:-$ROOT/bench/results}
ARCHS=${DFLASH2_CUDA_ARCHS:-90a}
EMULATE=${DC_EMULATE:-0}      # 1: a dry run of every step on the CPU emulation (see above)
if [ "$EMULATE" = 1 ]; then BUILD=${BUILD_DIR:-$ROOT/build-device-emu}; else BUILD=${BUILD_DIR:-$ROOT/build-device}; fi
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
PY=${PYTHON:-python3}
REQUIRE_GPU=${DFLASH2_REQUIRE_GPU:-0}
DEADLINE=${DC_DEADLINE:-480}  # seconds for the whole check, the build included
RESERVE=15                    # seconds kept at the end for the report
ONLY=${DC_ONLY:-}             # step names to run (configure and build always run); empty: all
# progress in the step logs as it happens (a step stopped at its limit shows where it was)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOGS=$OUT_DIR/device_check_logs
rm -rf "$LOGS"
mkdir -p "$LOGS"
REPORT=$OUT_DIR/device_check.json

# ---- state collected for the report (exported for the python writer)
export DC_EMULATE=$EMULATE DC_ARCHS=$ARCHS DC_BUILD=$BUILD DC_LOGS=$LOGS DC_REPORT=$REPORT DC_DEADLINE_S=$DEADLINE
export DC_FAILED_STEP="" DC_FAILED_MSG="" DC_NOTES=""
export DC_GPU_QUERY="" DC_NVIDIA_SMI="" DC_CUDA_AVAILABLE="" DC_BUILD_INFO=""
export DC_STEPS=""       # "name:rc:seconds;..."
export DC_PYTHON_BINDING=0 DC_PYTEST_RAN=0 DC_CTEST_RAN=0 DC_SASS=""
export DC_BENCH_OPS_JSON=""  # bench_ops --quick --json output, when it ran
export DC_E2E_JSON=""        # bench_default_pair.py --device cuda output, when it ran
export DC_CONC_JSON=""       # bench_concurrency.py --device cuda output, when it ran
export DC_KVQ_JSON=""        # kv_cache_quality.py --device cuda output, when it ran
export DC_STALL_JSON=""      # prefill_stall.py --device cuda output, when it ran
export DC_OPPROF_JSON=""     # op_profile.py --device cuda output, when it ran
export DC_SKIPPED=""         # steps not started (DC_ONLY, or the deadline)
START=$(date +%s)

note() { DC_NOTES+="$*"$'\n'; echo "note: $*"; }

write_report() {
  local rc=$1
  export DC_EXIT=$rc DC_SECONDS=$(( $(date +%s) - START ))
  if ! command -v "$PY" >/dev/null 2>&1; then
    printf '{"ok": false, "failed_step": "prerequisites", "error": "%s not found: cannot write the full report"}\n' "$PY" >"$REPORT"
    return
  fi
  "$PY" - <<'PYEOF' || echo "device_check: could not write $DC_REPORT" >&2
import json, os, re, xml.etree.ElementTree as ET

def junit(path):
    """(tests, failures+errors, skipped, [(name, outcome)]) from a junit xml file, or None."""
    if not os.path.isfile(path):
        return None
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = (tc.get("classname") or "") + "::" + (tc.get("name") or "")
        if tc.find("failure") is not None or tc.find("error") is not None:
            outcome = "failed"
        elif tc.find("skipped") is not None or tc.get("status") in ("notrun", "disabled"):
            outcome = "skipped"
        else:
            outcome = "passed"
        cases.append((name, outcome))
    count = lambda o, sel=cases: sum(1 for _, x in sel if x == o)
    return cases, count

env = os.environ
steps = {}
for item in filter(None, env["DC_STEPS"].split(";")):
    name, rc, secs = item.split(":")
    steps[name] = {"ok": rc == "0", "exit_code": int(rc), "seconds": int(secs),
                   "log": os.path.join(env["DC_LOGS"], name + ".log")}

gpus = []
for line in filter(None, env["DC_GPU_QUERY"].splitlines()):
    f = [x.strip() for x in line.split(",")]
    if len(f) >= 4:
        gpus.append({"name": f[0], "driver": f[1], "memory": f[2], "compute_cap": f[3]})
try:
    ok, why = json.loads(env["DC_CUDA_AVAILABLE"])
    avail = {"ok": bool(ok), "reason": why}
except ValueError:
    avail = None
report = {
    "ok": env["DC_EXIT"] == "0",
    "exit_code": int(env["DC_EXIT"]),
    "failed_step": env["DC_FAILED_STEP"] or None,
    "error": env["DC_FAILED_MSG"] or None,
    "gpu_present": bool(gpus) and bool(avail and avail["ok"]),
    "emulated": env["DC_EMULATE"] == "1",
    "gpus": gpus,
    "nvidia_smi": env["DC_NVIDIA_SMI"] or None,
    "cuda_available": avail,
    "cuda_archs": env["DC_ARCHS"],
    "sass_in_library": env["DC_SASS"].split() if env["DC_SASS"] else None,
    "build_info": json.loads(env["DC_BUILD_INFO"]) if env["DC_BUILD_INFO"] else None,
    "build_ok": steps.get("build", {}).get("ok", False),
    "steps": steps,
    "skipped_steps": env["DC_SKIPPED"].split(),
    "deadline_seconds": int(env["DC_DEADLINE_S"]),
    "seconds": int(env["DC_SECONDS"]),
    "notes": [n for n in env["DC_NOTES"].splitlines() if n],
}
ct = junit(os.path.join(env["DC_LOGS"], "ctest.xml"))
if ct:
    cases, count = ct
    report["ctest"] = {"tests": len(cases), "passed": count("passed"), "failed": count("failed"),
                       "skipped": count("skipped"), "failed_tests": [n for n, o in cases if o == "failed"]}
    log = os.path.join(env["DC_LOGS"], "ctest.log")
    if os.path.isfile(log):
        text = open(log, errors="replace").read()
        report["ctest"]["cases_skipped_without_gpu"] = len(re.findall(r"skipped on this machine", text))
        # tests/cpp/test_p2p_allreduce's figure: the one-shot all-reduce beside a copy of the same bytes
        m = re.search(r"one-shot all-reduce of (\d+) floats, (\d+) ranks ([A-Za-z0-9 ]+): ([0-9.]+) us per call \(rank 0\); "
                      r"a copy of the same bytes: ([0-9.]+) us", text)
        if m:
            report["p2p_all_reduce"] = {"floats": int(m.group(1)), "ranks": int(m.group(2)), "placement": m.group(3),
                                        "us_per_call": float(m.group(4)), "copy_same_bytes_us": float(m.group(5))}
py = junit(os.path.join(env["DC_LOGS"], "pytest.xml"))
if py:
    cases, count = py
    cuda = [(n, o) for n, o in cases if "cuda" in n.lower()]
    report["pytest"] = {"tests": len(cases), "passed": count("passed"), "failed": count("failed"),
                        "skipped": count("skipped"), "failed_tests": [n for n, o in cases if o == "failed"][:50]}
    report["pytest_cuda"] = {"tests": len(cuda), "passed": count("passed", cuda), "failed": count("failed", cuda),
                             "skipped": count("skipped", cuda)}
bo = env.get("DC_BENCH_OPS_JSON", "")
if bo:
    try:
        with open(bo) as f:
            report["bench_ops"] = dict(json.load(f), json=bo)
    except (OSError, ValueError) as e:
        report["bench_ops"] = {"json": bo, "error": "no readable result: %s" % e}
e2e = env.get("DC_E2E_JSON", "")
if e2e:
    try:
        with open(e2e) as f:
            modes = json.load(f)["modes"]
        report["default_pair_cuda"] = {mode: {m: {k: st.get(k) for k in ("acceptance_length", "tokens_per_second",
                                                                         "speedup_vs_ar", "lossless_vs_ar",
                                                                         "decode_split", "graphs_speedup",
                                                                         "graphs_equal_eager", "draft_gemm",
                                                                         "tokens_per_second_exact_draft",
                                                                         "draft_gemm_speedup", "exact_draft_lossless")}
                                              for m, st in rows.items()} for mode, rows in modes.items()}
    except (OSError, ValueError, KeyError) as e:
        report["default_pair_cuda"] = {"json": e2e, "error": "no readable result: %s" % e}
kvq = env.get("DC_KVQ_JSON", "")
if kvq:
    try:
        with open(kvq) as f:
            report["kv_cache_quality_cuda"] = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        report["kv_cache_quality_cuda"] = {"json": kvq, "error": "no readable result: %s" % e}
stall = env.get("DC_STALL_JSON", "")
if stall:
    try:
        with open(stall) as f:
            report["prefill_stall_cuda"] = [{k: v for k, v in row.items() if k != "runs"}
                                            for row in json.load(f)["rows"]]
    except (OSError, ValueError, KeyError) as e:
        report["prefill_stall_cuda"] = {"json": stall, "error": "no readable result: %s" % e}
conc = env.get("DC_CONC_JSON", "")
if conc:
    try:
        with open(conc) as f:
            report["concurrency_cuda"] = json.load(f)
    except (OSError, ValueError) as e:
        report["concurrency_cuda"] = {"json": conc, "error": "no readable result: %s" % e}
opp = env.get("DC_OPPROF_JSON", "")
if opp:
    try:
        with open(opp) as f:
            runs = json.load(f)["runs"]
        # per run: the timed total per step and its 12 largest ops
        report["op_profile_cuda"] = [{k: r.get(k) for k in ("model", "method", "kv_cache_dtype", "batch", "steps",
                                                            "wall_ms_per_step", "timed_ms_per_step")} |
                                     {"ops": [{k: o[k] for k in ("op", "calls_per_step", "us_per_step", "share")}
                                              for o in r["ops"][:12]]} for r in runs]
    except (OSError, ValueError, KeyError) as e:
        report["op_profile_cuda"] = {"json": opp, "error": "no readable result: %s" % e}
with open(env["DC_REPORT"], "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")
PYEOF
  echo "device_check: report written to $REPORT"
}
trap 'rc=$?; write_report $rc; exit $rc' EXIT

fail() {  # fail STEP MESSAGE: stops here (nothing after this step can run)
  DC_FAILED_STEP=${DC_FAILED_STEP:-$1}
  DC_FAILED_MSG=${DC_FAILED_MSG:-$2}
  echo "device_check: FAILED at step '$1': $2" >&2
  exit 1
}
# A test step that fails is recorded (the first one is the report's failed_step) and the
# remaining test steps still run, so one GPU session reports every failure; exit 1 at the end.
soft_fail() {  # soft_fail STEP MESSAGE
  [ -z "$DC_FAILED_STEP" ] && { DC_FAILED_STEP=$1; DC_FAILED_MSG=$2; }
  DC_SOFT_FAILED+="$1 "
  echo "device_check: FAILED step '$1': $2 (continuing with the other test steps)" >&2
}
DC_SOFT_FAILED=""

# Seconds left before the deadline (DC_DEADLINE seconds after the start).
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
# wanted STEP: whether DC_ONLY (step names; empty: every step) names STEP.
wanted() { [ -z "$ONLY" ] || [ "$1" = configure ] || [ "$1" = build ] || [[ " $ONLY " == *" $1 "* ]]; }
# run_step NAME LIMIT CMD...: runs CMD with output to $LOGS/NAME.log for at most LIMIT seconds
# (0: no limit of its own), and never past the deadline less RESERVE seconds (kept for the
# report); returns CMD's exit code (124: stopped at its limit). A step that DC_ONLY leaves out,
# or that would get under 15 s, is not started: listed in the report's skipped_steps, returns 0.
run_step() {
  local name=$1 want=$2 t0 rc=0 lim
  shift 2
  if ! wanted "$name"; then
    DC_SKIPPED+="$name "
    return 0
  fi
  lim=$(( $(left) - RESERVE ))
  if [ "$want" -gt 0 ] && [ "$want" -lt "$lim" ]; then lim=$want; fi
  if [ "$lim" -lt 15 ]; then
    DC_SKIPPED+="$name "
    note "step '$name' not started: $(( $(date +%s) - START )) s of the deadline DC_DEADLINE=$DEADLINE s used"
    return 0
  fi
  echo "== $name (at most ${lim} s): $*"
  t0=$(date +%s)
  timeout -k 10 "$lim" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  DC_STEPS+="$name:$rc:$(( $(date +%s) - t0 ));"
  if [ "$rc" -ne 0 ]; then
    [ "$rc" = 124 ] && echo "-- $name stopped at its limit of $lim s" >&2
    echo "-- $name exited $rc; last lines of $LOGS/$name.log:" >&2
    tail -n 40 "$LOGS/$name.log" >&2 || true
  fi
  return "$rc"
}
ran() { [ -f "$LOGS/$1.log" ]; }  # ran STEP: whether STEP was started

# ---------------------------------------------------------------- the GPU (read-only queries)
if command -v nvidia-smi >/dev/null 2>&1; then
  DC_NVIDIA_SMI=$(command -v nvidia-smi)
  DC_GPU_QUERY=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1) || {
    note "nvidia-smi failed: $DC_GPU_QUERY"
    DC_GPU_QUERY=""
  }
else
  note "nvidia-smi not found: no NVIDIA driver on this machine"
fi
echo "GPU: ${DC_GPU_QUERY:-none}"

# ---------------------------------------------------------------- prerequisites
for tool in cmake "$PY"; do
  command -v "$tool" >/dev/null 2>&1 || fail prerequisites "$tool not found on PATH"
done
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
[ -n "$NVCC" ] || fail prerequisites "nvcc not found (PATH, /usr/local/cuda/bin): a CUDA toolkit is needed to build"
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)

CMAKE_ARGS=(-S "$ROOT" -B "$BUILD" ${GEN[@]+"${GEN[@]}"} -DCMAKE_BUILD_TYPE=Release -DDFLASH2_BUILD_TESTS=ON
            -DDFLASH2_BUILD_BENCH=ON)
if [ "$EMULATE" = 1 ]; then
  # the CUDA backend's kernels on the CPU emulation (cpp/emu): every GPU step of this script
  # runs, slowly, against it (a dry run of the script; nothing here is a GPU figure)
  CMAKE_ARGS+=(-DDFLASH2_CUDA=OFF -DDFLASH2_CUDA_EMULATE=ON)
  export EMU_MEMCHECK=${EMU_MEMCHECK:-1}
  note "DC_EMULATE=1: a dry run on the CPU emulation of the CUDA backend, not a GPU; its timings mean nothing"
else
  CMAKE_ARGS+=(-DDFLASH2_CUDA=ON "-DDFLASH2_CUDA_ARCHS=$ARCHS" -DCMAKE_CUDA_COMPILER="$NVCC")
fi
if PYBIND11_DIR=$("$PY" -m pybind11 --cmakedir 2>/dev/null); then
  CMAKE_ARGS+=(-DDFLASH2_BUILD_PYTHON=ON "-Dpybind11_DIR=$PYBIND11_DIR" "-DPython_EXECUTABLE=$(command -v "$PY")")
  DC_PYTHON_BINDING=1
else
  CMAKE_ARGS+=(-DDFLASH2_BUILD_PYTHON=OFF)
  note "pybind11 is not importable by $PY: Python extension not built, pytest skipped (ctest only)"
fi

# ---------------------------------------------------------------- configure, build
run_step configure 300 cmake "${CMAKE_ARGS[@]}" || fail configure "cmake configure failed (see $LOGS/configure.log)"
rc=0
run_step build 0 cmake --build "$BUILD" -j "$JOBS" || rc=$?
[ "$rc" = 124 ] && fail build "the build did not finish before the deadline (DC_DEADLINE=$DEADLINE s; see $LOGS/build.log)"
[ "$rc" = 0 ] || fail build "build failed (see $LOGS/build.log)"
ran build || fail build "no time left for the build (DC_DEADLINE=$DEADLINE s)"

CUOBJDUMP=$(command -v cuobjdump || true)
[ -z "$CUOBJDUMP" ] && [ -x "$(dirname "$NVCC")/cuobjdump" ] && CUOBJDUMP=$(dirname "$NVCC")/cuobjdump
if [ -n "$CUOBJDUMP" ] && [ -f "$BUILD/libdflash2.a" ]; then
  DC_SASS=$("$CUOBJDUMP" --list-elf "$BUILD/libdflash2.a" 2>/dev/null | grep -o 'sm_[0-9]*[af]\?' | sort -u | tr '\n' ' ' || true)
  echo "SASS in libdflash2.a: ${DC_SASS:-none found}"
fi

# ---------------------------------------------------------------- what the build sees
if [ "$DC_PYTHON_BINDING" = 1 ]; then
  export DFLASH2_RT_CORE_DIR=$BUILD PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
  DC_CUDA_AVAILABLE=$("$PY" -c 'import json, dflash2_rt; print(json.dumps(dflash2_rt.cuda_available(with_reason=True)))' 2>&1) ||
    fail import "the built module does not import: $DC_CUDA_AVAILABLE"
  DC_BUILD_INFO=$("$PY" -c 'import json, dflash2_rt; print(json.dumps(dflash2_rt.build_info()))' 2>/dev/null || true)
else
  DC_CUDA_AVAILABLE=""
fi
echo "cuda_available: ${DC_CUDA_AVAILABLE:-unknown (no Python binding)}"
if [ -n "$DC_BUILD_INFO" ] &&
   ! printf '%s' "$DC_BUILD_INFO" | "$PY" -c 'import json, sys; sys.exit(0 if json.load(sys.stdin).get("cutlass") else 1)'; then
  note "CUTLASS was not found at configure time: no tensor-core GEMM (linear_bf16 / linear_fp8 / linear_nvfp4) in this build, its tests skip; pip install nvidia-cutlass==4.2.0.0 (or carry the wheel) or set CUTLASS_DIR"
fi
GPU_USABLE=0
case "$DC_CUDA_AVAILABLE" in '[true'*) GPU_USABLE=1 ;; esac
if [ -z "$DC_CUDA_AVAILABLE" ] && [ -n "$DC_GPU_QUERY" ]; then GPU_USABLE=1; fi

# ---------------------------------------------------------------- tests
# Order (each step bounded, the deadline bounding all): the C++ tests, the CUDA op and engine
# tests, the end-to-end pair, the op microbenchmarks, memcheck, the concurrency sweep; a
# step that fails is recorded and the next ones still run.
DC_CTEST_RAN=1
run_step ctest "${DC_CTEST_TIMEOUT:-150}" ctest --test-dir "$BUILD" -V --timeout 120 --output-junit "$LOGS/ctest.xml" ||
  soft_fail ctest "ctest failed or reached its limit (see $LOGS/ctest.log)"
if [ "$GPU_USABLE" = 1 ] && ran ctest && grep -q "skipped on this machine" "$LOGS/ctest.log"; then
  soft_fail ctest "a GPU is present but C++ CUDA tests skipped: $(grep -m1 'skipped on this machine' "$LOGS/ctest.log")"
fi

# pytest-timeout (there on the lent H200 machines) stops one hanging test instead of the step
PYTEST_TIMEOUT=()
if "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then PYTEST_TIMEOUT=(--timeout "${DC_TEST_TIMEOUT:-120}"); fi
# DC_PYTEST_K: a pytest -k expression for the pytest and memcheck steps (a shorter rerun)
PYTEST_K=()
MEMCHECK_K=(-k cuda)
if [ -n "${DC_PYTEST_K:-}" ]; then PYTEST_K=(-k "$DC_PYTEST_K"); MEMCHECK_K=(-k "cuda and ($DC_PYTEST_K)"); fi
# DC_PYTEST_WORKERS: run the pytest step in that many pytest-xdist processes (where installed)
if [ -n "${DC_PYTEST_WORKERS:-}" ] && "$PY" -c 'import xdist' >/dev/null 2>&1; then
  PYTEST_K+=(-n "$DC_PYTEST_WORKERS")
fi
if [ "$DC_PYTHON_BINDING" = 1 ]; then
  if ! "$PY" -c 'import pytest, numpy, torch' >/dev/null 2>&1; then
    note "pytest/numpy/torch not importable by $PY: tests/test_ops.py not run"
  elif [ ! -f "$ROOT/tests/test_ops.py" ]; then
    note "tests/test_ops.py does not exist yet: not run"
  else
    DC_PYTEST_RAN=1
    # the per-op harness (every CUDA op vs the CPU op) and the CUDA engine vs the CPU engine;
    # -v: the log names each test as it starts (a step stopped at its limit shows which)
    run_step pytest "${DC_PYTEST_TIMEOUT:-240}" "$PY" -m pytest -v -rs "$ROOT/tests/test_ops.py" \
      "$ROOT/tests/test_cuda_engine.py" "$ROOT/tests/test_quantize.py" "$ROOT/tests/test_kv_fp8.py" \
      ${PYTEST_TIMEOUT[@]+"${PYTEST_TIMEOUT[@]}"} \
      ${PYTEST_K[@]+"${PYTEST_K[@]}"} -p no:cacheprovider --junitxml="$LOGS/pytest.xml" ||
      soft_fail pytest "tests/test_ops.py / test_cuda_engine.py / test_quantize.py / test_kv_fp8.py failed or reached the limit (see $LOGS/pytest.log)"
    if [ "$GPU_USABLE" = 1 ] && [ -f "$LOGS/pytest.xml" ]; then
      n_cuda_skipped=$("$PY" - "$LOGS/pytest.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
n = 0
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    if "cuda" in (tc.get("name") or "").lower() and tc.find("skipped") is not None:
        msg = tc.find("skipped").get("message") or ""
        # kernels that exist for other architectures only (W4A4 on Blackwell, W8A8 on Hopper)
        arch_only = "sm_90a only" in msg or "sm_100a / sm_103a only" in msg
        if "not implemented on the CUDA backend" not in msg and "a GPU is usable here" not in msg and not arch_only:
            n += 1
print(n)
PYEOF
)
      [ "$n_cuda_skipped" = 0 ] || soft_fail pytest "a GPU is present but $n_cuda_skipped CUDA op tests skipped (see $LOGS/pytest.log)"
    fi
  fi
fi

# ---------------------------------------------------------------- end to end on the GPU
# The bundled pair with the target on the GPU: ar / mtp / dflash / dflash2, greedy (checked
# equal to ar) and sampled, 4 prompts x 64 new tokens, one pass (tiny model: launch-bound).
if [ "$GPU_USABLE" = 1 ] && [ "$DC_PYTHON_BINDING" = 1 ]; then
  rm -f "$OUT_DIR/default_pair_cuda.json" "$OUT_DIR/default_pair_cuda.md"
  E2E_SIZE=(--n 4 --new 64)
  [ "$EMULATE" = 1 ] && E2E_SIZE=(--n 1 --new 16)  # the dry run: the same steps, smaller
  run_step e2e "${DC_E2E_TIMEOUT:-75}" "$PY" "$ROOT/bench/bench_default_pair.py" --device cuda "${E2E_SIZE[@]}" \
    --repeat 1 --threads 4 --out "$OUT_DIR" ||
    soft_fail e2e "bench/bench_default_pair.py --device cuda failed or reached its limit (see $LOGS/e2e.log)"
  if [ -f "$OUT_DIR/default_pair_cuda.json" ]; then DC_E2E_JSON=$OUT_DIR/default_pair_cuda.json; fi
  # the KV cache's element type on the GPU's kernels (FP8 / BF16 rows against F32 ones, the
  # indexer's FP8 keys on the tensor cores): logits, greedy agreement, dflash2 lossless under each
  rm -f "$OUT_DIR/kv_cache_quality_cuda.json" "$OUT_DIR/kv_cache_quality_cuda.md"
  KVQ_SIZE=(--n 4 --new 32)
  [ "$EMULATE" = 1 ] && KVQ_SIZE=(--n 1 --new 8)
  run_step kvq "${DC_KVQ_TIMEOUT:-60}" "$PY" "$ROOT/bench/kv_cache_quality.py" --device cuda "${KVQ_SIZE[@]}" \
    --threads 4 --out "$OUT_DIR" ||
    soft_fail kvq "bench/kv_cache_quality.py --device cuda failed or reached its limit (see $LOGS/kvq.log)"
  if [ -f "$OUT_DIR/kv_cache_quality_cuda.json" ]; then DC_KVQ_JSON=$OUT_DIR/kv_cache_quality_cuda.json; fi
  # a long prompt arriving while 4 streams decode: their worst stall with the prompt run whole
  # and interleaved with their steps (prefill_tokens_per_step), the newcomer's first token
  rm -f "$OUT_DIR/prefill_stall_cuda.json"
  STALL_SIZE=(--prompt-tokens 3000 --repeat 3)
  [ "$EMULATE" = 1 ] && STALL_SIZE=(--prompt-tokens 48 --running 2 --new 12 --budgets 0 16 --repeat 1)
  run_step stall "${DC_STALL_TIMEOUT:-45}" "$PY" "$ROOT/bench/prefill_stall.py" --device cuda "${STALL_SIZE[@]}" \
    --out "$OUT_DIR" ||
    soft_fail stall "bench/prefill_stall.py --device cuda failed or reached its limit (see $LOGS/stall.log)"
  if [ -f "$OUT_DIR/prefill_stall_cuda.json" ]; then DC_STALL_JSON=$OUT_DIR/prefill_stall_cuda.json; fi
fi

# ---------------------------------------------------------------- op microbenchmarks (GPU only)
# bench_ops --quick: each CUDA op on GLM-5.3 shapes (decode / verify), the copy bandwidth and
# cuBLASLt beside the GEMMs (when the nvidia-cublas wheel was importable at configure time).
# A failure or a timeout is a failed step; the other steps' results stand.
if [ "$GPU_USABLE" = 1 ]; then
  BENCH_OPS=$BUILD/bench/cpp/bench_ops
  rm -f "$OUT_DIR/bench_ops.json"
  if [ -x "$BENCH_OPS" ]; then
    BENCH_SIZE=()
    [ "$EMULATE" = 1 ] && BENCH_SIZE=(--trials 1 --filter "decode b1")
    [ -n "${DC_BENCH_FILTER:-}" ] && BENCH_SIZE+=(--filter "$DC_BENCH_FILTER")
    run_step bench_ops "${DC_BENCH_TIMEOUT:-75}" "$BENCH_OPS" --quick ${BENCH_SIZE[@]+"${BENCH_SIZE[@]}"} \
      --json "$OUT_DIR/bench_ops.json" ||
      soft_fail bench_ops "bench_ops --quick failed or reached its limit (see $LOGS/bench_ops.log)"
    if ran bench_ops; then
      DC_BENCH_OPS_JSON=$OUT_DIR/bench_ops.json
      grep -E "^(device|cublasLt|copy bandwidth|summary):" "$LOGS/bench_ops.log" || true
    fi
  elif wanted bench_ops; then
    soft_fail bench_ops "bench/cpp/bench_ops was not built ($BENCH_OPS missing)"
  fi
fi

# ---------------------------------------------------------------- memcheck (GPU only)
# every CUDA op once more under compute-sanitizer memcheck (out-of-bounds / misaligned
# accesses, leaks of device memory), bounded so that the whole check keeps to its deadline
if [ "$GPU_USABLE" = 1 ] && [ "$DC_PYTEST_RAN" = 1 ]; then
  SANITIZER=$(command -v compute-sanitizer || true)
  [ -z "$SANITIZER" ] && [ -x "$(dirname "$NVCC")/compute-sanitizer" ] && SANITIZER=$(dirname "$NVCC")/compute-sanitizer
  if [ "$EMULATE" = 1 ]; then
    note "emulated: compute-sanitizer not run (every emulated step ran under EMU_MEMCHECK=$EMU_MEMCHECK instead)"
  elif [ -n "$SANITIZER" ]; then
    run_step memcheck "${DC_MEMCHECK_TIMEOUT:-120}" "$SANITIZER" --tool memcheck --error-exitcode 9 \
      "$PY" -m pytest -v -x "$ROOT/tests/test_ops.py" "$ROOT/tests/test_kv_fp8.py" "${MEMCHECK_K[@]}" \
      -p no:cacheprovider || {
      rc=$?
      if [ "$rc" = 124 ] && ! grep -q "ERROR SUMMARY: [1-9]\|Invalid\|FAILED" "$LOGS/memcheck.log"; then
        note "memcheck reached its limit with no error found in the op tests it ran (see $LOGS/memcheck.log)"
      else
        soft_fail memcheck "compute-sanitizer memcheck over the CUDA op tests failed (see $LOGS/memcheck.log)"
      fi
    }
  else
    note "compute-sanitizer not found: memcheck not run"
  fi
fi

# ---------------------------------------------------------------- concurrency sweep (GPU only)
# tokens/s at concurrency 1, 8 and 32 for ar / mtp / dflash / dflash2 on the bundled pair and
# on the real-dimension slice (random weights: step costs, not speedups), one run; levels
# stop at the budget, the JSON keeps what ran
if [ "$GPU_USABLE" = 1 ] && [ "$DC_PYTHON_BINDING" = 1 ]; then
  rm -f "$OUT_DIR/concurrency_cuda.json" "$OUT_DIR/concurrency_cuda.md"
  CONC_LIMIT=${DC_CONC_TIMEOUT:-75}
  CONC_BUDGET=${DC_CONC_BUDGET:-45}
  # the sweep's own budget (no new level after it) shrinks with the time left
  if [ $(( $(left) - RESERVE - 30 )) -lt "$CONC_BUDGET" ]; then CONC_BUDGET=$(( $(left) - RESERVE - 30 )); fi
  if [ "$CONC_BUDGET" -lt 10 ]; then CONC_BUDGET=10; fi
  CONC_SIZE=(--levels 1 8 32 --new 32 --models pair slice)
  [ "$EMULATE" = 1 ] && CONC_SIZE=(--levels 1 2 --new 8 --models pair)
  run_step concurrency "$CONC_LIMIT" "$PY" "$ROOT/bench/bench_concurrency.py" --device cuda "${CONC_SIZE[@]}" \
    --requests 2 --repeat 1 --modes ar mtp dflash "dflash2 fixed" --clients "${DC_CONC_CLIENTS:-loop}" \
    --budget "$CONC_BUDGET" --out "$OUT_DIR" ${DC_CONC_ARGS:-} || {
    rc=$?
    if [ "$rc" = 124 ] && [ -f "$OUT_DIR/concurrency_cuda.json" ]; then
      note "the concurrency sweep reached its time limit; the levels it finished are in the report"
    else
      soft_fail concurrency "bench/bench_concurrency.py --device cuda failed or reached its limit (see $LOGS/concurrency.log)"
    fi
  }
  if [ -f "$OUT_DIR/concurrency_cuda.json" ]; then DC_CONC_JSON=$OUT_DIR/concurrency_cuda.json; fi
fi

# ---------------------------------------------------------------- op profile (GPU only)
# each op's own device time per decode step (bench/op_profile.py: ops.set_op_timing, eager
# steps), ar and dflash2 at batch 1 and 8 on the pair and on the real-dimension slice
if [ "$GPU_USABLE" = 1 ] && [ "$DC_PYTHON_BINDING" = 1 ]; then
  rm -f "$OUT_DIR/op_profile_cuda.json"
  # the slice also with a BF16 cache (MLA on the tensor cores); DC_OPPROF_KV overrides
  read -r -a OPP_KV <<< "${DC_OPPROF_KV:-f32 bf16}"
  OPP_SIZE=(--models pair slice --batch 1 8 --new 16 --kv-cache-dtype "${OPP_KV[@]}")
  [ "$EMULATE" = 1 ] && OPP_SIZE=(--models pair --batch 1 --new 4)
  run_step op_profile "${DC_OPPROF_TIMEOUT:-90}" "$PY" "$ROOT/bench/op_profile.py" --device cuda "${OPP_SIZE[@]}" \
    --methods ar dflash2 --out "$OUT_DIR" ||
    soft_fail op_profile "bench/op_profile.py --device cuda failed or reached its limit (see $LOGS/op_profile.log)"
  if [ -f "$OUT_DIR/op_profile_cuda.json" ]; then DC_OPPROF_JSON=$OUT_DIR/op_profile_cuda.json; fi
fi

# ---------------------------------------------------------------- verdict
if [ "$GPU_USABLE" != 1 ]; then
  note "no usable GPU: ${DC_CUDA_AVAILABLE:-nvidia-smi found none}; the build and the CPU tests ran, the CUDA tests skipped"
  if [ "$REQUIRE_GPU" = 1 ]; then
    DC_FAILED_STEP=gpu
    DC_FAILED_MSG="no usable GPU and DFLASH2_REQUIRE_GPU=1"
    echo "device_check: $DC_FAILED_MSG" >&2
    exit 3
  fi
fi
if [ -n "$DC_SOFT_FAILED" ]; then
  echo "device_check: FAILED steps: $DC_SOFT_FAILED(first: $DC_FAILED_STEP: $DC_FAILED_MSG)" >&2
  exit 1
fi
echo "device_check: all steps passed"
exit 0
