"""Tests of nsrnn_jax.run_records: the protocol's grid, the records' format,
checks and atomic writes, and the time they imply for runs to come.

The runs that make records are tested in reproduce_test.py; the report
that reads them in reproduction_report_test.py.
"""

import json
import os
import re
import subprocess
import threading

import pytest

from nsrnn_jax import reproduce
from nsrnn_jax import run_records
# tests/fake_records.py (tests/ is on sys.path under pytest).
from fake_records import fake_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_full_plan_is_the_papers_grid():
  runs = run_records.plan("dyck", run_records.MODELS)
  counts = {m: sum(r.model == m for r in runs) for m in run_records.MODELS}
  # 4 lr x 5 restarts; JM and Gref also x 3 values of m (ref. section 9).
  assert counts == {"lstm": 20, "jm": 60, "gref": 60, "ns": 20}
  assert len({r.record_path for r in runs}) == 160
  # Restart-major: every run of restart 0 precedes every run of restart 1.
  restarts = [r.restart for r in runs]
  assert restarts == sorted(restarts)


def test_cost_estimates_ignore_pauses_of_the_machine():
  # Epoch 1 compiles; epoch 4 ran while the process was stopped for 490 s.
  rec = dict(fake_record("dyck", "ns", 0.005, 0, 0.01, 0.01),
             epochs=[{"epoch": e, "valid_ce_diff": 0.01, "time": t}
                     for e, t in enumerate([600.0, 10.0, 12.0, 500.0, 10.0],
                                           start=1)],
             train_time_s=1132.0)
  assert run_records.training_seconds(rec) == 5 * 11.0   # median 11 s x 5
  probe = run_records.RunSpec("dyck", "ns", 0.005, None, 1)
  other = dict(rec, epochs=[dict(e, time=20.0) for e in rec["epochs"]])
  assert run_records.estimate_seconds(probe, [rec, other]) == (55.0 + 100.0) / 2
  # A record without epoch times falls back to its total.
  assert run_records.training_seconds(fake_record("dyck", "ns", 0.005, 0, 0.01,
                                                0.01)) == 600.0


def test_code_version_names_the_checkout_commit_and_its_changes(tmp_path):
  def git(*args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=tmp_path, check=True, capture_output=True, text=True).stdout
  unknown = {"commit": None, "modified": None}
  assert run_records.code_version(str(tmp_path)) == unknown   # no git
  git("init", "-q")
  (tmp_path / "nsrnn_jax").mkdir()
  (tmp_path / "nsrnn_jax" / "a.py").write_text("x = 1\n")
  (tmp_path / "notes.txt").write_text("not code\n")
  git("add", "-A")
  git("commit", "-q", "-m", "one")
  head = git("rev-parse", "HEAD").strip()
  assert run_records.code_version(str(tmp_path)) == {"commit": head,
                                                     "modified": False}
  (tmp_path / "notes.txt").write_text("changed, but not code\n")
  assert not run_records.code_version(str(tmp_path))["modified"]
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "new.py").write_text("y = 2\n")  # untracked
  assert run_records.code_version(str(tmp_path)) == {"commit": head,
                                                     "modified": True}
  # A folder inside a checkout is not one (a package installed into a
  # virtual environment that lives in some repository).
  assert run_records.code_version(str(tmp_path / "nsrnn_jax")) == unknown


def test_every_committed_record_is_consistent():
  for rec in run_records.load_records(os.path.join(REPO, "results")):
    assert rec["protocol"] == "paper", rec["task"]
    epochs = [e["epoch"] for e in rec["epochs"]]
    assert epochs == list(range(1, rec["num_epochs"] + 1))
    assert 1 <= rec["best_epoch"] <= rec["num_epochs"]
    assert rec["last_valid_ce_diff"] == rec["epochs"][-1]["valid_ce_diff"]
    assert rec["config"]["task"] == rec["task"]
    assert rec["config"]["model"] == rec["model"]
    assert rec["config"]["learning_rate"] == rec["learning_rate"]
    assert rec["config"]["data_seed"] == run_records.BASE_SEED + rec["restart"]
    # The paper's test set: every valid length in 40..100.
    assert rec["test"] and min(rec["test"]["lengths"]) >= 40
    assert max(rec["test"]["lengths"]) <= 100


@pytest.mark.parametrize("kwargs,message", [
    (dict(task="dyk"), "unknown task 'dyk'"),
    (dict(models=["NS"]), "models must be a non-empty list"),
    (dict(models="ns"), "models must be a non-empty list"),
    (dict(restarts=-1), "restarts must be an integer >= 1"),
    (dict(restart_ids=[7]), "restart_ids must be a non-empty list"),
    (dict(learning_rates=[float("nan")]), "learning_rates must be"),
    (dict(learning_rates=[-0.1]), "learning_rates must be"),
    (dict(stack_sizes=[2.5]), "stack_sizes must be"),
])
def test_a_plan_of_bad_arguments_is_refused(kwargs, message):
  # Not a plan of nothing (which a run reported finished) or of bogus runs.
  args = dict(task="dyck", models=["ns", "jm"]) | kwargs
  with pytest.raises(run_records.ReproduceError, match=re.escape(message)):
    run_records.plan(**args)
  # A task name given as a string is that task, not its letters.
  assert {s.task for s in reproduce.plan_tasks("dyck", ["ns"])} == {"dyck"}


def test_run_specs_name_their_setting_directory_and_record():
  jm = run_records.RunSpec("dyck", "jm", 0.0005, 40, 3)
  assert jm.setting == "m_40-lr_0.0005" and jm.group == "jm/m_40"
  assert jm.run_subdir == os.path.join("jm", "m_40", "lr_0.0005", "restart_3")
  assert jm.record_path == os.path.join("dyck", "jm", "m_40-lr_0.0005",
                                        "restart_3.json")
  ns = run_records.RunSpec("hardest_cfl", "ns", 0.01, None, 0)
  assert ns.setting == "lr_0.01" and ns.name == "ns/lr_0.01/restart_0"
  assert ns.record_path == os.path.join("hardest_cfl", "ns", "lr_0.01",
                                        "restart_0.json")


def test_a_record_in_another_runs_file_is_refused(tmp_path):
  rec = fake_record("dyck", "ns", 0.005, 2, 0.01, 0.01)
  own = str(tmp_path / "dyck" / "ns" / "lr_0.005" / "restart_2.json")
  run_records.check_record(rec, own)       # its own file: no error
  # Another restart's file, another model's or another task's directory.
  for path in (tmp_path / "dyck" / "ns" / "lr_0.005" / "restart_3.json",
               tmp_path / "dyck" / "jm" / "lr_0.005" / "restart_2.json",
               tmp_path / "hardest_cfl" / "ns" / "lr_0.005" / "restart_2.json"):
    with pytest.raises(run_records.ReproduceError,
                       match="which belongs in its own restart_2.json"):
      run_records.check_record(rec, str(path))


def test_a_failed_write_leaves_the_old_record_whole(tmp_path):
  path = str(tmp_path / "sub" / "r.json")
  run_records.write_json_atomic(path, {"a": 1})
  assert json.load(open(path)) == {"a": 1}
  # json.dump fails midway (after writing some of the object): the file
  # that readers see is still the complete old one.
  with pytest.raises(TypeError):
    run_records.write_json_atomic(path, {"b": 2, "c": object()})
  assert json.load(open(path)) == {"a": 1}
  assert os.listdir(tmp_path / "sub") == ["r.json"]   # no temporary left
  run_records.write_json_atomic(path, {"b": 2})
  assert json.load(open(path)) == {"b": 2}


def test_writers_of_one_record_at_once_never_fail_or_leave_half_a_file(
    tmp_path):
  # Commands sharing a grid can write the same record (or manifest) at the
  # same moment. With one shared temporary name, one writer's rename took
  # the other's file away (FileNotFoundError) or moved it mid-write.
  path = str(tmp_path / "r.json")
  errors = []

  def write(k):
    try:
      for i in range(40):
        run_records.write_json_atomic(path, {"writer": k, "i": i,
                                             "pad": "x" * 20000})
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=write, args=(k,)) for k in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []
  with open(path) as f:
    last = json.load(f)
  assert last["i"] == 39 and len(last["pad"]) == 20000
  assert os.listdir(tmp_path) == ["r.json"]   # no temporary left


def test_a_record_keeps_the_stack_margins_its_run_measured(tmp_path):
  """With valid_stack_margin the run's per-epoch and per-length margins go
  into its record; a run without them gets none (no empty keys)."""
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  epochs = [{"epoch": e, "train_loss": 1.0, "valid_ce_diff": 0.1,
             "valid_perplexity": 2.0, "learning_rate": 0.01, "time": 5.0,
             "valid_stack_margin": -20.0 - e,
             "valid_stack_exact_fraction": 1.0} for e in (1, 2)]
  (run_dir / "metrics.jsonl").write_text(
      "".join(json.dumps(e) + "\n" for e in epochs))
  (run_dir / "results.json").write_text(json.dumps(
      {"epochs": 2, "best_epoch": 2, "best_valid_ce_diff": 0.1,
       "test_stack_margin_kind": "product",
       "test_stack_unproven_strings": 3,
       "test_stack_unproven_max_error": 2.5e-5}))
  (run_dir / "config.json").write_text(json.dumps({"model": "ns"}))
  table = {"lengths": [40, 41], "ce_diff": [0.1, 0.2],
           "num_strings": [100, 100], "stack_margin": [-30.0, -41.0],
           "stack_exact_fraction": [1.0, 0.97]}
  (run_dir / "test_by_length.json").write_text(json.dumps(table))
  spec = run_records.RunSpec("dyck", "ns", 0.005, None, 0)
  maker = {"hardware": {}, "code": {}}
  rec = run_records.make_record(spec, str(run_dir), {}, maker)
  assert [e["valid_stack_margin"] for e in rec["epochs"]] == [-21.0, -22.0]
  assert rec["test"]["stack_margin"] == [-30.0, -41.0]
  assert rec["test"]["stack_exact_fraction"] == [1.0, 0.97]
  assert rec["test"]["stack_margin_kind"] == "product"
  assert rec["test"]["unproven_strings"] == 3
  assert rec["test"]["unproven_max_error"] == 2.5e-5
  for e in epochs:
    del e["valid_stack_margin"], e["valid_stack_exact_fraction"]
  (run_dir / "metrics.jsonl").write_text(
      "".join(json.dumps(e) + "\n" for e in epochs))
  for key in ("stack_margin", "stack_exact_fraction"):
    del table[key]
  (run_dir / "test_by_length.json").write_text(json.dumps(table))
  (run_dir / "results.json").write_text(json.dumps(
      {"epochs": 2, "best_epoch": 2, "best_valid_ce_diff": 0.1}))
  rec = run_records.make_record(spec, str(run_dir), {}, maker)
  assert all("valid_stack_margin" not in e for e in rec["epochs"])
  assert set(rec["test"]) == {"lengths", "ce_diff", "num_strings"}
