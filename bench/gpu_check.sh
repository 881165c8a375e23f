#!/usr/bin/env bash
# One-shot GPU check of mapl_swarm (issue 10, item 7): in at most 5 minutes on one H100/H200,
#   1. VQ encoder speed, eager and compiled, and its share of a 150M middle stage's fwd+bwd in bf16
#      (bench/vq_speed.py)                                                   -> DIR/vq_speed.json
#   2. each codec's boundary overhead: a 150M middle stage's fwd+bwd per codec vs `none`, bf16
#      autocast (bench/boundary_overhead.py)                                 -> DIR/boundary_overhead.json
#   3. a 4-peer local swarm of the 150M preset (MAPL+VQ recipe) on ONE GPU for a few steps
#      (`mapl-swarm prepare` on a capped corpus, then `mapl-swarm launch --gpus 0,0,0,0`):
#      tokens/s and bytes/token                                              -> DIR/swarm.json
#   4. a few-step slice of the gpu-small grid, every codec under bf16 autocast
#      (`mapl-swarm sweep --grid <slice of bench/grids/gpu-small.toml> --only P4`) -> DIR/sweep.json
#   5. a Markdown table of all parts                                         -> DIR/summary.md (+ DIR/gpu_check.json)
# Each part runs under its own time box (`timeout`); its JSON is written as soon as it ends, with
# "status": "ok" | "failed" (+ "reason": the time box or the exit status, and "log_tail") |
# "skipped" (+ "reason"); a failing part never stops the others. Logs and scratch files go to the
# work folder (--work, default a new /tmp folder), so DIR holds the 6 files above and nothing else.
# Exit status: 0 when every part is ok or skipped, 1 when one failed, 2 for a usage error.
#
# Usage:
#   bench/gpu_check.sh --out DIR [--device cuda|cpu] [--smoke] [--wheels WHEELDIR] [--python PY] [--work WORK]
#   bench/gpu_check.sh --fetch-wheels WHEELDIR [--python PY]       (on a machine with PyPI access)
#
#   --smoke  tiny shapes (d=64 model, 1-2 steps, 2-stage swarm, 1-step grid slice) through every code
#            path above; its figures are labelled "smoke (CPU, not a measurement)". `--device cpu
#            --smoke` is the default CPU test (tests/integration/test_gpu_check.py), under 60 s on 2 cores.
#
# Carrying wheels to a GPU machine without PyPI (the GPU image has Python 3.12 with torch,
# transformers, msgpack, uvloop and tokenizers, but not pyzmq, lz4, hivemind or hivemind's own
# dependencies): on a machine with PyPI access, in the repository root,
#     echo /.whl/ >> .git/info/exclude          # .whl/ is also in .gitignore
#     bench/gpu_check.sh --fetch-wheels .whl    # 25 cp312 manylinux x86_64 wheels, ~25 MiB
# which runs, for the pinned versions in WHEELS below,
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl NAME==VERSION
# and builds the three pure-Python ones PyPI has only as sources (SDIST_WHEELS: `pip wheel --no-deps`,
# py3-none-any). Then carry .whl to the GPU machine with the repository (it is git-ignored: name it
# explicitly when copying the working tree) and run
#     bench/gpu_check.sh --out DIR --wheels .whl
# which installs them offline first:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target WORK/site .whl/*.whl
# and puts WORK/site on PYTHONPATH (inherited by the swarm's peer processes). Without them the swarm
# part is skipped with a "needs pyzmq/lz4/hivemind" record; the other parts need none of them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# cp312 wheels for the GPU image: pyzmq, lz4, hivemind and hivemind's dependencies (the versions the
# CPU test environment runs; protobuf too: hivemind's generated code needs a runtime >= 5.27.2). Checked
# complete against the GPU image's package list as read in 2026-11: every Requires-Dist of these
# wheels, for CPython 3.12 on Linux, is one of them or already in the image.
WHEELS=(pyzmq==27.3.0 lz4==4.4.5 hivemind==1.1.12 base58==2.1.1 configargparse==1.9.0 cryptography==50.0.2
        cffi==2.1.1 pycparser==3.12 grpcio-tools==1.85.1 netaddr==1.3.0 py-cid==0.5.0 py-multibase==2.0.0
        py-multicodec==1.0.0 py-multihash==3.0.0 blake3==1.0.11 mmh3==5.3.1 morphys==1.0 pydantic==2.14.4
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 protobuf==7.36.2)
SDIST_WHEELS=(prefetch-generator==1.0.3 python-baseconv==1.2.2 varint==1.0.2)  # no wheels on PyPI: built here

OUT="" DEVICE="cuda" SMOKE=0 WHEELDIR="" FETCH="" PY="python3" WORK=""
usage() {
  echo "usage: bench/gpu_check.sh --out DIR [--device cuda|cpu] [--smoke] [--wheels WHEELDIR] [--python PY] [--work WORK]" >&2
  echo "       bench/gpu_check.sh --fetch-wheels WHEELDIR [--python PY]   (see the top of this file)" >&2
  exit 2
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --wheels) WHEELDIR="$2"; shift 2 ;;
    --fetch-wheels) FETCH="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "gpu_check.sh: unknown option $1" >&2; usage ;;
  esac
done

if [[ -n "$FETCH" ]]; then
  mkdir -p "$FETCH"
  set -x
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$FETCH" "${WHEELS[@]}"
  "$PY" -m pip wheel -q --no-deps -w "$FETCH" "${SDIST_WHEELS[@]}"
  set +x
  ls "$FETCH"
  exit 0
fi
[[ -n "$OUT" ]] || { echo "gpu_check.sh: --out DIR is required" >&2; usage; }
[[ "$DEVICE" == cuda || "$DEVICE" == cpu ]] || { echo "gpu_check.sh: --device must be cuda or cpu" >&2; exit 2; }

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
T_START=$SECONDS
COMMAND="bench/gpu_check.sh --out $OUT --device $DEVICE$([[ $SMOKE == 1 ]] && echo ' --smoke')"
if [[ $SMOKE == 1 ]]; then
  LABEL="smoke ($( [[ $DEVICE == cpu ]] && echo CPU || echo "$DEVICE" ), not a measurement)"
else
  LABEL="measured on $DEVICE"
fi
echo "gpu_check: out $OUT, work $WORK, device $DEVICE, ${LABEL}"

if [[ -n "$WHEELDIR" ]]; then
  echo "+ $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $WORK/site $WHEELDIR/*.whl"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$WHEELDIR"/*.whl
  export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
if [[ $DEVICE == cuda ]]; then
  DEVNAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)"
  DEVNAME="${DEVNAME:-no GPU found by nvidia-smi}"
  echo "GPU: $DEVNAME"
  [[ $SMOKE == 1 ]] || LABEL="measured on $DEVNAME"
else
  DEVNAME="CPU ($(nproc) cores)"
fi

# ---------------------------------------------------------------- part runner
# step CMD...: one command of the current part, echoed, under what is left of the part's time box;
# output to the part's log, a JSON line (command, wall_s, rc) to its steps file.
step() {
  local left=$((PART_DEADLINE - SECONDS)) t0="${EPOCHREALTIME:-$SECONDS}" rc=0
  echo "+ $*" | tee -a "$PART_LOG"
  if ((left <= 0)); then
    rc=124
  else
    timeout -k 10 "$left" "$@" >>"$PART_LOG" 2>&1 || rc=$?
  fi
  "$PY" -c 'import json, sys; c, t0, t1, rc = sys.argv[1:]
print(json.dumps({"command": c, "wall_s": round(float(t1) - float(t0), 3), "rc": int(rc)}))' \
    "$*" "$t0" "${EPOCHREALTIME:-$SECONDS}" "$rc" >>"$PART_STEPS"
  ((rc == 0)) || echo "  -> exit status $rc (log: $PART_LOG)"
  return "$rc"
}

# run_part NAME LIMIT_S FILE FUNCTION: run FUNCTION (its steps) under a LIMIT_S time box, then stamp
# DIR/FILE with the part's status. PART_SKIP, set by FUNCTION, skips the part with that reason.
run_part() {
  local name="$1" limit="$2" file="$3" fn="$4" rc=0
  PART_DEADLINE=$((SECONDS + limit)) PART_LOG="$WORK/$name.log" PART_STEPS="$WORK/$name.steps" PART_SKIP=""
  : >"$PART_LOG"; : >"$PART_STEPS"; rm -f "$OUT/$file"
  echo "== part $name (time box ${limit} s)"
  "$fn" || rc=$?
  "$PY" bench/gpu_check.py finish --part "$name" --json "$OUT/$file" --rc "$rc" --limit-s "$limit" \
    --label "$LABEL" --steps-file "$PART_STEPS" --log "$PART_LOG" --skip-reason "$PART_SKIP" || true
}

# ---------------------------------------------------------------- shapes
if [[ $SMOKE == 1 ]]; then
  LIMITS=(45 45 50 45)  # safety nets; the smoke run takes seconds per part
  TINY=(--set model.hidden_size=64 --set model.num_layers=4 --set model.num_heads=4 --set model.ffn_hidden_size=128
        --set model.context_length=32 --set compression.rank=16 --set compression.anchor_rank=16
        --set pipeline.micro_batch_size=2 --set pipeline.num_micro_batches=2 --set eval.batches=1
        --set data.vocab_size=512 --set data.max_corpus_bytes=400000 --set data.val_fraction=0.2)
  VQ_ARGS=(--presets tiny --variants eager,compiled --repeats 1 --batch 2 --seq 32 --rank 16)
  BO_ARGS=(--preset tiny --model hidden_size=64 --model num_layers=4 --model num_heads=4 --model ffn_hidden_size=128
           --model vocab_size=512 --rank 16 --batch 2 --seq 32 --warmup 1 --repeats 1)
  SWARM_STAGES=2
  SWARM_ARGS=(--preset tiny "${TINY[@]}" --set pipeline.num_stages=2 --set run.steps=2 --set runtime.threads=1)
  GPU_ARGS=()
  SLICE_STEPS=1
  SLICE_ARGS=("${TINY[@]}" --set model.vocab_size=512 --set runtime.autocast='"bf16"')
  SWEEP_ONLY="P4"
else
  LIMITS=(70 50 90 60)  # 270 s of time boxes: within 5 minutes with the wheels' install and the summary
  VQ_ARGS=(--presets 150M --variants eager,compiled --repeats 5 --batch 4 --seq 2048)  # rank 256: DESIGN.md §5
  BO_ARGS=(--preset 150M --rank 256 --batch 4 --seq 2048 --warmup 2 --repeats 10)
  SWARM_STAGES=4
  # 150M, rank 256, 4 x 2048 tokens per micro-batch; the 32k BPE needs a corpus that has 32,000 tokens
  # to learn (model.vocab_size must equal the tokenizer's): 4 MB of the stdlib gave 29,015, 8 MB 32,000
  # (3.6 s here), so 12 MB for a margin
  SWARM_ARGS=(--set run.steps=3 --set pipeline.num_micro_batches=4 --set eval.batches=1
              --set data.max_corpus_bytes=12000000)
  GPU_ARGS=(--gpus 0,0,0,0)  # one GPU shared by the 4 peers
  SLICE_STEPS=5
  SLICE_ARGS=(--set optim.warmup_steps=2 --set data.max_corpus_bytes=8000000)
  SWEEP_ONLY="P4"  # every run of the grid's P=4 group: all seven codecs
fi
SWARM_ARGS+=(--set optim.warmup_steps=1 --set eval.interval_steps=0 --set checkpoint.interval_steps=0
             --set "data.cache_dir=\"$WORK/cache\"" --set "run.out_dir=\"$WORK/swarm\"" --set 'run.run_id="gpu-check"'
             --set 'net.bind_host="127.0.0.1"' --set 'net.dht_host="127.0.0.1"' --set net.port=0
             --set net.timeout_s=60.0 --set "runtime.device=\"$DEVICE\"")
SLICE_ARGS+=(--set "data.cache_dir=\"$WORK/cache\"" --set "runtime.device=\"$DEVICE\"")

# ---------------------------------------------------------------- parts
part_vq_speed() {
  step "$PY" bench/vq_speed.py "${VQ_ARGS[@]}" --autocast bf16 --device "$DEVICE" --out "$OUT/vq_speed.json"
}

part_boundary_overhead() {
  step "$PY" bench/boundary_overhead.py "${BO_ARGS[@]}" --autocast bf16 --device "$DEVICE" \
    --out "$OUT/boundary_overhead.json"
}

part_swarm() {
  local missing
  if ! missing="$("$PY" -c 'import zmq, lz4, hivemind' 2>&1)"; then
    PART_SKIP="needs pyzmq, lz4 and hivemind (+ hivemind's dependencies), not importable here: $(tail -n 1 <<<"$missing")"
    PART_SKIP+="; carry their wheels: --wheels DIR (see the top of bench/gpu_check.sh)"
    echo "  skipped: $PART_SKIP"
    return 0
  fi
  local cfg=(--config peers/150M-mapl-vq.toml "${SWARM_ARGS[@]}")
  step "$PY" -m mapl_swarm --log-level WARNING prepare --quiet "${cfg[@]}" || return
  step "$PY" -m mapl_swarm --log-level WARNING launch --quiet "${cfg[@]}" "${GPU_ARGS[@]}" || return
  step "$PY" bench/gpu_check.py swarm-result --run-dir "$WORK/swarm" --stages "$SWARM_STAGES" \
    --command "mapl-swarm launch ${cfg[*]} ${GPU_ARGS[*]}" --out "$OUT/swarm.json"
}

part_sweep() {
  local rc=0
  step "$PY" bench/gpu_check.py grid-slice --grid bench/grids/gpu-small.toml --steps "$SLICE_STEPS" \
    "${SLICE_ARGS[@]}" --out-dir "$WORK/sweep" --out "$WORK/gpu-small-slice.toml" || return
  step "$PY" -m mapl_swarm --log-level WARNING sweep --quiet --grid "$WORK/gpu-small-slice.toml" --only "$SWEEP_ONLY" \
    || rc=$?
  # the runs that finished, even when the sweep failed or ran out of time (then the part fails)
  PART_DEADLINE=$((SECONDS + 30)) step "$PY" bench/gpu_check.py sweep-result --sweep-dir "$WORK/sweep" \
    --grid "$WORK/gpu-small-slice.toml" --only "$SWEEP_ONLY" \
    --command "mapl-swarm sweep --grid <$SLICE_STEPS-step slice of bench/grids/gpu-small.toml> --only $SWEEP_ONLY" \
    --out "$OUT/sweep.json" || return
  return "$rc"
}

run_part vq_speed "${LIMITS[0]}" vq_speed.json part_vq_speed
run_part boundary_overhead "${LIMITS[1]}" boundary_overhead.json part_boundary_overhead
run_part swarm "${LIMITS[2]}" swarm.json part_swarm
run_part sweep "${LIMITS[3]}" sweep.json part_sweep

COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
SUMMARY=("$PY" bench/gpu_check.py summary --dir "$OUT" --label "$LABEL" --device "$DEVNAME" --command "$COMMAND"
         --commit "$COMMIT" --total-s "$((SECONDS - T_START))")
[[ $SMOKE == 1 ]] && SUMMARY+=(--smoke)
echo "== summary"
status=0
"${SUMMARY[@]}" || status=$?
echo "gpu_check: $((SECONDS - T_START)) s; results in $OUT; logs in $WORK"
exit "$status"  # 1 when a part failed (its JSON and summary.md say why); a skipped part is not a failure
