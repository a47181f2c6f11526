"""Lightning, Accelerate, the HF Trainer and torch's DDP with scale_loss under kaitianrun.

The examples, and scripts written as each trainer's users write them
(trainer_scripts/), run with 2 ranks in 2 simulated vendor groups (backend
kaitian) and log every rank's batches per optimizer step; one
process then trains on the same global batches, and the weights must agree
(fp64, 1e-9). Most runs take a 5:1 split of 473 samples: 14 steps of [27, 5]
and a short last one whose sizes are not in that ratio ([21, 4]), and a split
change mid-epoch where the script builds its own sampler, so that a loss
weighted by another batch's size (a loader that draws ahead) is caught.
"""

import json
import os
import subprocess
import sys

import pytest

from kaitian.training.capability import write_config
from support import REPO, repo_env
from support.replay import logged_batches, logged_micro_batches, max_difference, replay_weights


EXAMPLES = os.path.join(REPO, "examples")
USER_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_scripts")
# 5:1 of a global batch of 32 over 473 samples, re-split to [20, 12] from the 8th batch on
UNEVEN = ["--capabilities", "5,1", "--samples", "473"]
RESPLIT = ["--resplit", "7:20,12"]


def _run_example(tmp_path, script, *args, timeout=240, folder=EXAMPLES, quota="1,1"):
    """Two ranks in two groups. The splits are given, so the groups run at full
    speed unless ``quota`` slows one (a re-balancing run): a slowed rank takes five
    times as long to start, which only lengthens CI."""
    logs = tmp_path / "batches"
    logs.mkdir()
    weights = tmp_path / "weights.json"
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "2", "--cpu-groups", "2",
           "--cpu-quota", quota, os.path.join(folder, script), "--capabilities", "3,1",
           "--log-batches", str(logs), "--save", str(weights), *args]
    env = repo_env()
    env["PYTHONPATH"] = os.pathsep.join([EXAMPLES, env["PYTHONPATH"]])  # the scripts' `common`
    # a `kaitian init` config: the scripts that pass no capabilities start from a 3:1 split too
    config = tmp_path / "config.toml"
    write_config({"version": 1, "devices": {
        f"cpu:{g}": {"vendor": "cpu", "index": g, "name": f"slot {g}", "capability": c}
        for g, c in ((0, 3000.0), (1, 1000.0))}}, str(config))
    env["KAITIAN_CONFIG"] = str(config)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return json.loads(weights.read_text()), str(logs), out


def _first_and_last_steps(logs):
    """Per rank: the sizes of the first step and of the first epoch's short last step (the 15th)."""
    steps = logged_batches(logs, 2)
    return [len(steps[0][0]), len(steps[1][0])], [len(steps[0][14]), len(steps[1][14])]


def test_lightning_strategy_matches_one_process(tmp_path):
    pytest.importorskip("lightning")
    trained, logs, _ = _run_example(tmp_path, "lightning_train.py", *UNEVEN)
    first, last = _first_and_last_steps(logs)
    assert first == [27, 5] and sum(last) == 25, (first, last)
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1, samples=473)) < 1e-9


def test_accelerate_matches_one_process(tmp_path):
    """The look-ahead of Accelerate's loader: each loss weighted by its own batch, not the next."""
    pytest.importorskip("accelerate")
    trained, logs, _ = _run_example(tmp_path, "accelerate_train.py", *UNEVEN, *RESPLIT)
    steps = logged_batches(logs, 2)
    assert [[len(rank[s]) for rank in steps] for s in (0, 6, 7, 13, 14)] == [[27, 5]] * 2 + [[20, 12]] * 2 + [[16, 9]]
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1, samples=473)) < 1e-9


def test_hf_trainer_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    trained, logs, _ = _run_example(tmp_path, "hf_trainer_train.py", *UNEVEN)
    first, last = _first_and_last_steps(logs)
    assert first == [27, 5] and last == [21, 4], (first, last)
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1, samples=473)) < 1e-9


def test_scale_loss_without_count_under_a_loader_with_workers(tmp_path):
    """torch's DDP, scale_loss(loss, sampler=s) and DataLoader(num_workers=2), which draws ahead."""
    trained, logs, _ = _run_example(tmp_path, "scale_loss_workers.py", *UNEVEN, *RESPLIT, folder=USER_SCRIPTS)
    steps = logged_batches(logs, 2)
    assert [[len(rank[s]) for rank in steps] for s in (6, 7, 14)] == [[27, 5], [20, 12], [16, 9]]
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1, samples=473)) < 1e-9


def _every_sample_once_per_epoch(logs, epochs=2, n=480):
    seen = sorted(i for rank in logged_batches(logs, 2) for step in rank for i in step)
    assert seen == sorted(list(range(n)) * epochs)


def test_accelerate_accumulation_steps_at_the_loader_end(tmp_path):
    """A user's accumulate() loop over 15 micro-batches an epoch (the last one short, a split change
    mid-epoch): the steps stock Accelerate takes (7 windows of 2, one of 1, per epoch), each the
    window mean with total="window" (no batch drawn ahead), or what Accelerate gives in one
    process without it (a second model on the same batches); gather_for_metrics on kaitian's own
    loader (uneven batches, a padded last step) and on a loader Accelerate shards gives every
    sample once, as without kaitian."""
    pytest.importorskip("accelerate")
    window, logs, out = _run_example(tmp_path, "accelerate_accumulate.py", *UNEVEN, *RESPLIT, folder=USER_SCRIPTS)
    micro = json.loads((tmp_path / "weights.json.micro").read_text())
    for line in ("epoch 0 gathered each sample once: True", "epoch 1 gathered each sample once: True",
                 "evaluated each sample once: True", "padded loader gathered each sample once: True"):
        assert line in out, out[-3000:]
    micros = logged_micro_batches(logs, 2)
    assert [len(rank) for rank in micros] == [16, 16]
    assert [[len(m) for m in step] for step in micros[0][:8]] == [[27, 27]] * 3 + [[27, 20]] + [[20, 20]] * 3 + [[16]]
    _every_sample_once_per_epoch(logs, n=473)
    window_mean = replay_weights(logs, 2, lr=0.1, samples=473)
    per_micro_batch = replay_weights(logs, 2, lr=0.1, samples=473, accumulation=2)
    assert max_difference(window, window_mean) < 1e-9
    assert max_difference(micro, per_micro_batch) < 1e-9
    assert max_difference(window_mean, per_micro_batch) > 1e-6  # the two rules differ on these windows


@pytest.mark.parametrize("package, accumulate", [("lightning", 1), ("pytorch_lightning", 5)])
def test_lightning_plain_dataloader_is_sharded_by_kaitian(tmp_path, package, accumulate):
    """DataLoader(ds, batch_size=20, shuffle=True), devices="auto": kaitian's sampler is
    injected (12 micro-batches of 40 an epoch, every sample once), re-balanced to the slow
    rank. accumulate_grad_batches=5: windows of 5, 5 and a short last one of 2, each the
    step Lightning takes in one process (every micro-batch loss divided by 5)."""
    pytest.importorskip(package)
    trained, logs, _ = _run_example(tmp_path, "lightning_plain_loader.py", "--package", package,
                                    "--batch-size", "20", "--accumulate", str(accumulate), folder=USER_SCRIPTS,
                                    quota="1,0.2")
    steps = logged_batches(logs, 2)
    windows = [min(accumulate, 12 - start) for start in range(0, 12, accumulate)] * 2
    assert [len(a) + len(b) for a, b in zip(*steps)] == [40 * w for w in windows]
    _every_sample_once_per_epoch(logs)
    replay = replay_weights(logs, 2, lr=0.1, accumulation=accumulate)
    assert max_difference(trained, replay) < 1e-9


def test_hf_trainer_accumulation_max_steps_and_resume_on_backend_kaitian(tmp_path):
    """TrainingArguments built before KaitianTrainer; gradient_accumulation_steps=2, max_steps
    4, then resumed from its checkpoint to 10: the steps the Trainer takes in one process."""
    pytest.importorskip("transformers")
    trained, logs, out = _run_example(tmp_path, "hf_accumulate_resume.py", folder=USER_SCRIPTS)
    assert out.count("backend kaitian") == 4, [line for line in out.splitlines() if "backend" in line]
    steps = logged_batches(logs, 2)
    assert [len(step[0]) + len(step[1]) for step in zip(*steps)] == [64] * 7 + [32] + [64] * 2
    seen = sorted(i for rank in steps for step in rank[:8] for i in step)
    assert seen == list(range(480))  # the first epoch: every sample once, resume included
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1)) < 1e-9


def test_lightning_refuses_a_loader_whose_batches_kaitian_cannot_draw():
    pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, WeightedRandomSampler

    from kaitian.errors import TrainingError
    from kaitian.lightning import _with_kaitian_sampler

    loader = DataLoader(list(range(8)), batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(TrainingError, match="sampler WeightedRandomSampler decides its batches.*batch_size=B"):
        _with_kaitian_sampler(loader, seed=0)


def test_accelerate_refuses_split_batches_for_kaitian_loader():
    pytest.importorskip("accelerate")
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    import kaitian
    from kaitian.accelerate import Accelerator
    from kaitian.errors import TrainingError

    data = list(range(8))
    loader = DataLoader(data, batch_sampler=kaitian.DistributedSampler(data, batch_size=4).batch_sampler())
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
    with pytest.raises(TrainingError, match="split_batches=True would cut kaitian's per-rank batches"):
        accelerator.prepare(loader)


def test_lightning_window_replay_is_lightning_in_one_process():
    """The replay the Lightning runs are held to: with accumulate_grad_batches=5 over 12
    micro-batches of 40 (a short last window of 2), one-process Lightning gives exactly
    it, and not the window mean."""
    L = pytest.importorskip("pytorch_lightning")
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from support.replay import examples_common, train_on_steps

    common = examples_common()
    dataset = common.make_dataset()
    perm = torch.randperm(480, generator=torch.Generator().manual_seed(7)).tolist()
    batches = [perm[i:i + 40] for i in range(0, 480, 40)]

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = common.make_model()

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Regressor()
    L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_epochs=2, accumulate_grad_batches=5,
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module, DataLoader(dataset, batch_sampler=batches))
    lightning = [p.detach().reshape(-1).tolist() for p in module.net.parameters()]
    steps = [[batches[start:start + 5] for _ in range(2) for start in range(0, 12, 5)]]
    x, y, _ = dataset.tensors
    replay = train_on_steps(steps, x, y, common.make_model(), 0.1, 0.0, accumulation=5)
    assert max_difference(lightning, replay) < 1e-9
    assert max_difference(lightning, train_on_steps(steps, x, y, common.make_model(), 0.1, 0.0)) > 1e-3
