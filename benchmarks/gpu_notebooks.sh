#!/usr/bin/env bash
# On the lent GPU machine (its own torch; the wheels it lacks carried in .whl/, see ../shared/tools/gpu-wheels):
# run every cell of the given notebooks, `#| cuda` and `#| slow` included, save their outputs into the notebooks,
# and copy the notebooks to $OUT so that the docs show the real GPU traces.
#   bash benchmarks/gpu_notebooks.sh nbs/03_heads.ipynb nbs/04_loss.ipynb ...
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))"
status=0
for nb in "$@"; do
  t=$SECONDS
  if nbdev-test --flags "cuda slow" --save "$nb"; then echo "PASSED $nb ($((SECONDS - t)) s)"; else echo "FAILED $nb"; status=1; fi
  cp "$nb" "${OUT:-/tmp}/" 2>/dev/null
done
exit $status
