"""Tests of nsrnn_jax.grid: K vmapped models == K separate train.py runs."""

import dataclasses
import json
import math
import os

import jax
import numpy as np
import pytest

from configs import default
from nsrnn_jax import checkpointing
from nsrnn_jax import data
from nsrnn_jax import evaluate
from nsrnn_jax import grid
from nsrnn_jax import languages
from nsrnn_jax import loop
from nsrnn_jax import metrics as metrics_lib
from nsrnn_jax import train


def tiny_splits(config):
  """A small deterministic split of marked reversal (seeded by data_seed)."""
  lang = languages.get(config.task)
  rng = np.random.default_rng(config.data_seed)
  lengths = lang.valid_lengths(config.train_min_length, config.train_max_length)

  def batch():
    n = int(rng.choice(lengths))
    return np.array([lang.sample(n, rng) for _ in range(config.batch_size)],
                    np.int32)

  train_batches = [data.Batch(batch())
                   for _ in range(config.num_train_batches)]
  valid = []
  for _ in range(config.num_valid_batches):
    s = batch()
    valid.append(data.Batch(s, np.array([lang.log_prob(x) for x in s]),
                            lang.length_log_prob(s.shape[1])))
  lo, hi = config.train_min_length, config.train_max_length
  return data.Splits(config.task, tuple(lang.alphabet), config.data_seed, 0,
                     False, data.Split(train_batches, len(lengths), lo, hi),
                     data.Split(valid, len(lengths), lo, hi),
                     data.Split([], 0, lo, hi))


def tiny_grid_config():
  c = default.get_config()
  c.model = "lstm"
  c.batch_size = 2
  c.num_train_batches = 3
  c.num_valid_batches = 2
  c.train_min_length = 5
  c.train_max_length = 9
  c.max_epochs = 5
  c.test_min_length = 5
  c.test_max_length = 9
  c.run_test = False
  c.progress_bar = False
  # One padded shape for every batch: one compilation per step function
  # (compilation, not training, dominates these tiny runs).
  c.compile_strategy = "bucket"
  c.length_buckets = (9,)
  # Patience 0: stop on the first epoch without improvement. With these
  # seeds restart 0 stops after epoch 4 (lr 0.01) and 3 (lr 0.1), restart 1
  # runs to max_epochs = 5 (validation perplexity moves by >= 0.4% per
  # epoch, far from rounding, so the decisions are robust).
  c.early_stopping_patience = 0
  c.grid_learning_rates = (0.01, 0.1)
  c.num_restarts = 2
  return c


# ---------------------------------------------------------------------------
# Grid expansion, padding and selection.
# ---------------------------------------------------------------------------


def test_members_of_the_paper_grid():
  c = default.get_config()
  c.grid_learning_rates = (0.01, 0.005, 0.001, 0.0005)
  c.num_restarts = 5
  ms = grid.members(c)
  assert len(ms) == 20
  assert [m.index for m in ms] == list(range(20))
  assert [m.learning_rate for m in ms[:6]] == [0.01] * 5 + [0.005]
  # Restart r has its own data, parameters and batch order (paper: every
  # restart draws its own training and validation set); paired across LRs.
  assert [m.config.data_seed for m in ms[:5]] == [c.data_seed + r
                                                  for r in range(5)]
  assert ms[7].config.param_seed == ms[2].config.param_seed == c.param_seed + 2
  assert ms[7].config.shuffle_seed == c.shuffle_seed + 2
  assert ms[7].config.learning_rate == 0.005
  assert ms[7].subdir == os.path.join("lr_0.005", "restart_2")
  # The base config is not modified.
  assert c.learning_rate == default.get_config().learning_rate


def test_members_can_share_data():
  c = default.get_config()
  c.grid_learning_rates = (0.01,)
  c.num_restarts = 3
  c.grid_vary_data_seed = False
  assert {m.config.data_seed for m in grid.members(c)} == {c.data_seed}


def test_members_of_some_restarts_keep_their_seeds():
  c = default.get_config()
  c.grid_learning_rates = (0.01, 0.005)
  c.num_restarts = 5
  full = grid.members(c)
  c.grid_restart_ids = (3, 1)
  part = grid.members(c)
  assert [(m.learning_rate, m.restart) for m in part] == [
      (0.01, 1), (0.01, 3), (0.005, 1), (0.005, 3)]
  by_key = {(m.learning_rate, m.restart): m for m in full}
  for m in part:
    twin = by_key[(m.learning_rate, m.restart)]
    assert m.subdir == twin.subdir
    assert (m.config.data_seed, m.config.param_seed, m.config.shuffle_seed) == (
        twin.config.data_seed, twin.config.param_seed, twin.config.shuffle_seed)


@pytest.mark.parametrize("field,value,message", [
    ("grid_restart_ids", (5,), "grid_restart_ids"),
    ("grid_restart_ids", (1, 1), "grid_restart_ids"),
    ("grid_restart_ids", (-1,), "grid_restart_ids"),
    ("num_restarts", 0, "num_restarts"),
    ("num_restarts", -1, "num_restarts"),
    ("grid_learning_rates", (0.01, -1.0), "grid_learning_rates"),
    ("grid_learning_rates", (0.01, 0.01), "duplicates"),
    ("learning_rate_grid", (0.01, -1.0), "learning_rate_grid must be"),
])
def test_bad_grid_fields(field, value, message):
  c = default.get_config()
  c[field] = value
  with pytest.raises(ValueError, match=message):
    grid.members(c)


@pytest.mark.parametrize("argv", [["--config.learning_rate=0.003"],
                                  ["--workdir=w", "--config.learning_rate",
                                   "-1"]])
def test_command_line_refuses_the_learning_rate_the_grid_overwrites(argv):
  with pytest.raises(ValueError, match="--config.learning_rate_grid="):
    grid.check_command_line(["--config=configs/quick.py"] + argv)


def test_the_default_config_grids_every_restart_of_the_papers_rates():
  # configs/default.py declares the grid's fields, so the command line can
  # set them; () restart ids train every restart.
  c = default.get_config()
  members = grid.members(c)
  assert [(m.learning_rate, m.restart) for m in members] == [
      (lr, r) for lr in (0.01, 0.005, 0.001, 0.0005) for r in range(5)]
  c.grid_restart_ids, c.num_restarts = (2, 0), 3
  assert [m.restart for m in grid.members(c)] == [0, 2] * 4


def test_command_line_takes_the_grid_fields():
  argv = ["--config=configs/quick.py",
          "--config.grid_learning_rates=(0.003,)",
          "--config.learning_rate_grid=(0.003,)",
          "--config.num_restarts=2"]
  assert grid.check_command_line(argv) is None
  # The same check refuses the same command line once it also sets the
  # field the grid overwrites (after the grid's fields, which it passed).
  with pytest.raises(ValueError, match=r"^--config\.learning_rate: the grid"):
    grid.check_command_line(argv + ["--config.learning_rate=0.003"])


def test_stack_batches_pads_each_member_with_a_zero_mask():
  a = np.array([[1, 2, 0]], np.int32)
  b = np.array([[2, 2, 2, 1, 0]], np.int32)
  batch = loop.stack_batches([a, b])
  np.testing.assert_array_equal(batch["symbols"],
                                [[[1, 2, 0, 0, 0]], [[2, 2, 2, 1, 0]]])
  np.testing.assert_array_equal(batch["mask"],
                                [[[1, 1, 1, 0, 0]], [[1, 1, 1, 1, 1]]])
  assert loop.stack_batches([a, b], padded_to=7)["symbols"].shape == (2, 1, 7)
  with pytest.raises(ValueError, match="batch_size"):
    loop.stack_batches([a, np.zeros((2, 3), np.int32)])


def test_select_best_lowest_mean_then_lowest_std():
  settings = [{"learning_rate": 1.0, "mean": 0.2, "std": 0.0},
              {"learning_rate": 2.0, "mean": 0.1, "std": 0.5},
              {"learning_rate": 3.0, "mean": 0.1, "std": 0.3},
              {"learning_rate": 4.0, "mean": float("nan"), "std": 0.0}]
  assert grid.select_best(settings)["learning_rate"] == 3.0
  assert grid.select_best(settings[:1] + settings[3:])["learning_rate"] == 1.0
  with pytest.raises(ValueError):
    grid.select_best([])


def test_summarize_grid_means_and_stds():
  c = default.get_config()
  c.grid_learning_rates = (0.01, 0.001)
  c.num_restarts = 3
  ms = grid.members(c)
  values = [0.3, 0.1, 0.2, 0.05, 0.5, 0.3]
  results = [{"best_valid_ce_diff": v, "best_epoch": i + 1}
             for i, v in enumerate(values)]
  summary = grid.summarize_grid(ms, results)
  by_lr = {s["learning_rate"]: s for s in summary["settings"]}
  assert math.isclose(by_lr[0.01]["mean"], 0.2)
  assert math.isclose(by_lr[0.001]["mean"], 0.85 / 3)
  assert math.isclose(by_lr[0.01]["std"], np.std([0.3, 0.1, 0.2]))
  assert by_lr[0.001]["best_epochs"] == [4, 5, 6]
  assert summary["best"]["learning_rate"] == 0.01
  assert "0.01*" in grid.format_summary(summary)


# ---------------------------------------------------------------------------
# The vmapped grid against separate runs.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grid_and_separate_runs(tmp_path_factory):
  config = tiny_grid_config()
  ms = grid.members(config)
  splits = [tiny_splits(m.config) for m in ms]
  grid_dir = str(tmp_path_factory.mktemp("grid"))
  summary = grid.run_grid(config, grid_dir, splits=splits)
  single_dirs = []
  for m, s in zip(ms, splits):
    d = str(tmp_path_factory.mktemp(f"single{m.index}"))
    train.train_and_evaluate(m.config, d, splits=s)
    single_dirs.append(d)
  return config, ms, splits, grid_dir, summary, single_dirs


def _records(path):
  return [r for r in metrics_lib.read_jsonl(os.path.join(path, "metrics.jsonl"))
          if "valid_perplexity" in r]


def _restore(directory, target):
  manager = checkpointing.make_manager(directory, keep=2)
  try:
    return checkpointing.restore_latest(manager, target)[1]
  finally:
    checkpointing.close(manager)


def test_grid_metrics_equal_separate_runs(grid_and_separate_runs):
  _, ms, _, grid_dir, _, single_dirs = grid_and_separate_runs
  epochs = []
  for m, single in zip(ms, single_dirs):
    got = _records(os.path.join(grid_dir, m.subdir))
    want = _records(single)
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want]
    epochs.append(len(got))
    for g, w in zip(got, want):
      for key in ("train_loss", "valid_perplexity", "valid_ce_diff",
                  "learning_rate", "next_learning_rate"):
        assert g[key] == pytest.approx(w[key], rel=2e-5, abs=1e-6), key
      assert g["best_epoch"] == w["best_epoch"]
  # The members stop individually (order: lr 0.01 r0, r1, lr 0.1 r0, r1).
  assert epochs == [4, 5, 3, 5]


def test_grid_params_equal_separate_runs(grid_and_separate_runs):
  config, ms, _, grid_dir, _, single_dirs = grid_and_separate_runs
  template = train.create_train_state(config, jax.random.key(0)).arrays()
  steps = []
  for m, single in zip(ms, single_dirs):
    # Each member has its own checkpoints, like a single run.
    got = _restore(os.path.join(grid_dir, m.subdir, "checkpoints"), template)
    want = _restore(os.path.join(single, "checkpoints"), template)
    for key in ("params", "best_params", "opt_state"):
      for g, w in zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[key])):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    for key in ("epoch", "step", "best_epoch", "stopped"):
      assert np.asarray(got[key]) == np.asarray(want[key]), key
    steps.append(int(np.asarray(got["step"])))
  # A member that stopped did not change afterwards: its step count is that
  # of its own epochs (3 steps each) although others trained on.
  assert steps == [12, 15, 9, 15]


def test_grid_members_have_the_single_run_layout(grid_and_separate_runs):
  _, ms, _, grid_dir, _, single_dirs = grid_and_separate_runs
  for m, single in zip(ms, single_dirs):
    member = os.path.join(grid_dir, m.subdir)
    names = lambda d: sorted("events" if f.startswith("events.out") else f
                             for f in os.listdir(d))
    assert names(member) == names(single)
    with open(os.path.join(member, "config.json")) as f:
      stored = json.load(f)
    assert stored["alphabet"] == ["0", "1", "#"] and stored["vocab_size"] == 3
    assert stored["learning_rate"] == m.learning_rate
    # evaluate reads a member like a single run (best parameters).
    loaded = evaluate.load_model(member)
    want = evaluate.load_model(single)
    for g, w in zip(jax.tree.leaves(loaded.params),
                    jax.tree.leaves(want.params)):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  assert not os.path.exists(os.path.join(grid_dir, "checkpoints"))


def test_grid_results_and_summary_files(grid_and_separate_runs):
  _, ms, _, grid_dir, summary, single_dirs = grid_and_separate_runs
  with open(os.path.join(grid_dir, grid.SUMMARY_FILE)) as f:
    on_disk = json.load(f)
  assert on_disk["best"] == summary["best"]
  diffs = {}
  for m, single in zip(ms, single_dirs):
    with open(os.path.join(grid_dir, m.subdir, "results.json")) as f:
      got = json.load(f)
    with open(os.path.join(single, "results.json")) as f:
      want = json.load(f)
    assert got["best_epoch"] == want["best_epoch"]
    assert got["epochs"] == want["epochs"]
    assert got["best_valid_ce_diff"] == pytest.approx(
        want["best_valid_ce_diff"], rel=1e-5, abs=1e-6)
    diffs.setdefault(m.learning_rate, []).append(want["best_valid_ce_diff"])
    # Same layout as a single run: the plotting code can read it.
    assert os.path.isfile(os.path.join(grid_dir, m.subdir, "config.json"))
  means = {lr: np.mean(v) for lr, v in diffs.items()}
  assert summary["best"]["learning_rate"] == min(means, key=means.get)
  for s in summary["settings"]:
    assert s["mean"] == pytest.approx(means[s["learning_rate"]], rel=1e-5)


def test_grid_rejects_inconsistent_inputs(tmp_path):
  config = tiny_grid_config()
  config.num_restarts = 1
  config.grid_learning_rates = (0.01, 0.02, 0.03)
  with pytest.raises(ValueError, match="Got 0 splits for 3 members"):
    grid.run_grid(config, str(tmp_path), splits=[])
  splits = [tiny_splits(m.config) for m in grid.members(config)]
  splits[1] = dataclasses.replace(splits[1], train=data.Split(
      splits[1].train.batches[:2], 1, 5, 9))
  with pytest.raises(ValueError, match="different numbers of training"):
    grid.run_grid(config, str(tmp_path), splits=splits)
  config.learning_rate = -1.0  # Every member overrides it: still valid.
  config.max_epochs = 0
  with pytest.raises(ValueError, match="max_epochs"):
    grid.run_grid(config, str(tmp_path), splits=splits)


def test_grid_written_with_one_stacked_checkpoint_resumes(tmp_path):
  # Older versions kept one [K, ...] checkpoint under the grid workdir.
  config = tiny_grid_config()
  config.max_epochs = 3
  ms = grid.members(config)
  splits = [tiny_splits(m.config) for m in ms]
  full = grid.run_grid(config, str(tmp_path / "full"), splits=splits)
  old = str(tmp_path / "old")
  config.stop_after_epochs = 2
  assert grid.run_grid(config, old, splits=splits) == {"finished": False}
  template = train.create_train_state(config, jax.random.key(0)).arrays()
  states, hosts = [], []
  for m in ms:
    ckpt = os.path.join(old, m.subdir, "checkpoints")
    manager = checkpointing.make_manager(ckpt, keep=2)
    _, arrays, host = checkpointing.restore_latest(manager, template)
    checkpointing.close(manager)
    states.append(arrays)
    hosts.append(host)
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(ckpt)
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *states)
  manager = checkpointing.make_manager(os.path.join(old, "checkpoints"))
  checkpointing.save(manager, 2, stacked, {
      "shuffle_rngs": [h["shuffle_rng"] for h in hosts],
      "orders": [h["order"] for h in hosts], "epoch": 2})
  checkpointing.close(manager)
  config.stop_after_epochs = 0
  resumed = grid.run_grid(config, old, splits=splits)
  assert resumed["best"] == full["best"]
  for a, b in zip(resumed["settings"], full["settings"]):
    np.testing.assert_allclose(a["values"], b["values"], rtol=1e-6)
  assert os.path.isdir(os.path.join(old, "checkpoints_stacked", "2"))
