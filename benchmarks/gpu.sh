#!/usr/bin/env bash
# The GPU checks, in one run on one CUDA GPU (the figures of docs/benchmarks.md's GPU section):
#   1. a LLaMA-7B block (S=2048, bf16) against transformers' layer: graph, CUDA-graph replay, and
#      inductor (Triton kernels, captured as a CUDA graph);
#      the same block at tiny dims (launch overhead);
#   2. greedy decoding of a 4-layer model of LLaMA-7B's widths against transformers' generate:
#      bf16 (graph and CUDA-graph replay) and f32 (CUDA-graph replay; ids must agree);
#   3. the gpu-marked tests (CUDA tensors, logical devices on one GPU, CUDA-graph replay,
#      generation token for token).
# Each step has its own time limit, so one that hangs leaves the others their figures.
#
#   benchmarks/gpu.sh [OUTDIR]      # default gpu-results; python3 (or $PYTHON) must import
#                                   # torch with CUDA, transformers, z3, pyparsing, safetensors
set -u
out=${1:-gpu-results}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/machine.txt" 2>&1

SEVEN_B=D=4096,H=32,KVH=32,F=11008,S=2048
timeout 240 $py benchmarks/block_kernels.py --device cuda --cases bf16-mha --modes graph,cudagraph,inductor \
    --dims "$SEVEN_B" --warmup 5 --repeat 20 > "$out/block.txt" 2>&1
echo "rc=$?" >> "$out/block.txt"
timeout 60 $py benchmarks/block_kernels.py --device cuda --cases f32-mha,bf16-mha --modes graph,cudagraph \
    --dims D=64,H=4,KVH=4,F=128,S=8 --warmup 5 --repeat 50 > "$out/block_tiny.txt" 2>&1
echo "rc=$?" >> "$out/block_tiny.txt"
timeout 200 $py benchmarks/models.py --part generate --device cuda --model 7b-width --dtype bf16 \
    --compile graph,cudagraph --repeat 5 > "$out/generate.txt" 2>&1
echo "rc=$?" >> "$out/generate.txt"
timeout 200 $py benchmarks/models.py --part generate --device cuda --model 7b-width --dtype f32 \
    --compile cudagraph --repeat 3 > "$out/generate_f32.txt" 2>&1
echo "rc=$?" >> "$out/generate_f32.txt"
timeout 150 $py -m pytest -q -p no:cacheprovider -m gpu tests > "$out/tests.txt" 2>&1
echo "rc=$?" >> "$out/tests.txt"
tail -n 3 "$out"/*.txt
