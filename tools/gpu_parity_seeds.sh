#!/usr/bin/env bash
# The multi-seed loss-parity protocol at the GPU preset, the evidence behind scale_blocks="auto"
# on Hopper (moe_mxfp8.backend.HOPPER_AUTO_SCALE_BLOCKS): BF16 vs MXFP8 1x32 vs 1x128 over SEEDS
# seeds, --deterministic, into $OUT (summary.json, loss.csv, loss.png, verdict.txt, runs.tar.gz
# with every run's log.csv and run.json, seed<S>.txt per training process).
#   one GPU:  run carry=[".devsite"] command: STEPS=250 bash tools/gpu_parity_seeds.sh
#   3+ GPUs:  run kind=nvidia-h100-x4 carry=[".devsite"] command: bash tools/gpu_parity_seeds.sh
# With several GPUs each seed trains on its own GPU (`parity --only-seed`), then one `--resume`
# compares the finished runs. Time on an H100 (1000-step runs, evaluation included: BF16 111 s,
# 1x128 138 s, 1x32 about 154 s) is about 0.40 s x STEPS + 45 s of set-up per seed's three
# runs: one GPU, 3 seeds, STEPS=250 about 7.5 minutes; one seed per GPU, STEPS=1000 (the preset's
# length) about 8 minutes. The deterministic attention backward may cost a little more
# (tools/determinism_bisect.py --time-modes measures it): lower STEPS if the first run says so.
# Env: SEEDS (3), STEPS (1000 with a GPU per seed, else 250), RECIPES (1x32,1x128), EXTRA (more
# parity options), TRAIN_BUDGET_S (480: the training's time limit).
set -uo pipefail
source tools/device_prelude.sh name,driver_version
SEEDS="${SEEDS:-3}"
RECIPES="${RECIPES:-1x32,1x128}"
NGPU=$(nvidia-smi -L | wc -l)
if [ "$NGPU" -ge "$SEEDS" ]; then STEPS="${STEPS:-1000}"; else STEPS="${STEPS:-250}"; fi
RUN=/tmp/parity_seeds
rm -rf "$RUN"
ARGS=(--device cuda --preset gpu --steps "$STEPS" --seeds "$SEEDS" --recipes "$RECIPES"
      --deterministic --log-every 100 --out "$RUN" ${EXTRA:-})
echo "== $SEEDS seeds x (bf16, $RECIPES), $STEPS steps, $NGPU GPU(s)"
if [ "$NGPU" -ge 2 ]; then
  # one seed per GPU, in rounds of NGPU
  for ((first = 0; first < SEEDS; first += NGPU)); do
    pids=()
    for ((s = first; s < SEEDS && s < first + NGPU; s++)); do
      # --resume: every process may find --out already made by another
      CUDA_VISIBLE_DEVICES=$((s - first)) timeout "${TRAIN_BUDGET_S:-480}" \
        python -m train_example.parity "${ARGS[@]}" --only-seed "$s" --resume \
        > "$OUT/seed$s.txt" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; echo "process $p rc=$? (${SECONDS}s)"; done
  done
  timeout 120 python -m train_example.parity "${ARGS[@]}" --resume 2>&1 | tee "$OUT/verdict.txt"
else
  timeout "${TRAIN_BUDGET_S:-480}" python -m train_example.parity "${ARGS[@]}" 2>&1 \
    | tr '\r' '\n' | tee "$OUT/seed_all.txt" | grep -E "^PARITY|^wrote|^error|===" \
    | tee "$OUT/verdict.txt"
fi
echo "protocol rc=${PIPESTATUS[0]} (${SECONDS}s)"
tail -3 "$OUT"/seed*.txt 2>/dev/null | cut -c1-200
cp "$RUN"/summary.json "$RUN"/loss.csv "$RUN"/loss.png "$OUT/" 2>/dev/null
(cd "$RUN" && tar -czf "$OUT/runs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' .)
ls -la "$OUT"
