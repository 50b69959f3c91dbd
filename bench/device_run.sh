#!/usr/bin/env bash
# bench/device_run.sh: bench/device_check.sh as one call of a lent GPU machine (the device
# tool of this workplace: no network there, no CUTLASS, at most 8 files back from $OUT).
#
#   bash bench/device_run.sh --prepare   # here, once per checkout (needs pip's network):
#       downloads the nvidia-cutlass wheel (pure Python, carries CUTLASS's headers) into .whl/
#       and ignores that folder in .git/info/exclude
#   bash bench/device_run.sh             # there: the device tool's run, carry [".whl"],
#                                        # timeout_s 600
#
# There it installs the carried wheels into /tmp/site (PYTHONPATH: CMake's FindCUTLASS finds
# cutlass_library through the Python it runs), runs device_check with its report in
# /tmp/device_check, then leaves in $OUT: device_check.json, bench_ops.json,
# default_pair_cuda.json, concurrency_cuda.json, op_profile_cuda.json (those written) and logs.tar.gz
# (every step's log, the junit files, the benchmarks' tables). DC_DEADLINE (default 480 s)
# bounds device_check; device_check's other variables pass through (DC_ONLY, DC_PYTEST_K,
# ...: see bench/device_check.sh), e.g. a second, shorter run after a fix:
#   DC_DEADLINE=240 DC_ONLY="pytest" DC_PYTEST_K="mla" bash bench/device_run.sh
# Exit status: device_check's (0 passed, 1 a step failed, 124 stopped past its deadline).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CUTLASS_WHEEL_VERSION=4.2.0.0

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .whl .git/info
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "nvidia-cutlass==$CUTLASS_WHEEL_VERSION" || exit 1
  ls -l .whl
  echo "device_run: prepared; run 'bash bench/device_run.sh' on the device with carry [\".whl\"]"
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: bash bench/device_run.sh [--prepare]" >&2; exit 2; }

OUT=${OUT:-/tmp/device_run}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { echo "device_run: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "device_run: no .whl/*.whl (carry [\".whl\"] after --prepare): CUTLASS only if installed there"
fi

export DC_DEADLINE=${DC_DEADLINE:-480}
# the lent machine has 16 cores: the pytest step in 8 pytest-xdist processes (65 s for the
# CUDA rows and engine tests on an H200, 2026-12-04); DC_PYTEST_WORKERS= (empty) runs it serially
export DC_PYTEST_WORKERS=${DC_PYTEST_WORKERS-8}
REPORT_DIR=/tmp/device_check
rm -rf "$REPORT_DIR"
mkdir -p "$REPORT_DIR"
# device_check keeps to its deadline itself; this bound only guards against a step that
# ignores its own limit (the files already written still come back)
rc=0
OUT=$REPORT_DIR timeout -k 10 $(( DC_DEADLINE + 40 )) bash "$ROOT/bench/device_check.sh" || rc=$?

for f in device_check.json bench_ops.json default_pair_cuda.json concurrency_cuda.json op_profile_cuda.json; do
  [ -f "$REPORT_DIR/$f" ] && cp "$REPORT_DIR/$f" "$OUT/"
done
(cd "$REPORT_DIR" && tar czf "$OUT/logs.tar.gz" --exclude='*.json' .) ||
  echo "device_run: could not pack the logs" >&2
# the gist on stdout too (the device tool returns the output's tail even if files do not)
if [ -f "$REPORT_DIR/device_check.json" ]; then
  python3 - "$REPORT_DIR/device_check.json" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
print("summary: ok=%s failed_step=%s gpu=%s seconds=%s skipped=%s" % (
    r.get("ok"), r.get("failed_step"), [g.get("name") for g in r.get("gpus", [])], r.get("seconds"),
    r.get("skipped_steps")))
print("steps:", {k: (v["exit_code"], v["seconds"]) for k, v in r.get("steps", {}).items()})
for k in ("ctest", "pytest", "pytest_cuda"):
    if k in r:
        print(k + ":", {x: r[k][x] for x in ("tests", "passed", "failed", "skipped")},
              "failed:", r[k].get("failed_tests", [])[:20])
if "bench_ops" in r:
    print("bench_ops:", r["bench_ops"].get("summary", r["bench_ops"].get("error")))
for mode, rows in (r.get("default_pair_cuda") or {}).items():
    if isinstance(rows, dict):
        for m, st in rows.items():
            if isinstance(st, dict):
                print("e2e %s %s: tau %s tok/s %s speedup %s lossless %s graphs x%s" % (
                    mode, m, st.get("acceptance_length"), st.get("tokens_per_second"), st.get("speedup_vs_ar"),
                    st.get("lossless_vs_ar"), st.get("graphs_speedup")))
for run in r.get("op_profile_cuda") or []:
    if isinstance(run, dict) and "ops" in run:
        print("ops %s %s b%s: %.3f ms timed / %.3f wall per step; top: %s" % (
            run["model"], run["method"], run["batch"], run["timed_ms_per_step"], run["wall_ms_per_step"],
            ", ".join("%s %.0fus" % (o["op"], o["us_per_step"]) for o in run["ops"][:5])))
for n in r.get("notes", []):
    print("note:", n)
PYEOF
fi
echo "device_run: device_check exited $rc; results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$rc"
