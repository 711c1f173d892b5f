#!/usr/bin/env bash
# The GPU check (issue 31) as one prepared run, for a machine where MLX runs on a GPU.
#
# On the lent GPU machine, from the checkout's root, after ../shared/gpu/prepare here
# (see DEVELOPERS' "Tools"): the first call copies .gpu/part_aa to /root/stage/; then
#     bash .gpu/install.sh && bash scripts/gpu_check.sh run step prefill batch memory chat
#     bash scripts/gpu_check.sh serve tests          (a later call, if device time is left)
# (carrying .gpu/extra too, when scripts/gpu_extra_wheels.sh wrote it: the wheels the
# serve step's client and the README's openai example need, installed first here).
# Steps, in the order given (default: all of them):
#   run        mlxkv run on the model: its compute row says what serves there (the attention way, the
#              layers compiled for decode after their check, the projections fused), and the workload's
#              figures
#   attention  scripts/bench_attention.py: one call of each shared-prefix attention way
#   step       scripts/bench_step.py: one decode step of the whole model, the kernel and mixed ways,
#              with the decode layers compiled and as written, against per-row copies and mlx-lm's
#              BatchGenerator (graph ops, CUDA kernels, host and wall ms)
#   prefill    the same for a prefill of the rows' own tokens over 4 prefixes (--phase prefill):
#              graph ops, host and wall ms, and the evaluations that wait for the device
#   batch      scripts/bench_batch.py --prefix-tokens 2048 at 1, 8 and 32 requests, each way
#              (and the shapes of the attention calls each asked cuDNN for: --fused-shapes)
#   memory     scripts/bench_memory.py --sizes 8,32 (peak memory against the floor, and the plan that
#              reached it), each way
#   memory-limit  the same with MLX's memory limit 128 MiB above idle (--memory-limit): whether the
#              operations queued ahead of the device hold the peak, and what bounding them costs
#              (not run unless named)
#   chat       scripts/bench_chat.py: shared prefixes against copies
#   serve      scripts/bench_serve.py --servers mlxkv,mlx-lm
#   sampled    the same at temperature 1, OpenAI's default (not run unless named)
#   json       scripts/bench_json.py --vocab 0: decoding held to JSON (masks found cold, then kept on
#              the device and stacked a step) against free decoding (not run unless named)
#   tests      the suite with pytest -n 12
# on the 722M bfloat16 Llama of the issue (written first: --model bench-llama-722m-bf16).
# Each step's output goes to $OUT/STEP.txt (and .json), its status and seconds to
# $OUT/log.txt, and its last lines to standard output, so a step cut off by its
# timeout still leaves what it printed. GPU_CHECK_MODEL and GPU_CHECK_QUICK=1 make
# a small dry run of it anywhere (the tests run one on the CPU); GPU_CHECK_WAYS names the
# shared-prefix attention ways batch and memory run beside the device's default (mixed stacked;
# the default on CUDA is kernel), and both run the default with its decode layers as written too
# (compile_decode=false); GPU_CHECK_WAYS=none runs the default alone (the must-show rows
# in the least device time: GPU_CHECK_WAYS=none bash scripts/gpu_check.sh batch memory chat serve);
# GPU_CHECK_WAY runs chat, serve and sampled with that way instead of the default (their outputs
# then named STEP-WAY). GPU_CHECK_ALSO adds runtimes to batch and memory, one a word, each
# KEY=VALUE[,KEY=VALUE...] of the runtime's options (e.g. GPU_CHECK_ALSO=prefill_chunk=2048,prefill_budget=4096:
# the CPU-tuned prefill settings against a GPU's launch-bound plans).
set -u
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export MLXKV_CACHE_DIR=${MLXKV_CACHE_DIR:-/tmp/mlxkv-cache} HF_HUB_OFFLINE=1
model=${GPU_CHECK_MODEL:-bench-llama-722m-bf16}
python=${PYTHON:-python3}
quick=${GPU_CHECK_QUICK:-0}
steps=${*:-run attention step prefill batch memory chat serve tests}
if [ -d .gpu/extra ] && ls .gpu/extra/*.whl > /dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile .gpu/extra/*.whl > "$out/extra.txt" 2>&1 \
    || echo "extra wheels: install failed (see extra.txt)" | tee -a "$out/log.txt"
fi

run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" >> "$out/log.txt"
  local start status
  start=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  status=$?
  echo "== $name: status $status in $(($(date +%s) - start)) s" | tee -a "$out/log.txt"
  tail -n 30 "$out/$name.txt"
}

"$python" -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$out/device.txt"
run model 300 "$python" -c "from mlxkv.default_model import model_path; print(model_path('$model'))"
model_dir=$(tail -n 1 "$out/model.txt")
if [ "$quick" = 1 ]; then
  settings=(--prefix-tokens 128 --settings 2x4 --rounds 1)
  requests=8
  sizes=(--sizes 2 --rounds 1)
  attention=(--quick --repeats 2 --warmup 1 --dtype float32 --heads 4 --kv-heads 2)
  step_options=(--rows 2 --prefix 128 --groups 2 --own 8 --steps 3 --warmup 1 --compile-decode both)
  prefill_options=(--rows 2 --prefix 128 --groups 2 --own 40 --steps 2 --warmup 1)
  json_options=(--rounds 1 --requests 2 --prompt-tokens 16 --max-tokens 6 --walks 1)
else
  settings=(--prefix-tokens 2048 --settings 1x64,8x48,32x48 --rounds 2)
  requests=64
  sizes=(--sizes 8,32 --rounds 2)
  attention=()
  step_options=(--rows 8,32 --prefix 2048 --steps 48 --ways kernel,mixed --compile-decode both)
  prefill_options=(--rows 8,32 --prefix 512 --groups 4 --own 96 --steps 8)
  json_options=(--rounds 2)
fi
ways=()
if [ "${GPU_CHECK_WAYS:-}" != none ]; then
  for way in ${GPU_CHECK_WAYS:-mixed stacked}; do ways+=(--also "prefix_attention=$way"); done
  ways+=(--also compile_decode=false)
fi
for also in ${GPU_CHECK_ALSO:-}; do ways+=(--also "$also"); done
way=${GPU_CHECK_WAY:-}
suffix=${way:+-$way}
chat_way=()
serve_way=()
if [ -n "$way" ]; then
  chat_way=(--prefix-attention "$way")
  serve_way=(--mlxkv-args "--prefix-attention $way")
fi
for step in $steps; do
  case $step in
    run) run run 180 "$python" -m mlxkv.cli run --model "$model_dir" --requests "$requests" --json "$out/run.json" ;;
    attention) run attention 180 "$python" scripts/bench_attention.py "${attention[@]}" --json "$out/attention.json" ;;
    step) run step 240 "$python" scripts/bench_step.py --model "$model" "${step_options[@]}" --json "$out/step.json" ;;
    prefill) run prefill 240 "$python" scripts/bench_step.py --phase prefill --model "$model" "${prefill_options[@]}" --json "$out/prefill.json" ;;
    batch) run batch 300 "$python" scripts/bench_batch.py --model "$model" "${settings[@]}" "${ways[@]}" --fused-shapes --json "$out/batch.json" ;;
    memory) run memory 240 "$python" scripts/bench_memory.py --model "$model" "${sizes[@]}" "${ways[@]}" --json "$out/memory.json" ;;
    memory-limit) run memory-limit 180 "$python" scripts/bench_memory.py --model "$model" "${sizes[@]}" --memory-limit 128 --json "$out/memory-limit.json" ;;
    chat) run "chat$suffix" 180 "$python" scripts/bench_chat.py --model "$model" --rounds 2 "${chat_way[@]}" --json "$out/chat$suffix.json" ;;
    serve) run "serve$suffix" 300 "$python" scripts/bench_serve.py --servers mlxkv,mlx-lm --model "$model" --rounds 1 "${serve_way[@]}" --json "$out/serve$suffix.json" --logs "$out/serve$suffix-logs" ;;
    sampled) run "sampled$suffix" 300 "$python" scripts/bench_serve.py --servers mlxkv,mlx-lm --model "$model" --rounds 1 --temperature 1 "${serve_way[@]}" --json "$out/sampled$suffix.json" ;;
    json) run json 240 "$python" scripts/bench_json.py --model "$model" --vocab 0 "${json_options[@]}" --json "$out/json.json" ;;
    tests) run tests 420 "$python" -m pytest -n 12 -p no:benchmark -q --timeout 120 -p no:cacheprovider ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done
