"""The documents' benchmark tables equal what benchmarks/report.py generates.

The tables must come from the committed JSON under benchmarks/results/, so
a README edited by hand (or JSON committed without rerunning the report)
fails here.
"""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def report(load_benchmark):
  return load_benchmark("report")


@pytest.mark.parametrize("document", ["README.md", "docs/benchmarks.md",
                                      "docs/architecture.md"])
def test_document_tables_are_generated_from_results(report, document):
  path = os.path.join(REPO, document)
  with open(path) as f:
    text = f.read()
  assert report.render(text, report.DOCUMENTS[path]) == text, (
      f"{document}'s benchmark tables are stale: run "
      "python benchmarks/report.py")


def test_every_block_lives_in_one_document(report):
  # A block moved between documents must leave the old one's markers.
  seen = {}
  for path, blocks in report.DOCUMENTS.items():
    with open(path) as f:
      text = f.read()
    for name in re.findall(r"<!-- report:(\w+):begin -->", text):
      assert name in blocks, f"{path} has report:{name} but no renderer"
      assert name not in seen, f"report:{name} in {seen.get(name)} and {path}"
      seen[name] = path
  assert sorted(seen) == sorted(n for b in report.DOCUMENTS.values()
                                for n in b)


def test_render_replaces_only_the_marked_blocks(report):
  text = ("intro\n<!-- report:benchmarks:begin -->\nold\n"
          "<!-- report:benchmarks:end -->\nmiddle\n"
          "<!-- report:compile:begin -->\n<!-- report:compile:end -->\nend\n")
  blocks = {"benchmarks": report.benchmarks_block,
            "compile": report.compile_block}
  out = report.render(text, blocks)
  assert out.startswith("intro\n<!-- report:benchmarks:begin -->\n")
  assert "\nold\n" not in out
  assert "\nmiddle\n" in out and out.endswith(
      "<!-- report:compile:end -->\nend\n")
  assert report.render(out, blocks) == out
  with pytest.raises(ValueError, match="report:compile"):
    report.render("no markers <!-- report:benchmarks:begin -->\n"
                  "<!-- report:benchmarks:end -->", blocks)


def test_reference_figures_stay_out_of_measured_results():
  # Figures measured elsewhere live only in reference_pytorch.json.
  results = os.path.join(REPO, "benchmarks", "results")
  for name in os.listdir(results):
    if not name.endswith(".json") or name == "reference_pytorch.json":
      continue
    with open(os.path.join(results, name)) as f:
      data = json.load(f)
    assert not [k for k in _keys(data) if "pytorch" in k.lower()], name


def _keys(tree):
  """Every dict key in a JSON tree."""
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield k
      yield from _keys(v)
  elif isinstance(tree, list):
    for v in tree:
      yield from _keys(v)


@pytest.mark.parametrize("variant", ["shares", "custom", "autodiff", "logspace"])
def test_stack_benchmark_runs_against_the_current_api(variant):
  # One tiny measurement of benchmarks/ns_stack.py: a benchmark that no
  # longer matches the library's API fails here, not at the next rerun
  # (its custom variant broke silently once when ns_stack gained
  # `precision`).
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "ns_stack.py"),
       "--child", f"--variant={variant}", "--n=3", "--reps=1", "--batch=2"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert line, proc.stdout[-2000:]
  got = json.loads(line[-1][len("RESULT "):])
  assert got["variant"] == variant and got["n"] == 3
  assert 0 < got["fwd_s"] < 60 and 0 < got["fwd_bwd_s"] < 60


def test_gpu_budget_table_arithmetic(report, monkeypatch):
  # Floor = the best LSTM row (2 ms at n = 50: 100 updates, 20 µs each);
  # a 3 ms target leaves 1 ms = 10 µs per update; a 7 ms step is 5 ms over
  # the floor = 50 µs per update, 5x what the target leaves.
  def row(model, best, **extra):
    return {"model": model, "min_step_s": best, "length": 50,
            "precision": "highest", **extra}
  steps = [row("lstm", 3e-3), row("lstm", 2e-3, scan_unroll=8),
           row("ns22", 9e-3, stack_table="shares", target_s=3e-3),
           row("ns22", 7e-3, stack_table="shares", target_s=3e-3,
               scan_unroll=8),
           row("jm", 1e-3, precision="default", target_s=1.5e-3)]
  monkeypatch.setattr(report, "_gpu_step_files",
                      lambda: [("f.json", {"steps": steps})])
  lines = report.gpu_budget_table()
  assert "2.00 ms (scan unroll 8), 20.0 µs for each of the 100" in lines[0]
  rows = [l for l in lines if l.startswith("| NS")]
  assert rows == ["| NS-RNN Q=S=2 | 3.00 ms | 1.00 ms | 10.0 µs (0.50× the "
                  "LSTM's update) | 50.0 µs (unroll 8) | 5.0× |"]
  # Reduced-precision rows are not full float32: JM has no row.
  assert not [l for l in lines if l.startswith("| JM")]
  # Files of another GPU (fewer of them) never mix in: its faster LSTM row
  # would lower the floor, its NS row the "today" figure.
  h100 = {"device": "gpu: H100", "steps": [
      row("lstm", 1e-3), row("ns22", 4e-3, stack_table="shares",
                             target_s=3e-3)]}
  h200 = {"device": "gpu: H200", "steps": steps}
  monkeypatch.setattr(report, "_gpu_step_files", lambda: [
      ("a.json", h100), ("b.json", h200), ("c.json", h200)])
  mixed = report.gpu_budget_table()
  assert "from the gpu: H200 rows" in mixed[0]
  assert [l for l in mixed if l.startswith("| NS")] == rows


def test_a_run_over_several_lengths_compares_each_length_with_its_own(
    report, monkeypatch, tmp_path):
  # `train_step.py --length=41,80 --baseline_ref=…`: each before row is
  # divided by the plain row of its own length, never by another length's.
  def row(n, variant, best, cpu):
    return {"model": "ns33", "stack_table": "shares", "length": n,
            "variant": variant, "min_step_s": best, "cpu_step_s": cpu}
  d = {"baseline_ref": "abcdef0123", "machine": {"source_revision": "1234567"},
       "steps": [row(41, "current", 0.1, 0.1), row(41, "baseline x", 0.2, 0.3),
                 row(80, "current", 0.4, 0.5), row(80, "baseline x", 0.5, 0.5)]}
  (tmp_path / "train_step_cpu_two_lengths.json").write_text(json.dumps(d))
  monkeypatch.setattr(report, "RESULTS", str(tmp_path))
  rows = [l for l in report.cpu_comparison_table() if l.startswith("| `")]
  assert [r.split(" | ")[2] for r in rows] == [
      "before (abcdef0) at n = 41, plain at 1234567",
      "before (abcdef0) at n = 80, plain at 1234567"]
  assert [r.split(" | ")[6] for r in rows] == ["2.00× / 3.00×",
                                              "1.25× / 1.00×"]
  # A run at one length names none (the committed single-length files).
  d["steps"] = d["steps"][2:]
  (tmp_path / "train_step_cpu_two_lengths.json").write_text(json.dumps(d))
  rows = [l for l in report.cpu_comparison_table() if l.startswith("| `")]
  assert [r.split(" | ")[2] for r in rows] == [
      "before (abcdef0), plain at 1234567"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity")
                    or len(os.sched_getaffinity(0)) < 2,
                    reason="pins 2 processes to a core each")
def test_concurrent_steps_benchmark_runs_and_pins(tmp_path):
  # A tiny run of benchmarks/concurrent_steps.py (LSTM, half-second
  # window): the pinned processes ran on one core each, the free ones on all.
  out = tmp_path / "c.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "concurrent_steps.py"),
       "--models=lstm", "--cores=2", "--window=0.5",
       f"--out={out}"], capture_output=True, text=True, check=False,
      cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = json.loads(out.read_text())
  rows = {r["mode"]: r for r in data["rows"]}
  usable = sorted(os.sched_getaffinity(0))
  assert rows["pinned"]["cores"] == [[usable[0]], [usable[1]]]
  assert rows["free"]["cores"] == [usable, usable]
  assert all(n > 0 for r in rows.values() for n in r["steps"])
  summary = data["summary"]["lstm"]
  assert summary["pinned_over_free"] == pytest.approx(
      summary["pinned_steps"] / summary["free_steps"])


def test_trained_share_margin_reads_the_exact_table(load_benchmark):
  # log_stack.py --workdir's smallest share: after one update every run
  # starts with the push from (q0, ⊥), so each (r, y) with a push holds all
  # of α_1 (log share 0) and one without holds none (−inf, left out). At
  # update 2 a pop is impossible (frozen bottom) and a replace of weight
  # e^-50 beside a push of weight 1 leaves the replaced run a share of
  # about e^-50 of its (r, y).
  import numpy as np  # pylint: disable=g-import-not-at-top
  bench = load_benchmark("log_stack")
  q, s = 1, 2
  push = np.ones((1, 2, q, s, q, s), np.float32)
  push[:, 0, 0, 0, 0, 1] = 0                  # update 1: only y = 0 pushed
  repl = np.full((1, 2, q, s, q, s), np.exp(-50.0), np.float32)
  pop = np.ones((1, 2, q, s, q), np.float32)
  out = {"actions": {"push": push, "repl": repl, "pop": pop}}
  shares = bench._log_shares(out, model=None)  # pylint: disable=protected-access
  assert shares.max() == pytest.approx(0.0, abs=1e-6)
  assert shares.min() == pytest.approx(-50.0, abs=1.0)
  one = bench._log_shares(  # pylint: disable=protected-access
      {"actions": {k: v[:, :1] for k, v in out["actions"].items()}}, None)
  np.testing.assert_allclose(one, [0.0], atol=1e-6)


@pytest.mark.parametrize("window", [0, 3])
def test_share_margin_benchmark_times_the_margin_it_reports(load_benchmark,
                                                            monkeypatch,
                                                            window):
  # A small row: both timings positive and the reported margin is the
  # smallest of share_margin's own on the row's inputs (same seed).
  import numpy as np  # pylint: disable=g-import-not-at-top
  bench = load_benchmark("share_margin")
  monkeypatch.setattr(bench, "B", 2)
  monkeypatch.setattr(bench, "N", 5)
  monkeypatch.setattr(bench, "REPEATS", 1)
  # The window's row also times the margin as of HEAD (a before/after).
  baseline = "HEAD" if window else None
  row = bench.row(2, window, np.random.default_rng(4), baseline)
  assert row["run_s"] > 0 and row["margin_s"] > 0
  if window:
    assert row["same_margins"] and row["speedup"] == pytest.approx(
        row["margin_before_s"] / row["margin_s"])
  assert row["margin_over_run"] == pytest.approx(row["margin_s"]
                                                 / row["run_s"])
  rng = np.random.default_rng(4)
  shapes = [(2, 5, 2, 2, 2, 2)] * 2 + [(2, 5, 2, 2, 2)]
  acts = [np.asarray(3 * rng.normal(size=sh), np.float32) for sh in shapes]
  want = bench.functions(window)["margin"](*acts)
  assert row["min_margin"] == pytest.approx(float(np.min(want)))
  assert row["min_margin"] < -1


def test_margin_certificates_benchmark_counts_its_elements(load_benchmark,
                                                           monkeypatch, x64):
  # A small row at scale 8 (between all and none proven): the proven count
  # is share_margin's on the row's inputs (same seed), a margin 100 nats
  # lower proves none, nothing proven is inexact, and every element is
  # exact here.
  del x64
  import numpy as np  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import rns_stack  # pylint: disable=g-import-not-at-top
  bench = load_benchmark("margin_certificates")
  monkeypatch.setattr(bench, "B", 8)
  monkeypatch.setattr(bench, "N", 8)
  lower = lambda *a: rns_stack.share_margin(*a) - 100.0
  row = bench.row(8, np.random.default_rng(5), lower)
  acts = bench.actions(8, np.random.default_rng(5))
  margins = np.asarray(rns_stack.share_margin(
      *(np.asarray(a, np.float32) for a in acts)))
  assert row["reference_not_proven"] == 0 and row["elements"] == 8
  assert row["proven_product"] == np.sum(
      margins > rns_stack.exact_margin(np.float32))
  assert 0 < row["proven_product"] < 8, margins
  assert row["proven_factor"] == 0
  assert row["exact"] == 8
  assert row["proven_not_exact_product"] == 0


def test_stream_margin_benchmark_reports_the_chunk_s_margin(load_benchmark):
  # A small RNS row: the margin evaluation's NLL is the plain one's, and the
  # smallest margin is stack_margin's on the chunk's rows (a stream's first
  # chunk; the fixed bottom leaves the last token's update to the next).
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import corpus_train  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  bench = load_benchmark("stream_margin")
  small = dict(batch_size=4, bptt_length=6, stack_window=3)
  row = bench.row("rns", 50, 8, 1, small)
  assert row["same_nll"] and row["eval_ms"] > 0 and row["margin_ms"] > 0
  config = bench.CONFIGS["rns"].get_config()
  config.hidden_size = 8
  config.update(small)
  model = models.build(config, vocab_size=50)
  params = corpus_train.create_train_state(config, model,
                                           jax.random.key(0)).params
  inputs = np.random.default_rng(0).integers(0, 50, (4, 6)).astype(np.int32)
  want = model.apply({"params": params}, inputs, method="stack_margin")
  assert row["min_margin"] == pytest.approx(float(np.min(want)), rel=1e-5)


@pytest.mark.parametrize("damage,message", [
    ('{"rows": [', "unreadable benchmarks/results/train_step_cpu.json"),
    ('{"steps": [5]}', "report:benchmarks: a results file lacks what the "
     "block reads (last read: "),
])
def test_a_damaged_results_file_is_one_line_naming_it(
    report, tmp_path, monkeypatch, capsys, damage, message):
  # A copy of the results with the headline CPU run damaged: one line and
  # exit 2 naming the file or the block, not a traceback from inside a
  # renderer (and the document is not rewritten).
  import shutil  # pylint: disable=g-import-not-at-top
  results = tmp_path / "benchmarks" / "results"
  shutil.copytree(os.path.join(REPO, "benchmarks", "results"), results)
  (results / "train_step_cpu.json").write_text(damage)
  monkeypatch.setattr(report, "RESULTS", str(results))
  monkeypatch.setattr(report, "REPO", str(tmp_path))
  doc = tmp_path / "doc.md"
  text = "<!-- report:benchmarks:begin -->\n<!-- report:benchmarks:end -->\n"
  doc.write_text(text)
  monkeypatch.setattr(report, "DOCUMENTS",
                      {str(doc): {"benchmarks": report.benchmarks_block}})
  monkeypatch.setattr(sys, "argv", ["report.py"])
  with pytest.raises(SystemExit) as e:
    report.main()
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err
  assert doc.read_text() == text
