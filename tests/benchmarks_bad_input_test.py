"""Benchmarks' bad flags: one line on stderr, exit 2, before any timing
(and before any results file is written)."""

import sys

import pytest


@pytest.mark.parametrize("script,argv,message", [
    ("rns_stack", ["--baseline=HEAD"],
     "error: --baseline needs --vs-ns or --windows"),
    ("vrns_stack", ["--before=HEAD"], "error: --before needs --compare"),
    ("log_stack", ["--workdir=/nonexistent/run"],
     "error: --workdir: workdir '/nonexistent/run' does not exist"),
    ("log_stack", ["--window=3", "--baseline=HEAD"],
     "error: --baseline times the unlimited log_stack; leave out --window"),
    ("share_margin", ["--window=-1"], "error: --window must be >= 0, got -1"),
    ("window_vjp", ["--reps=0"],
     "error: argument --reps: want an integer >= 1, got '0'"),
    ("corpus_step", ["--reps=0"],
     "error: argument --reps: want an integer >= 1, got '0'"),
    ("train_step", ["--length=41,0"],
     "error: --length: want comma-separated string lengths >= 1"),
    ("train_step", ["--unroll=2,x"],
     "error: argument --unroll: want comma-separated integers >= 0, got "
     "'2,x'"),
    ("train_step", ["--study_lengths=abc"],
     "error: argument --study_lengths: want comma-separated integers >= 0"),
    ("train_step", ["--cpu_devices=0"],
     "error: argument --cpu_devices: want an integer >= 1, got '0'"),
    # An empty --out fell back to the default path: over the committed
    # results file, after the run.
    ("train_step", ["--out="], "error: argument --out: want a file path"),
    ("scale", ["--out="], "error: argument --out: want a file path"),
    ("train_step", ["--out=/"],
     "error: argument --out: '/' is a directory; want a file path"),
    ("corpus_step", ["--out=/"],
     "error: argument --out: '/' is a directory; want a file path"),
    ("window_vjp", ["--baseline_ref=no-such-revision-x"],
     "error: no nsrnn_jax/limited_stack.py at git revision "
     "'no-such-revision-x'"),
])
def test_a_bad_flag_is_one_line_and_exit_2(load_benchmark, monkeypatch,
                                           capsys, script, argv, message):
  module = load_benchmark(script)
  saved = []
  monkeypatch.setattr(module.machine, "save_result",
                      lambda *a, **k: saved.append(a))
  monkeypatch.setattr(sys, "argv", [f"{script}.py"] + argv)
  with pytest.raises(SystemExit) as exit_info:
    module.main()
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(message) and err.count("\n") == 1, err
  assert not saved
