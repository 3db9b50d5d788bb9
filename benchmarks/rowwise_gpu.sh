#!/usr/bin/env bash
# Row-wise and block-wise scaled FP8 linear (FP8Config.linear_scaling, trainer key
# fp8_linear_scaling) on one GPU, within 9 minutes of wall clock:
#   1. the row-wise tests on the GPU (the producers' Pallas kernels compiled, the fused ops'
#      gradients, the cuBLASLt FP8 GEMMs of each scaling; the three-step trainer run, a
#      compile-bound CPU test, is left to the CPU);
#   2. benchmarks/rowwise_hlo.py: GEMMs and quantizing fusions of an RMSNorm + linear at a
#      Llama-2-7B MLP size per scaling, and the per-token maximum passes left over the row-wise
#      operands, producer and linear as two ops or fused (summary in run.log, the HLO in
#      hlo.tar.gz);
#   3. one Llama-2-7B decoder layer (benchmarks/bench_layer.py, the trainer's model with one
#      layer, seq 2048, each setting in its own process): the baseline (BF16, COAT per-tensor)
#      and the row-wise settings named by ROW_SETTINGS, fwd+bwd and the layer step with the
#      optimizer, plus each one's time split.
# ROW_SETTINGS (space-separated) picks the row-wise runs, default "row_pallas row_gw_hp_pallas":
#   row_xla           precision.fp8_linear_scaling=row, producers fused with their linears, the
#                     producers as XLA's fusions of the jnp references (the trainer's default);
#   row_pallas        the same with the producers' Pallas kernels (fp8_op_kernels
#                     rmsnorm_rowwise=pallas, swiglu_rowwise=pallas);
#   row_gw_hp_pallas  precision.fp8_linear_scaling=row_gw_hp with the producers' Pallas kernels;
#   block_xla         precision.fp8_linear_scaling=block, the block-scaled GEMMs as XLA's scan
#                     over the 128-wide blocks of the jnp reference (kernels.blockwise_gemm=xla);
#   block_pallas      the same with the Pallas block GEMM kernel (kernels.blockwise_gemm=pallas).
# The whole Llama-2-7B step (bench_e2e.py) is not run: BF16 with optax's float32 AdamW needs
# about 104 GiB for weights, gradients and moments, more than an 80 GiB card holds.
# COAT runs the FP8 options of its largest-batch setting that apply to one layer (FP8
# attention, E8M0 group scales, master weights re-quantized, fused SwiGLU, no clipping); the
# whole-model ones (optimizer in backward, chunked loss) have no meaning for one layer.
#
#   OUT=runs/rowwise bash benchmarks/rowwise_gpu.sh
#   SMOKE=1 OUT=/tmp/rowwise bash benchmarks/rowwise_gpu.sh   # the same commands, tiny, on a CPU
#
# Writes to $OUT (4 files): run.log, hlo.tar.gz, layer/layer.jsonl, layer.md. Every step has a
# timeout, cut to what is left of the budget; SKIP_TESTS=1 skips step 1.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/rowwise}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
LOG=$OUT/run.log
BUDGET_S=${BUDGET_S:-510}
ROW_SETTINGS=${ROW_SETTINGS:-row_pallas row_gw_hp_pallas}
START=$(date +%s)
HLO_SIZE=()
TINY=()
if [[ -n ${SMOKE:-} ]]; then
  HLO_SIZE=(--tokens 64 --hidden 32 --ffn 48)
  TINY=(--tiny)
  export COAT_JAX_PALLAS_INTERPRET=1  # the Pallas producers in interpret mode
fi

run_step() {  # run_step SECONDS COMMAND...: at most SECONDS, and never past the budget
  local limit=$1 left
  shift
  left=$((BUDGET_S - ($(date +%s) - START)))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "== skipped, budget spent: $*" >>"$LOG"
    return
  fi
  echo "== $(date -u +%H:%M:%S) (at most ${limit}s) $*" >>"$LOG"
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
  echo "== exit $?" >>"$LOG"
}

{
  echo "commit ${COMMIT:-$(git log --oneline -1)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} >>"$LOG" 2>&1

if [[ -z ${SKIP_TESTS:-} ]]; then
  run_step 150 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fp8_rowquant.py \
    tests/fp8/test_fp8_rowwise_fused.py tests/fp8/test_fp8_rowwise.py \
    tests/kernels/test_fp8_blockgemm.py tests/fp8/test_fp8_blockwise.py \
    -k "not trainer_runs_three_steps and not trainer_step_runs_twice"
fi
HLO=$(mktemp -d)
run_step 90 python3 benchmarks/rowwise_hlo.py --out "$HLO" "${HLO_SIZE[@]}"
tar -C "$HLO" -czf "$OUT/hlo.tar.gz" .

COAT=(--set precision.fp8_attention=true --set precision.fp8_group_scale=e8m0 --set precision.fp8_swiglu=fused
  --set optimizer.grad_clip=null)
PALLAS_PRODUCERS=(--set kernels.rmsnorm_rowwise=pallas
  --set kernels.swiglu_rowwise=pallas)
LAYER=(python3 benchmarks/bench_layer.py --batches 8 --reps 10 --warmup 2 --profile-reps 2
  --no-child-logs --weight-residual master --out-dir "$OUT/layer" "${TINY[@]}")
run_step 85 "${LAYER[@]}" --child-timeout-s 80 --modes coat "${COAT[@]}"
for setting in $ROW_SETTINGS; do
  case $setting in
    row_xla) extra=(--set precision.fp8_linear_scaling=row) ;;
    row_pallas) extra=(--set precision.fp8_linear_scaling=row "${PALLAS_PRODUCERS[@]}") ;;
    row_gw_hp_pallas) extra=(--set precision.fp8_linear_scaling=row_gw_hp "${PALLAS_PRODUCERS[@]}") ;;
    block_xla)
      extra=(--set precision.fp8_linear_scaling=block --set kernels.blockwise_gemm=xla)
      ;;
    block_pallas)
      extra=(--set precision.fp8_linear_scaling=block --set kernels.blockwise_gemm=pallas)
      ;;
    *)
      echo "== unknown ROW_SETTINGS entry $setting (row_xla, row_pallas, row_gw_hp_pallas," \
        "block_xla, block_pallas)" >>"$LOG"
      continue
      ;;
  esac
  run_step 85 "${LAYER[@]}" --child-timeout-s 80 --modes coat "${COAT[@]}" "${extra[@]}"
  if [[ $setting == "${ROW_SETTINGS%% *}" ]]; then  # BF16 between the FP8 runs, as before
    run_step 85 "${LAYER[@]}" --child-timeout-s 80 --modes bf16
  fi
done
# The table of whatever the layer runs recorded (seconds; outside the budget).
timeout 30 python3 benchmarks/bench_layer.py --report-only --out-dir "$OUT/layer" \
  --docs "$OUT/layer.md" >>"$LOG" 2>&1
echo "== done after $(($(date +%s) - START))s" >>"$LOG"
tail -n 40 "$OUT/layer.md"
