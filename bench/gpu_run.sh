#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md in one run (not a test; it prints numbers). On a machine with one CUDA GPU:
#
#   bench/gpu_run.sh LLADA_DIR FAST_DLLM_DIR REFERENCE_PYTHON [LOG_DIR]
#
# LLADA_DIR and FAST_DLLM_DIR are checkouts of ML-GSAI/LLaDA and NVlabs/Fast-dLLM (fetched by you, never vendored);
# REFERENCE_PYTHON runs them (torch with CUDA and transformers 4.46, which Fast-dLLM's model code needs). In order
# of importance, each under its own time limit so that one slow part leaves the rest: CUDA graphs against the eager
# forward for every dense fixture and algorithm (same tokens?), a worker serving over HTTP with graphs against one
# without, DiffusionGemma against its reference (and its decoder pass in graphs against eager), the same-run
# comparison with the reference code with graphs (5.4M parameters, the reference eager: its torch.compile of
# attention recompiles for minutes per shape on a fresh GPU machine), graphs at the LLaDA-8B shape, the host's
# share of a step for every algorithm, the reference comparison with our eager forward and with both sides on the
# math attention kernel (are the bfloat16 tokens then identical? they were not on 2026-11-26), one forward at the
# 8B shape (eager against a CUDA graph), our eager engine there, and the comparison at 0.8B parameters. About 12
# minutes in all on an H200 (the parts timed on 2026-11-26; the first four took about 4); ONLY=name,name runs just
# those parts (the logs' file names).
set -u
llada=$1 fast=$2 refpy=$3 logs=${4:-/tmp/dllm-gpu-run}
py=${PYTHON:-python3}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

part() {            # part NAME SECONDS COMMAND...: run it, log it, say how it ended (ONLY=a,b: just those parts)
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
    echo "== $name ($limit s at most): $*"
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$logs/$name.log"
    echo "== $name: exit $rc"
}

# the server's own dependencies, where the GPU image lacks them (orjson, pydantic): wheels in .whl/serve, fetched
# beforehand with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64
# -d .whl/serve orjson pydantic pydantic_core annotated-types typing-inspection typing_extensions`
if [ -d .whl/serve ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve-site \
        .whl/serve/*.whl && export PYTHONPATH=/tmp/serve-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$py -c "import torch, transformers; print('ours: torch', torch.__version__, 'transformers', transformers.__version__)"
$refpy -c "import torch, transformers; print('reference: torch', torch.__version__, 'transformers', transformers.__version__)"
# CUDA graphs (worker/engine/graphs.py): the same tokens as eager for every dense family and algorithm, and the time
part graphs_fixtures "${GRAPHS_LIMIT:-90}" $py bench/graphs_bench.py --device cuda
# a worker serving with its defaults (graphs on) against --no-cuda-graphs, through HTTP (needs the server's deps)
part serve_check "${SERVE_LIMIT:-120}" $py bench/gpu_serve_check.py --log-dir "$logs"
# DiffusionGemma against transformers' own generate, and with its decoder pass in CUDA graphs against ours eager
# (bfloat16: in float32 its experts' grouped_mm takes torch's fallback, which reads the group offsets on the host, so
# the decoder pass stays eager there)
part diffusion_gemma "${DG_LIMIT:-200}" $py bench/diffusion_gemma_bench.py --device cuda --dtype bfloat16 --cuda-graphs
part reference_5m_graphs "${REF_LIMIT:-150}" $py bench/reference_bench.py --llada "$llada" --fast-dllm "$fast" \
    --reference-python "$refpy" --device cuda --rounds 2 --reference-eager --cuda-graphs
part graphs_8b "${GRAPHS_LIMIT:-90}" $py bench/graphs_bench.py --device cuda --shape llada-8b \
    --algorithms basic,dual_cache --batch 1 --gen-length 64 --block-length 32
part engine_8b_dual_graphs "${E8_LIMIT:-75}" $py bench/engine_bench.py --shape llada-8b --device cuda --prompt-len 32 \
    --gen-length 256 --block-length 32 --steps 256 --algorithm dual_cache --threshold 0.9 --batch-sizes 1,16 \
    --warmup 1 --cuda-graphs
# (--device-ms 10: also the host time a step adds to a device whose forward takes 10 ms, about LLaDA-8B's with graphs)
part host_overhead "${HOST_LIMIT:-200}" $py bench/host_overhead_bench.py --device cuda --batch 32 --reps 2 --ops \
    --compare-uploads --device-ms 10
part reference_5m "${REF_LIMIT:-200}" $py bench/reference_bench.py --llada "$llada" --fast-dllm "$fast" \
    --reference-python "$refpy" --device cuda --rounds 3 --reference-eager
# the bfloat16 tokens differed on the GPU with each side's own attention kernels: the same with the same kernels
part reference_5m_sdpa_math "${SDPA_LIMIT:-90}" $py bench/reference_bench.py --llada "$llada" --fast-dllm "$fast" \
    --reference-python "$refpy" --device cuda --rounds 1 --reference-eager --sdpa math
part reference_5m_sdpa_ref "${SDPA_LIMIT:-90}" $py bench/reference_bench.py --llada "$llada" --fast-dllm "$fast" \
    --reference-python "$refpy" --device cuda --rounds 1 --reference-eager --sdpa reference
part forward_8b "${FWD_LIMIT:-60}" $py bench/forward_bench.py --shape llada-8b --device cuda
part engine_8b_basic "${E8_LIMIT:-75}" $py bench/engine_bench.py --shape llada-8b --device cuda --prompt-len 32 \
    --gen-length 256 --block-length 32 --steps 256 --batch-sizes 1 --warmup 1
part engine_8b_dual "${E8_LIMIT:-75}" $py bench/engine_bench.py --shape llada-8b --device cuda --prompt-len 32 \
    --gen-length 256 --block-length 32 --steps 256 --algorithm dual_cache --threshold 0.9 --batch-sizes 1,16 --warmup 1
part reference_1b "${REF1B_LIMIT:-120}" $py bench/reference_bench.py --llada "$llada" --fast-dllm "$fast" \
    --reference-python "$refpy" --device cuda --rounds 1 --shape 1b --only 1,4,5 --reference-eager
