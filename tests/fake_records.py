"""Run records made up for tests of the report and the runner's estimates."""

from nsrnn_jax import run_records


def fake_record(task, model, lr, restart, best, last, stack_size=None,
                test_in=None, test_out=None):
  """A finished run's record with the given validation numbers (and, with
  test_in / test_out, a flat per-length test table)."""
  spec = run_records.RunSpec(task, model, lr, stack_size, restart)
  test = None
  if test_in is not None:
    lengths = list(range(40, 101))
    test = {"lengths": lengths,
            "ce_diff": [test_in if n <= 80 else test_out for n in lengths]}
  return {"format": run_records.RECORD_FORMAT, "task": task, "model": model,
          "setting": spec.setting, "learning_rate": lr,
          "stack_size": stack_size, "restart": restart, "protocol": "paper",
          "overrides": {}, "epochs": [{"epoch": 1, "valid_ce_diff": 0.3},
                                      {"epoch": 2, "valid_ce_diff": last}],
          "num_epochs": 2, "best_epoch": 2, "best_valid_ce_diff": best,
          "last_valid_ce_diff": last, "test": test, "train_time_s": 600.0,
          "hardware": {"backend": "cpu", "device_kind": "cpu",
                       "cpu_count": 2}}


