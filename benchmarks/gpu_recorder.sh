#!/usr/bin/env bash
# The recorder's GPU evidence on the lent machine (its own torch; missing wheels carried in .whl/):
#   bash benchmarks/gpu_recorder.sh tests      # pytest -m cuda (recorder + optimiser graph tests)
#   bash benchmarks/gpu_recorder.sh notebook   # the #| cuda cells of 06_recorder, outputs saved, notebook -> $OUT
#   bash benchmarks/gpu_recorder.sh profile    # per-part step profile, native and replay, batch 4 and 16 (profile4: batch 4)
#   bash benchmarks/gpu_recorder.sh validation # one validation epoch of the reference run under cProfile
#   bash benchmarks/gpu_recorder.sh pairs4x5   # reference benchmark: 5 alternating native/replay processes at batch 4
#   bash benchmarks/gpu_recorder.sh optim4x3   # 3 rounds of native, head, head+optim (the seed's configuration) at batch 4
# Results go to $OUT/results (copy them into benchmarks/results/). Export LUCID_NB_COMMIT=<commit> first: the copied
# tree's .git is stale on that machine, and env_info() records this value.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null || exit 1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))"
status=0
for stage in "$@"; do
  t=$SECONDS
  case $stage in
    tests) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_recorder_cuda.py tests/test_optim.py > "$OUT/results/pytest_cuda.log" 2>&1 || status=1; tail -5 "$OUT/results/pytest_cuda.log" ;;
    notebook) (cd nbs && nbdev-test --flags "cuda slow" --save 06_recorder.ipynb) || status=1; cp nbs/06_recorder.ipynb "$OUT/" ;;
    diag) python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/test_recorder_cuda.py -k empty_image > "$OUT/results/pytest_cuda_empty_image.log" 2>&1; tail -3 "$OUT/results/pytest_cuda_empty_image.log" ;;
    validation) python3 benchmarks/profile_validation.py --out "$OUT/results" -- --data.workers 4 2>&1 | grep -v Warning | head -60 || status=1 ;;
    profile4) python3 benchmarks/profile_step.py --batch-size 4 --out "$OUT/results" | tail -3 || status=1
              python3 benchmarks/profile_step.py --batch-size 4 --capture --out "$OUT/results" | tail -3 || status=1 ;;
    profile) for b in 4 16; do
               python3 benchmarks/profile_step.py --batch-size $b --out "$OUT/results" | tail -22 || status=1
               python3 benchmarks/profile_step.py --batch-size $b --capture --out "$OUT/results" | tail -22 || status=1
             done ;;
    pairs*) b=${stage#pairs}; b=${b%x*}; n=${stage#*x}
            python3 benchmarks/recorder_pairs.py --pairs "$n" --batch-size "$b" --out "$OUT/results" \
              --previous "benchmarks/results/recorder_pairs_b${b}_nvidia-h200.json" -- --data.workers 4 --trainer.deterministic warn || status=1 ;;
    optim*) b=${stage#optim}; b=${b%x*}; n=${stage#*x}
            python3 benchmarks/recorder_pairs.py --pairs "$n" --batch-size "$b" --arms native head head+optim --out "$OUT/results" \
              --previous "benchmarks/results/recorder_pairs_b${b}_head_head+optim_nvidia-h200.json" -- --data.workers 4 --trainer.deterministic warn || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
  echo "== $stage: $((SECONDS - t)) s"
done
exit $status
