#!/usr/bin/env bash
# The prepared GPU check (`make gpu-check`): the GPU and its software, the CUDA-marked tests,
# every method decoding the embedded model on the GPU (`generate`), and `bench-decode` figures
# in bf16 (captured as CUDA graphs, the default on CUDA, and eager) and fp32.  It installs
# nothing: it runs on an installed .venv (`make install`, or one carried along) or on $PYTHON.
# Each step's output goes to the terminal and to $OUT/<step>.log (else build/gpu-check/), a
# PASS/FAIL line per step to summary.txt; a failed step does not stop the others, the exit
# status says whether any failed.
#
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_TOKENS=8 scripts/gpu_check.sh   # a dry run without a GPU
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-${VENV:-.venv}/bin/python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TOKENS=${GPU_CHECK_TOKENS:-64}
PROMPTS=${GPU_CHECK_PROMPTS:-3}
OUT_DIR=${OUT:-build/gpu-check}
DRAFT=data/draft/default
STOP_MODEL=data/export/stop_model.pt
PROMPT="Write a Python function that returns the n-th Fibonacci number."
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1

[ -d "$DRAFT" ] || DRAFT=layers:2
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
if ! "$PYTHON" -c "import specstop.pipeline.cli, torch" 2>/dev/null; then
    echo "gpu_check: $PYTHON cannot import specstop and torch (run 'make install' first)" >&2
    exit 2
fi

failed=0

# step NAME COMMAND...: run it, tee its output to NAME.log, record PASS/FAIL and the seconds
step() {
    local name=$1 start=$SECONDS status
    shift
    printf '\n=== %s: %s\n' "$name" "$*"
    "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || failed=1
    printf '%-26s %s (%ss)\n' "$name" "$([ "$status" -eq 0 ] && echo PASS || echo "FAIL rc=$status")" \
        "$((SECONDS - start))" | tee -a "$OUT_DIR/summary.txt"
}

specstop() { "$PYTHON" -m specstop.pipeline.cli "$@"; }

versions() {
    "$PYTHON" - <<'EOF'
import torch, transformers
from specstop.decoder.load import native_bf16, resolve_device
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, transformers {transformers.__version__}")
print(f"CUDA available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {props.name}, compute capability {props.major}.{props.minor}, "
          f"{props.total_memory / 2**30:.0f} GiB, native bf16 "
          f"{native_bf16(torch.device('cuda', i))}")
print(f"auto device: {resolve_device('auto')}")
EOF
}

gpu_info() {  # a dry run on the CPU needs none
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
    else
        echo "nvidia-smi: not found"
        [ "$DEVICE" = cpu ]
    fi
}

MODEL_FLAGS=(--device "$DEVICE" --draft "$DRAFT" --max-new-tokens "$TOKENS")

echo "gpu_check: device $DEVICE, draft $DRAFT, $TOKENS new tokens, outputs in $OUT_DIR"
step nvidia-smi gpu_info
step versions versions
step pytest-cuda "$PYTHON" -m pytest -q -s -m cuda -p no:cacheprovider tests
for method in ar sd mcsd ti-mcsd; do
    step "generate-$method" specstop generate --method "$method" --dtype bfloat16 \
        "${MODEL_FLAGS[@]}" --prompt "$PROMPT"
done
step generate-ti-mcsd-sampled specstop generate --method ti-mcsd --dtype bfloat16 \
    "${MODEL_FLAGS[@]}" --temperature 0.8 --top-p 0.95 --seed 1 --prompt "$PROMPT"
if [ -f "$STOP_MODEL" ]; then
    step generate-tree specstop generate --method tree --stop-model "$STOP_MODEL" \
        --dtype bfloat16 "${MODEL_FLAGS[@]}" --prompt "$PROMPT"
else
    echo "generate-tree              SKIP (no $STOP_MODEL)" | tee -a "$OUT_DIR/summary.txt"
fi
for run in "bfloat16 auto" "bfloat16 off" "float32 auto"; do
    read -r dtype compile <<< "$run"
    step "bench-decode-$dtype-compile-$compile" specstop bench-decode \
        --methods ar sd mcsd ti-mcsd --prompts "$PROMPTS" --dtype "$dtype" --compile "$compile" \
        "${MODEL_FLAGS[@]}"
done

printf '\n=== summary (%s)\n' "$OUT_DIR/summary.txt"
cat "$OUT_DIR/summary.txt"
exit "$failed"
