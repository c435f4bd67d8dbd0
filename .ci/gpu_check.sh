#!/bin/bash
# The CUDA path on one GPU: single-process training against the CPU run's losses, resume, mtk bench.
# Not run by CI (no GPU there). On a machine without transformers 5.24 / datasets, put their wheels
# (and dill, multiprocess) in .whl/ first; without .whl/ the installed packages are used.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >/dev/null 2>&1 || echo "mtk install failed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available())"
L() { timeout "$1" "${@:2}" 2>&1 | grep -E "^mtk|step [0-9]+ loss|Error|error|Traceback|median|tokens|peak|ratio" | grep -v Warning | tail -40; echo "== rc ${PIPESTATUS[0]}"; }
echo "## 1 finetune tp1 fp32 on CUDA, 10 steps (CPU: 5.580506 ... 4.504783)"
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml examples/finetune.py --max_steps 10 --output_dir /tmp/g1
echo "## 2 resume to 14 on CUDA"
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml examples/finetune.py --resume /tmp/g1/step_10 --max_steps 14 --output_dir /tmp/g1
echo "## 3 finetune tiny-qwen3-moe fp32 on CUDA, 6 steps (CPU: 5.596588 ... 4.903358), then bf16 (grouped matmul)"
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml examples/finetune.py --model tiny-qwen3-moe --max_steps 6 --output_dir /tmp/g3
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml --mixed_precision bf16 examples/finetune.py --model tiny-qwen3-moe --max_steps 6 --output_dir /tmp/g3b
echo "## 3c LoRA on the expert tensors (PEFT target_parameters, whole factors) on CUDA, fp32 then bf16 (CPU: 5.596588 ... 5.513254)"
LX="--model tiny-qwen3-moe --max_steps 6 --lora_r 4 --lora_target_parameters mlp.experts.gate_up_proj,mlp.experts.down_proj"
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml examples/finetune.py $LX --output_dir /tmp/g3c
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml --mixed_precision bf16 examples/finetune.py $LX --output_dir /tmp/g3d
echo "## 4 finetune bf16 on CUDA"
L 120 accelerate launch --config_file accelerate_configs/tp1.yaml --mixed_precision bf16 examples/finetune.py --max_steps 10 --output_dir /tmp/g4
echo "## 5 mtk bench TP1 on the GPU, fp32 against the plan, then bf16"
timeout 150 python3 -m mtk.cli.main bench --model bench-llama --tp 1 --dtype fp32 --batch 4 --seq 1024 --steps 5 --memory 2>&1 | grep -v -i warn | tail -14
timeout 150 python3 -m mtk.cli.main bench --model bench-llama --tp 1 --dtype bf16 --batch 8 --seq 2048 --steps 5 2>&1 | grep -v -i warn | tail -14
echo "## 6 where the fp32 step's peak goes (the allocator's trace; 2026-11-27 on an H200: planned 0.90x of max allocated)"
timeout 150 python3 examples/benchmarks/cuda_peak_allocations.py 2>&1 | grep -v -i warn | tail -16
