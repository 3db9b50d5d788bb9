#!/usr/bin/env bash
# Llama-2-7B's whole training step (benchmarks/bench_e2e.py, train.py's own step) per FP8 linear
# scaling against BF16, each mode at its best measured setting, each setting in its own process:
#   largest  BF16 at its largest batch (6) against COAT with the memory options of
#            `recipe: coat_max_batch` at its largest batch (20), per-tensor, row-wise and
#            row-wise with the weight gradient in BF16 (the row-wise producers' Pallas kernels);
#   batch1   batch 1: BF16 unrolled without remat against COAT unrolled with the fused SwiGLU,
#            per-tensor and row-wise.
# BF16 with optax's float32 AdamW needs a card of more than 80 GiB at this size (an H200).
#
#   OUT=runs/rowwise_e2e bash benchmarks/rowwise_e2e_gpu.sh largest
#   OUT=runs/rowwise_e2e bash benchmarks/rowwise_e2e_gpu.sh batch1
#   SMOKE=1 OUT=/tmp/rowwise_e2e bash benchmarks/rowwise_e2e_gpu.sh batch1   # tiny, on a CPU
#
# Writes $OUT/<part>.log and $OUT/<part>-<setting>.jsonl (bench_e2e's records).
set -u
cd "$(dirname "$0")/.."
PART=${1:?usage: rowwise_e2e_gpu.sh largest|batch1}
OUT=${OUT:-runs/rowwise_e2e}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG=$OUT/$PART.log
O="optimizer.in_backward=true+optimizer.grad_clip=null+precision.fp8_attention=true"
O+="+memory.loss_chunk_size=2048+precision.fp8_group_scale=e8m0"
O+="+precision.fp8_weight_residual=master+precision.fp8_swiglu=fused"
PRODUCERS="kernels.rmsnorm_rowwise=pallas+kernels.swiglu_rowwise=pallas"
E=(python3 benchmarks/bench_e2e.py --no-search --reps 3 --warmup 1 --profile-reps 1 --no-child-logs)
if [[ -n ${SMOKE:-} ]]; then
  E+=(--tiny)
  export COAT_JAX_PALLAS_INTERPRET=1  # the row-wise producers' Pallas kernels in interpret mode
fi

run() {  # run NAME BATCH SETTING
  local dir
  dir=$(mktemp -d)
  timeout 300 "${E[@]}" --equal-batch "$2" --settings "$3" --child-budgets 240 \
    --out-dir "$dir" --docs "$dir/bench.md" >>"$LOG" 2>&1
  cp "$dir/e2e.jsonl" "$OUT/$PART-$1.jsonl"
}

git log --oneline -1 >>"$LOG"
case $PART in
  largest)
    run bf16 6 bf16:unrolled:none
    run tensor 20 "coat:scan:activations:$O"
    run row 20 "coat:scan:activations:$O+precision.fp8_linear_scaling=row+$PRODUCERS"
    run row_gw_hp 20 "coat:scan:activations:$O+precision.fp8_linear_scaling=row_gw_hp+$PRODUCERS"
    ;;
  batch1)
    run bf16 1 bf16:unrolled:none
    run tensor 1 coat:unrolled:none:precision.fp8_swiglu=fused
    run row 1 "coat:unrolled:none:precision.fp8_swiglu=fused+precision.fp8_weight_residual=master+precision.fp8_linear_scaling=row+$PRODUCERS"
    ;;
  *)
    echo "unknown part $PART: largest or batch1" >&2
    exit 2
    ;;
esac
grep -h '"kind": "run"' "$OUT/$PART"-*.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['batch'], int(r['tokens_per_s']), r['device'], r['setting'])"
