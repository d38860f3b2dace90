#!/usr/bin/env bash
# Runs GPU benchmark stages on the device machine; each prints one JSON line into $OUT/results.jsonl.
#   bash bench/gpu.sh setup trainer_gpt2 trainer_llama1b_z2 ... pack
# Every stage's whole output goes to $LOGS; the `pack` stage puts them into $OUT/logs.tgz (a device call
# returns at most 8 files). STEPS sets the steps of the Llama-1B trainer stages (default 30).
set -u
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/bench-logs}
STEPS=${STEPS:-30}
mkdir -p "$OUT" "$LOGS"
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {  # name timeout cmd...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.err"
  local rc=$?
  grep -h '^{"recipe"' "$LOGS/$name.out" | tee -a "$OUT/results.jsonl"
  [ $rc -eq 0 ] || { echo "$name exited $rc"; tail -c 1500 "$LOGS/$name.out"; tail -c 1500 "$LOGS/$name.err"; } | tee -a "$OUT/log.txt"
}
# trainer_llama1b <name> <zero> [flags…]: the Llama-3.2-1B shape with the job's defaults plus the flags.
trainer_llama1b() {
  local name=$1 zero=$2; shift 2
  run "$name" 500 python3 -m bench.run_trainer --model llama1b --zero "$zero" --steps "$STEPS" \
    --skip $((STEPS < 20 ? 4 : 8)) --log "$LOGS/$name.launcher.log" "$@"
}
L="python3 -m deepspeed.launcher.runner --num_gpus 1"
for stage in "$@"; do
  case $stage in
    setup)
      # Carried wheels the machine lacks; peft and accelerate only where it has none (they follow its transformers).
      wheels=()
      for w in .whl/*.whl; do
        dist=$(basename "$w" | cut -d- -f1)
        case $dist in peft|accelerate) python3 -c "import $dist" 2>/dev/null && continue ;; esac
        wheels+=("$w")
      done
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
      lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3)' | tee -a "$OUT/log.txt"
      python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)" | tee -a "$OUT/log.txt" ;;
    seed) run seed 400 $L bench/seed_recipe.py --steps 30 ;;
    hf_llama1b) run hf_llama1b 400 $L bench/hf_trainer_ref.py --model llama1b --micro 8 --steps 25 ;;
    trainer_gpt2) run trainer_gpt2 400 python3 -m bench.run_trainer --model gpt2 --steps 30 --label trainer_defaults ;;
    kernel_tests)  # the kernel plan against the stock model, on this GPU (the launched CPU test is left to CI)
      run kernel_tests 300 python3 -m pytest --noconftest -p no:cacheprovider -q -rs tests/test_kernels.py -k "not launched"
      tail -n 15 "$LOGS/kernel_tests.out" | tee -a "$OUT/log.txt" ;;
    kernel_bench) run kernel_bench 200 python3 -m bench.kernel_bench --micro 16 ;;
    trainer_llama1b_z2) trainer_llama1b trainer_llama1b_z2 2 ;;
    trainer_llama1b_z3) trainer_llama1b trainer_llama1b_z3 3 ;;
    trainer_llama1b_z2_torch) trainer_llama1b trainer_llama1b_z2_torch 2 --kernels torch --label trainer_kernels_torch ;;
    trainer_llama1b_z3_torch) trainer_llama1b trainer_llama1b_z3_torch 3 --kernels torch --label trainer_kernels_torch ;;
    profile_llama1b_z*)  # profile_llama1b_z<stage>[_torch]: where a step's GPU time goes, 3 profiled steps
      IFS=_ read -r _ _ z k <<< "$stage"
      run "$stage" 400 python3 -m deepspeed.launcher.runner --num_gpus 1 --module bench.profile_trainer \
        --model llama1b --zero "${z#z}" --kernels "${k:-auto}" --steps 9 --active 3 --table "$LOGS/$stage.table.txt" ;;
    pack) tar czf "$OUT/logs.tgz" -C "$LOGS" . && ls -la "$OUT" ;;
    trainer_llama1b_z3_compile) run trainer_llama1b_z3_compile 500 python3 -m bench.run_trainer --model llama1b --zero 3 --steps 30 --compile on ;;
    trainer_llama1b_z2_nocompile) run trainer_llama1b_z2_nocompile 500 python3 -m bench.run_trainer --model llama1b --zero 2 --steps 30 --compile off ;;
    trainer_llama1b_z2_fp16) run trainer_llama1b_z2_fp16 300 python3 -m bench.run_trainer --model llama1b --zero 2 --precision fp16 --steps 20 ;;
    trainer_llama1b_z2_flex) run trainer_llama1b_z2_flex 500 python3 -m bench.run_trainer --model llama1b --zero 2 --steps 30 --attn flex_attention ;;
    mem_*)  # mem_<model>_<z>_<offload>[_lora]: does a full step fit? (activation checkpointing, micro 1; MEM_EXTRA adds flags)
      IFS=_ read -r _ model z off lora <<< "$stage"
      extra="${MEM_EXTRA:-}"; [ "${lora:-}" = lora ] && extra="$extra --lora"
      run "$stage" "${MEM_LIMIT:-600}" python3 -m bench.run_trainer --model "$model" --zero "$z" --offload "$off" --ckpt --micro 1 \
        --global-batch 1 --seq 2048 --steps 4 --skip 2 --tokens 200000 --label memory $extra \
        --log "$LOGS/$stage.launcher.log" ;;
    full8b_bf16_z*)  # full8b_bf16_z<stage>: the Llama-3.1-8B shape, every parameter trained, optimizer adamw_bf16,
      # the job's defaults otherwise (micro batch by the probe), 1% of the documents held out; then the export is
      # loaded and its held-out loss compared with the trainer's last evaluation
      z=${stage#full8b_bf16_z}
      run "$stage" "${LIMIT8B:-430}" python3 -m bench.run_trainer --model llama8b --zero "$z" --optimizer adamw_bf16 \
        --steps "${STEPS8B:-12}" --skip 4 --tokens 2000000 --val-fraction 0.01 --label full8b_adamw_bf16 --reload \
        --log "$LOGS/$stage.launcher.log" --events "$LOGS/$stage.events.jsonl" ;;
    reload_llama1b)  # the Llama-3.2-1B shape with the job's defaults, 1% of the documents held out; the export
      # reloaded and its held-out loss compared with the trainer's last evaluation
      trainer_llama1b reload_llama1b 2 --val-fraction 0.01 --reload --label reload_1b \
        --events "$LOGS/reload_llama1b.events.jsonl" ;;
    pipeline_overhead)  # the pipeline engine at P = 1 against the plain engine: alternating rounds, then a profile
      run pipeline_overhead "${PIPE_LIMIT:-300}" python3 -m bench.pipeline_overhead --model llama1b --seq-len 2048 \
        --micro 4 --accum 4 --warmup 3 --steps 8 --repeats "${PIPE_REPEATS:-5}" --arms plain,pipe_whole,pipe \
        --profile --tables "$LOGS/pipeline-tables"
      grep -h '^{"round"\|^{"op_difference"' "$LOGS/pipeline_overhead.out" | tee -a "$OUT/log.txt" ;;
    oom_ladder_1b)  # micro 32 with stock modules (no fused loss: 128k-wide logits) runs out of memory; the ladder adapts
      run oom_ladder_1b 130 python3 -m bench.run_trainer --model llama1b --zero 2 --kernels torch --micro 32 \
        --on-oom adapt --steps 8 --skip 4 --label oom_ladder --events "$LOGS/oom_ladder_1b.events.jsonl" ;;
    curve_*)  # curve_<optimizer>: the Llama-3.2-1B shape on English text, CURVE_STEPS steps, eval every 25
      opt=${stage#curve_}
      run "$stage" "${CURVE_LIMIT:-560}" python3 -m bench.run_trainer --model llama1b --zero 2 --optimizer "$opt" --corpus stdlib \
        --seq 1024 --global-batch 8 --micro 8 --lr 1e-4 --warmup 30 --steps "${CURVE_STEPS:-300}" --skip 20 \
        --val-fraction 0.05 --eval-every 25 --label "curve_$opt" --events "$LOGS/$stage.events.jsonl" ;;
    checkpoint_stall)  # the Llama-3.2-1B shape, saves at steps 25 and 50 of STALL_STEPS (default 56), each upload
      # ending inside the window; STALL_MODES runs in turn (default beside,local), each measured against itself; the
      # store on tmpfs, since the scratch disk cannot hold two local checkpoints and two stored copies of 17 GB.
      # A mode MODE@N runs with the ranks' OMP_NUM_THREADS=N (unset: the trainer's own, trainer/threads.py).
      timeout "${STALL_LIMIT:-570}" python3 -m bench.checkpoint_stall --shape llama1b --store file \
        --store-root /dev/shm/ftstore --steps "${STALL_STEPS:-56}" --every 25 --skip 10 --window 18 --repeats 1 \
        --modes "${STALL_MODES:-beside,local}" --micro "${STALL_MICRO:-32}" \
        > "$LOGS/$stage.out" 2> "$LOGS/$stage.err"
      grep -h '^{"figure"' "$LOGS/$stage.out" | tee -a "$OUT/results.jsonl" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
