"""A young model's scores (issue 57): `lucid fit --data.imgsz 160 --data.batch_size 8 --trainer.max_epochs 3` on the
embedded data (36 steps from scratch) must score no validation detection above 0.1, as Ultralytics' yolo11n-seg
trained the same way scores none above 2e-4 (its EMA's highest class probability on the 32 validation images:
1.7e-4, the stride-32 class prior of `03_heads`).

Without clipping it scores every detection at exactly 1.0. The first batch's gradient has a norm of 8,700–44,600 at
seeds 0–2, 98.5–99.9 % of it from the mask term (Ultralytics' own gradients in the same run, before its clipping:
5,200–38,700 at its 9 steps). Unclipped SGD steps on it move the batch norms' biases (the bias group, lr 0.1 in the
warm-up) by up to 32 in 12 steps. Training mode normalises with each batch's own statistics and stays sane (class
logits at most −2.1, probabilities below 0.11), but the running statistics (momentum 0.03) trail the moving activations
by up to 34 of their standard deviations, so the network in eval mode, and the EMA (at 36 updates nearly the live
network, buffers included), saturates. Clipping the gradient norm at 10, as Ultralytics' trainer always does and
`--model.clip_grad_norm` does by default, keeps every score at the prior. The unclipped run is the control: it must
still saturate, or this test no longer shows what clipping buys."""
import json
from pathlib import Path

import pytest
from helpers import cli_main

YOUNG = ['--data.imgsz', '160', '--data.batch_size', '8', '--trainer.max_epochs', '3', '--trainer.accelerator', 'cpu',
         '--trainer.check_val_every_n_epoch', '3', '--trainer.enable_progress_bar', 'false',
         '--trainer.enable_model_summary', 'false', '--model.max_det', '20', '--seed_everything', '0']   # 20: validation's cost


def young_scores(tmp:Path, *extra:str)->list[float]:
    "Every score of the young model's last validation (`predictions.json`)."
    cli = cli_main(['fit', *YOUNG, '--trainer.default_root_dir', str(tmp), *extra])
    return [d['score'] for d in json.loads((Path(cli.trainer.log_dir) / 'predictions.json').read_text())]


@pytest.mark.slow
def test_a_young_model_scores_nothing_above_a_tenth(tmp_path):
    scores = young_scores(tmp_path)   # the defaults: clipped at 10
    assert max(scores, default=0.) <= 0.1, f"{sum(s > 0.1 for s in scores)} of {len(scores)} detections above 0.1, max {max(scores)}"


@pytest.mark.slow
def test_unclipped_young_model_saturates(tmp_path):
    "The control: the same run without clipping scores (nearly) every detection above 0.9."
    scores = young_scores(tmp_path, '--model.clip_grad_norm', '0')
    assert scores and sum(s > 0.9 for s in scores) >= 0.9 * len(scores), f"{sum(s > 0.9 for s in scores)} of {len(scores)} above 0.9"
