"""Writes the benchmark tables of README, docs/benchmarks.md and
docs/architecture.md from JSON.

Every number in README's headline train-step table and its reproduction
and compilation tables, in docs/benchmarks.md's tables and in
docs/architecture.md's stack tables comes from a file under
benchmarks/results/ (named beside it); the authors' PyTorch figures come
from results/reference_pytorch.json, which holds figures measured elsewhere,
and sit in their own labelled column.

  python benchmarks/report.py           # rewrites the blocks
  python benchmarks/report.py --check   # exit 1 if a document is out of date

The blocks lie between `<!-- report:NAME:begin -->` and
`<!-- report:NAME:end -->` markers; tests/benchmarks_report_test.py checks
that both documents equal what this script generates.
"""

import collections
import glob
import json
import os
import re
import sys
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
README = os.path.join(REPO, "README.md")

MODEL_LABELS = {"ns22": "NS-RNN Q=S=2", "ns33": "NS-RNN Q=S=3",
                "ns32": "NS-RNN Q=3, S=2",
                "ns22_scaled": "NS-RNN Q=S=2, scaled table",
                "ns33_scaled": "NS-RNN Q=S=3, scaled table",
                "jm": "JM m=20", "gref": "Gref m=20", "lstm": "LSTM"}


def _model_key(r):
  """MODEL_LABELS key of a train_step row.

  NS rows name their stack table since the default became "shares"; rows
  measured before (no `stack_table` field) ran ns_stack's scaled table.
  """
  name = r["model"]
  if name in ("ns22", "ns33") and r.get("stack_table", "scaled") == "scaled":
    return name + "_scaled"
  return name


# The results file a block read last: named when a block fails on what it
# read (a file without a field the block needs).
_last_loaded = None


def _load(name):
  global _last_loaded
  path = os.path.join(RESULTS, name)
  if not os.path.exists(path):
    return None
  _last_loaded = os.path.relpath(path, REPO)
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except ValueError as e:   # not JSON, or not UTF-8
    raise ValueError(f"unreadable {_last_loaded}: {e}") from e


def _ms(seconds):
  if seconds is None:
    return ""
  ms = seconds * 1e3
  if ms >= 100:
    return f"{ms:,.0f} ms"
  if ms >= 10:
    return f"{ms:.1f} ms"
  return f"{ms:.2f} ms"


def _s(seconds):
  return f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _device(d):
  """Device label of a results file (older files did not record it)."""
  if d is None:
    return "not measured"
  if "device" in d and ":" in str(d["device"]):
    return d["device"]
  return "2-core CPU (model not recorded)"


def _steps(d):
  """{model: plain (current) row} of a train_step results file."""
  if d is None:
    return {}
  return {_model_key(r): r for r in d.get("steps", [])
          if r.get("variant", "current") == "current"}


def _gpu_step_files():
  """[(file name, results)] of the GPU train-step runs, by name.

  gpu_session.sh writes one file per phase (train_step_gpu_ns.json,
  ..._baselines.json, ..._default.json, ...); an older session wrote one
  train_step_gpu.json.
  """
  names = sorted(os.path.basename(p) for p in
                 glob.glob(os.path.join(RESULTS, "train_step_gpu*.json")))
  return [(n, _load(n)) for n in names]


def _main_gpu_files():
  """([(file name, results)], device) of the GPU device with the most
  train-step files: tables that compare models across files take one
  device's (the fullest set), never a mix."""
  files = _gpu_step_files()
  devices = collections.Counter(_device(d) for _, d in files)
  device = devices.most_common(1)[0][0] if devices else None
  return [(n, d) for n, d in files if _device(d) == device], device


def _unroll(r):
  """The scan unroll factor a train_step row ran (older rows: from label)."""
  if "scan_unroll" in r:
    return r["scan_unroll"]
  label = r.get("variant", "current")
  return int(label[len("unroll="):]) if label.startswith("unroll=") else 1


def _models_module():
  """nsrnn_jax.models (the automatic unroll rule), imported on first use."""
  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, REPO)
  from nsrnn_jax import models
  return models


def _gpu_default_rows(d):
  """{model: the row that ran today's GPU default unroll} of one file."""
  models = _models_module()
  rows = {}
  for r in d.get("steps", []):
    model = "ns" if r["model"].startswith("ns") else r["model"]
    if _unroll(r) == models.auto_scan_unroll(model, "gpu"):
      rows.setdefault(_model_key(r), r)
  return rows


def _gpu_full_precision():
  """{model: default row} and sources of the full-float32 GPU runs, or None.

  The default row is the one at today's default unroll on a GPU
  (models.auto_scan_unroll), whichever label it had when measured.
  """
  rows, sources = {}, []
  files, device = _main_gpu_files()
  for name, d in files:
    if d.get("precision") != "highest" or "XLA_FLAGS" in d.get("env", {}):
      continue
    new = {k: r for k, r in _gpu_default_rows(d).items() if k not in rows}
    if new:
      rows.update(new)
      sources.append(f"`{name}`")
  if not rows:
    return None
  models = _models_module()
  unrolled = " and ".join(MODEL_LABELS[m] for m in models.GPU_UNROLLED_MODELS)
  return rows, (f"GPU: {', '.join(sources)} ({device}, precision highest, "
                f"the default scan unroll: {models.GPU_UNROLL} for "
                f"{unrolled}, 1 for the others)")


def train_step_table(cpu_file="train_step_cpu.json"):
  """Train step per model: CPU (with FLOP-limit ratio), GPU, targets.

  `cpu_file` is the CPU run (README's headline: train_step_cpu.json, the
  latest; docs/benchmarks.md also shows the earlier one its prose cites),
  followed by the variants measured in the same run.
  """
  cpu = _load(cpu_file)
  gpu_full = _gpu_full_precision()
  gpu = gpu_full is not None
  old_gpu = _load("gpu_h200.json")
  ref = _load("reference_pytorch.json") or {}
  ref_steps = ref.get("train_step_s", {})
  ref_cpu = next((v for k, v in ref_steps.items() if "CPU" in k), {})
  ref_gpu = next((v for k, v in ref_steps.items() if "H200" in k), {})
  cpu_rows = _steps(cpu)
  gpu_rows = gpu_full[0] if gpu else {}
  old_gpu_rows = _steps(old_gpu and old_gpu.get("train_step"))
  lines = []
  sources = []
  if cpu:
    sources.append(f"CPU: `{cpu_file}` ({_device(cpu)}{_when(cpu)}, load "
                   f"average {cpu['machine']['load_average_1_5_15'][0]:.1f} "
                   f"at start, precision {cpu['precision']})")
  if gpu:
    sources.append(gpu_full[1])
  elif old_gpu:
    sources.append("GPU: `gpu_h200.json` (NVIDIA H200, jax 0.11.2, JAX's "
                   "default = reduced matmul precision, before issue 11)")
  lines.append("Train step (forward, loss, backward, clip, Adam), batch 10, "
               "n = 80. CPU: best wall time / median process CPU time of the "
               "timed steps (medians of wall time on loaded shared cores "
               "mean little); GPU: median (best). Sources: "
               + "; ".join(sources) + ".")
  lines.append("")
  lines.append("| model | ours, CPU (best wall / CPU time) | CPU step / FLOP "
               "limit (target ≤ 6×); / bytes limit "
               "| ours, GPU | "
               "target CPU / GPU | authors' PyTorch CPU / H200 (not measured "
               "here: `reference_pytorch.json`) |")
  lines.append("|---|---|---|---|---|---|")
  targets = {"ns22": ("60 ms", "3 ms"), "ns33": ("250 ms", "4 ms"),
             "jm": ("5 ms", "1.5 ms"), "gref": ("5 ms", "1.5 ms"),
             "lstm": ("2 ms", "1.5 ms")}
  for name, label in MODEL_LABELS.items():
    c = cpu_rows.get(name)
    g = gpu_rows.get(name) if gpu else old_gpu_rows.get(name)
    if c is None and g is None and name not in targets:
      continue
    cpu_cell = ""
    if c:
      cpu_cell = (f"{_ms(c['min_step_s'])} / {_ms(c['cpu_step_s'])}"
                  if "cpu_step_s" in c else
                  f"{_ms(c['step_s'])} ({_ms(c['min_step_s'])})")
    ratio = (f"{c['limit_ratio']:.1f}× wall, "
             f"{c['limit_ratio_cpu_time']:.1f}× CPU time (limit "
             f"{_ms(c['flop_limit_s'])} at {c['matmul_gflops']:.0f} GFLOP/s)"
             if c and "limit_ratio_cpu_time" in c else "")
    if c and "bytes_limit_ratio" in c:
      ratio += (f"; {c['bytes_limit_ratio']:.1f}× the bytes limit "
                f"({_ms(c['bytes_limit_s'])} at "
                f"{c['read_gbytes_per_s']:.0f} GB/s)")
    gpu_cell = (f"{_ms(g['step_s'])} ({_ms(g['min_step_s'])})" if g else "")
    pt = " / ".join("–" if x is None else _s(x) if x >= 1 else _ms(x)
                    for x in (ref_cpu.get(name), ref_gpu.get(name)))
    lines.append(f"| {label} | {cpu_cell} | {ratio} | {gpu_cell} | "
                 f"{' / '.join(targets.get(name, ('–', '–')))} | {pt} |")
  variants = [r for r in (cpu or {}).get("steps", [])
              if r.get("variant", "current") != "current"]
  if variants:
    lines.append("")
    lines.append("Variants measured in the same CPU run, interleaved with "
                 "the plain step (ratios to the plain step; below 1 = "
                 "faster; `baseline <ref>` = the table's module, ns_stack.py "
                 "or rns_stack.py, as of that commit):")
    lines.append("")
    lines.append("| model | variant | best step | ratio (best wall) | "
                 "ratio (median CPU time) | step / FLOP limit (best wall) |")
    lines.append("|---|---|---|---|---|---|")
    for r in variants:
      cpu_ratio = (f"{r['cpu_step_over_current']:.2f}"
                   if "cpu_step_over_current" in r else "")
      limit = f"{r['limit_ratio']:.1f}×" if "limit_ratio" in r else ""
      lines.append(f"| {MODEL_LABELS[_model_key(r)]} | {r['variant']} | "
                   f"{_ms(r['min_step_s'])} | "
                   f"{r['min_step_over_current']:.2f} | {cpu_ratio} | "
                   f"{limit} |")
  return lines


def _commit(d):
  """The code a results file measured: its "commit" (set by hand in older
  files) or the revision the benchmark recorded itself."""
  return d.get("commit") or (d.get("machine") or {}).get("source_revision")


def _comparison_row(name, d, model_key, label, r, cur, at):
  """One row of `cpu_comparison_table`: variant `r` against plain `cur`."""
  commit = _commit(d)
  if commit:
    label += f", {at} {commit}"
  if "conditions" in d:
    label += f" ({d['conditions']})"
  return (f"| `{name}` | {MODEL_LABELS[model_key]} | {label} | "
          f"{_matmul_cell(d, cur)} | "
          f"{_ms(r['min_step_s'])} / {_ms(r['cpu_step_s'])} | "
          f"{_ms(cur['min_step_s'])} / {_ms(cur['cpu_step_s'])} | "
          f"{r['min_step_s'] / cur['min_step_s']:.2f}× / "
          f"{r['cpu_step_s'] / cur['cpu_step_s']:.2f}× | "
          f"{_limit_cell(r, cur)} |")


def _matmul_cell(d, cur):
  """The run's machine as its FLOP-limit yardstick: the float32 matmul rate
  measured in the run, and the CPU's vector extension where recorded."""
  isa = (d.get("machine") or {}).get("cpu_vector_isa")
  if "matmul_gflops" not in cur:
    return isa or "–"
  return f"{cur['matmul_gflops']:.0f} GFLOP/s" + (f", {isa}" if isa else "")


def _limit_cell(r, cur):
  """Best step over the run's FLOP limit, variant / plain (NS models)."""
  if "limit_ratio" not in r or "limit_ratio" not in cur:
    return "–"
  return f"{r['limit_ratio']:.1f}× / {cur['limit_ratio']:.1f}×"


def cpu_comparison_table():
  """Later CPU runs of a variant against the plain step (train_step_cpu_*.json).

  Each file is one `benchmarks/train_step.py` run on CPU whose variants were
  timed interleaved with the plain step (e.g. `--baseline_ref` for a code
  change, `--unroll`); the ratio is the figure to compare. A run with both
  NS tables also gets the scaled table against the default (shares) one.
  """
  paths = sorted(glob.glob(os.path.join(RESULTS, "train_step_cpu_*.json")))
  rows = []
  for path in paths:
    name = os.path.basename(path)
    d = _load(name)
    # A run over several lengths (--length=41,60,80) compares each variant
    # with the plain step at its own length, and says which.
    lengths = {r.get("length") for r in d.get("steps", [])}
    for length in sorted(lengths, key=lambda n: n or 0):
      steps = [r for r in d["steps"] if r.get("length") == length]
      plain = _steps({"steps": steps})
      at_n = f" at n = {length}" if len(lengths) > 1 else ""
      for key in ("ns22", "ns33"):
        if key in plain and key + "_scaled" in plain:
          rows.append(_comparison_row(
              name, d, key, "scaled table (ns_stack) vs the default shares "
              "table" + at_n, plain[key + "_scaled"], plain[key], "both at"))
      for r in steps:
        if r.get("variant", "current") == "current":
          continue
        label = r["variant"]
        if label.startswith("baseline") and "baseline_ref" in d:
          label = f"before ({d['baseline_ref'][:7]})"
        rows.append(_comparison_row(name, d, _model_key(r), label + at_n, r,
                                    plain[_model_key(r)], "plain at"))
  if not rows:
    return []
  return ["Later CPU runs (cpu: AMD EPYC (2 cores)), each in one process "
          "with its variant interleaved with the plain step; variant / plain "
          "above 1 means the plain step is faster (best wall time / median "
          "CPU time). The machines differ: the FLOP limit is the run's own "
          "float32 matmul rate (column \"matmul\"), about twice as high on "
          "AVX-512 machines as on the earlier ones, so the same step time is "
          "twice the ratio there:", "",
          "| file | model | variant | matmul | variant step | plain step | "
          "variant / plain | FLOP-limit ratio, variant / plain |",
          "|---|---|---|---|---|---|---|---|"] + rows


CPU_SUITE = "cpu_suite.json"


def cpu_suite_line(modules=5, tests=3):
  """The test suite's time on the CPU (cpu_suite.json), one paragraph:
  its counts and wall time, and where the time went (the `modules` most
  expensive test modules and the `tests` slowest tests)."""
  d = _load(CPU_SUITE)
  if not d:
    return []
  spent = ", ".join(f"`{path.split('/')[-1]}` {m['seconds']:.0f} s "
                    f"({m['tests']} tests)"
                    for path, m in list(d["modules"].items())[:modules])
  slowest = ", ".join(f"`{node.split('::')[-1]}` {t:.0f} s"
                      for node, t in d["slowest_tests"][:tests])
  slowest = f"; the slowest tests: {slowest}" if slowest else ""
  return [f"Test suite on the CPU (`{CPU_SUITE}`, {d['device']}, jax "
          f"{d['packages']['jax']}, commit {d['commit']}, {d['date']}; "
          f"`{d['command']}`"
          + (f"; {d['environment']}" if d.get("environment") else "")
          + f"): {d['passed']} passed, {d['failed']} failed, "
          + (f"{d['errors']} errors, " if d.get("errors") else "")
          + f"{d['skipped']} skipped, {d['xfailed']} xfailed in "
          f"{d['wall_s']:.0f} s ({d['wall_s'] / 60:.0f} minutes), "
          f"{d['test_s']:.0f} s of test time over the workers; most in "
          f"{spent}{slowest}."]


SUITE_COMPILE = "suite_compile.json"


def suite_compile_line():
  """How much of the suite's test time is JAX compiling (suite_compile.json,
  benchmarks/suite_compile.py), one sentence."""
  d = _load(SUITE_COMPILE)
  if not d:
    return []
  stages = d["trace_s"] + d["lower_s"] + d["compile_s"]
  commit = d.get("machine", {}).get("source_revision")
  run = f"commit {commit}" if commit else "its own run"
  return [f"Of its test time, {d['compiling_share']:.0%} is JAX compiling "
          f"(`{SUITE_COMPILE}`, `benchmarks/suite_compile.py`, {run}): "
          f"{stages:.0f} of {d['test_s']:.0f} s, {d['compiles']:,} XLA "
          f"compilations ({d['compile_s']:.0f} s), tracing {d['trace_s']:.0f}"
          f" s, lowering {d['lower_s']:.0f} s; the tests' own subprocesses "
          "(the CLI tests, the float32 rerun) are not counted."]


def gpu_suite_line():
  """The test suite's result on a GPU (gpu_suite_*.json), one paragraph."""
  lines = []
  for path in sorted(glob.glob(os.path.join(RESULTS, "gpu_suite_*.json"))):
    name = os.path.basename(path)
    d = _load(name)
    text = (f"Test suite on a GPU (`{name}`, {d['device']}, jax "
            f"{d['packages']['jax']}, commit {d['commit']}, {d['date']}; "
            f"{d['environment']}): {d['passed']} passed, {d['failed']} "
            f"failed, "
            + (f"{d['errors']} errors, " if d.get("errors") else "")
            + f"{d['skipped']} skipped, {d['xfailed']} xfailed in "
            f"{d['wall_s']:.0f} s")
    if d.get("interrupted"):
      text += (" -- interrupted at its time limit (exit code "
               f"{d['exit_code']}): the counts are of the tests that "
               "finished, not the whole suite")
    if d["failed"] or d.get("errors"):
      tests = ", ".join(f"`{t.split('::')[-1]}`" for t in d["failed_tests"])
      rerun = (f"; rerun {d['fixes_rerun']}" if d.get("fixes_rerun")
               else ", not yet rerun on a GPU")
      fixed = (f"fixed in {', '.join(d['fixed_in'])}" if d["fixed_in"]
               else "not fixed yet")
      text += (f"; failed: {tests} ({d['cause_of_failures']}; {fixed}"
               f"{rerun})")
    lines += [text + ".", ""]
  return lines[:-1]


def gpu_variants_table():
  """Every GPU train-step row: plain and variants, with ratios and targets."""
  files = _gpu_step_files()
  if not files:
    return []
  lines = ["GPU train steps, batch 10, n = 80, every variant measured "
           "(within one file the variants were "
           "timed in alternation, so the ratio to that file's `current` row "
           "(the default when measured) is the figure to compare; below 1 = "
           "faster; host CPU time: the process's CPU time per step, all "
           "threads):", "",
           "| file | device | model | variant | scan unroll | matmul precision "
           "| XLA flags | compile | step median (best) | host CPU time | ratio "
           "to current (best) | target |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, d in files:
    flags = d.get("env", {}).get("XLA_FLAGS", "")
    flags = "command buffers incl. WHILE" if "WHILE" in flags else (
        flags or "–")
    for r in d.get("steps", []):
      ratio = (f"{r['min_step_over_current']:.2f}"
               if "min_step_over_current" in r else "1")
      target = _ms(r.get("target_s")) or "–"
      # Rows from before config.scan_unroll existed ran unroll 1 by default.
      unroll = _unroll(r)
      lines.append(
          f"| `{name}` | {_device(d).removeprefix('gpu: ')} | "
          f"{MODEL_LABELS[_model_key(r)]} | {r['variant']} | "
          f"{unroll} | {r['precision']} | {flags} | {_s(r['compile_s'])} | "
          f"{_ms(r['step_s'])} ({_ms(r['min_step_s'])}) | "
          f"{_ms(r.get('cpu_step_s'))} | {ratio} | {target} |")
  return lines


def gpu_budget_table():
  """What issue 11's GPU targets leave for the stack, per sequential update.

  Every stack model's step contains its LSTM controller's step, so the
  bare LSTM's best full-float32 GPU step is a floor under all of them; what
  a target leaves above it, spread over the 2·n sequential updates of a
  step (n forward, n backward), is the time the stack's own update may
  take. Compared with what it takes today: the model's best step minus the
  same LSTM floor, per update. All figures from the GPU rows above, of
  one device (`_main_gpu_files`).
  """
  files, device = _main_gpu_files()
  rows = [r for _, d in files for r in d.get("steps", [])
          if r.get("precision") == "highest"]
  lstm = [r for r in rows if r["model"] == "lstm"]
  if not lstm:
    return []
  floor = min(lstm, key=lambda r: r["min_step_s"])
  updates = 2 * floor["length"]
  per_update = floor["min_step_s"] / updates
  lines = [
      f"What the GPU targets leave for the stack (from the {device} rows "
      "above): "
      "every stack model's step contains its LSTM controller's, and the "
      f"bare LSTM's best step is {_ms(floor['min_step_s'])} (scan unroll "
      f"{_unroll(floor)}), {per_update * 1e6:.1f} µs for each of the "
      f"{updates} sequential updates of a step ({floor['length']} forward, "
      f"{floor['length']} backward). A target minus that floor is the time "
      "left for the stack's own work, forward and backward, per update; "
      "today's is the model's best step (any unroll) minus the same floor:",
      "",
      "| model | target | left for the stack | per update | today, per "
      "update | today / left |",
      "|---|---|---|---|---|---|"]
  for key in ("jm", "gref", "ns22", "ns33"):
    mine = [r for r in rows if _model_key(r) == key and r.get("target_s")]
    if not mine:
      continue
    best = min(mine, key=lambda r: r["min_step_s"])
    left = best["target_s"] - floor["min_step_s"]
    today = best["min_step_s"] - floor["min_step_s"]
    lines.append(
        f"| {MODEL_LABELS[key]} | {_ms(best['target_s'])} | {_ms(left)} | "
        f"{left / updates * 1e6:.1f} µs ({left / floor['min_step_s']:.2f}× "
        f"the LSTM's update) | {today / updates * 1e6:.1f} µs (unroll "
        f"{_unroll(best)}) | {today / left:.1f}× |")
  return lines


def stack_table():
  """The stack DP alone (benchmarks/ns_stack.py)."""
  d = _load("ns_stack.json")
  gpu = _load("gpu_h200.json")
  if d is None:
    return []
  rows = {(r["variant"], r["Q"], r["n"]): r for r in d["rows"]
          if "error" not in r}
  grows = {(r["variant"], r["Q"], r["n"]): r
           for r in (gpu or {}).get("ns_stack_rows", [])}
  lines = ["Stack DP alone, batch 10, float32 (`ns_stack.py` → "
           f"`ns_stack.json`, {_device(d)}; GPU: `gpu_h200.json`, H200, "
           "default precision):", "",
           "| variant | Q=S | n | fwd | fwd+bwd | XLA temp | H200 fwd / "
           "fwd+bwd |", "|---|---|---|---|---|---|---|"]
  names = {"shares": "shares table (rns_stack; the default), custom VJP, "
                     "O(n²) memory",
           "custom": "scaled table (ns_stack), custom VJP, O(n²) memory",
           "autodiff": "plain autodiff of the scan, O(n³) memory",
           "logspace": "naive log-space DP"}
  for key in sorted(rows, key=lambda k: (list(names).index(k[0]), k[1],
                                         k[2])):
    r = rows[key]
    if key[2] not in (80, 200, 400):
      continue
    g = grows.get(key)
    gcell = f"{_ms(g['fwd_s'])} / {_ms(g['fwd_bwd_s'])}" if g else ""
    lines.append(f"| {names[key[0]]} | {key[1]} | {key[2]} | "
                 f"{_ms(r['fwd_s'])} | {_ms(r['fwd_bwd_s'])} | "
                 f"{r['xla_temp_mib']:,.0f} MiB | {gcell} |")
  for name, r in sorted(d.get("ratios", {}).items()):
    lines.append("")
    lines.append(f"Memory growth {name}, peak(n=400) / peak(n=200): XLA temp "
                 f"{r['xla_temp_400_over_200']:.2f}, net RSS "
                 f"{r['net_rss_400_over_200']:.2f} (quadratic: 4, cubic: 8).")
  return lines


def scale_table():
  """K vmapped models vs K sequential runs (benchmarks/scale.py)."""
  lines = []
  unrolled = sorted(os.path.basename(p) for p in glob.glob(
      os.path.join(RESULTS, "scale_gpu_unroll*.json"))) + sorted(
          os.path.basename(p) for p in glob.glob(
              os.path.join(RESULTS, "scale_gpu_pallas*.json")))
  for name in ["scale_cpu.json", "scale_gpu.json", "scale_gpu_h200.json"] + \
      unrolled:
    d = _load(name)
    if d is None:
      continue
    if name == "scale_gpu_h200.json" and _load("scale_gpu.json"):
      continue
    how = ("per-model lengths from " + str(d["lengths"]) + ", padded to the "
           "longest per step" if len(d.get("lengths", [])) > 1 else
           f"all models at length {d['length']}")
    if "scan_unroll" in d:
      how += f", scan unroll {d['scan_unroll']}"
    if d.get("update_kernels", "xla") != "xla":
      how += ", the stack's updates as Pallas kernels"
    if not lines:
      lines += ["K NS-RNNs (Q=S=2, batch 10) vmapped in one program vs the "
                "same K trained one after another (`scale.py`):", "",
                "| source | device | lengths | K | vmapped step | vmapped "
                "strings/s | sequential strings/s | speed-up (wall) | "
                "speed-up (CPU time) |",
                "|---|---|---|---|---|---|---|---|---|"]
    for r in d["model_axis"]:
      lines.append(f"| `{name}` | {_device(d)} | {how} | {r['K']} | "
                   f"{_ms(r['step_time_vmapped_s'])} | "
                   f"{r['strings_per_s_vmapped']:,.0f} | "
                   f"{r['strings_per_s_sequential']:,.0f} | "
                   f"{r['speedup']:.2f}× | "
                   + (f"{r['speedup_cpu_time']:.2f}× |"
                      if "speedup_cpu_time" in r else " |"))
  return lines


def data_table():
  d = _load("data.json")
  if d is None:
    return []
  load = (f", load average {d['load_average_1_5_15'][0]:.0f}"
          if "load_average_1_5_15" in d else "")
  lines = [f"Data generation, paper sizes (`data.py` → `data.json`, "
           f"{_device(d)}{load}): whole splits with every string's exact lower "
           "bound:", "", "| task | make_splits (wall) | CPU time |",
           "|---|---|---|"]
  for r in d["rows"]:
    cpu = _s(r["make_splits_cpu_s"]) if "make_splits_cpu_s" in r else ""
    lines.append(f"| {r['task']} | {_s(r['make_splits_s'])} | {cpu} |")
  return lines


def _when(d, *extra):
  """"; code at C; conditions; extra..." for a caption (empty parts left
  out)."""
  parts = (f"code at {_commit(d)}" if _commit(d) else "",
           d.get("conditions", "")) + extra
  return "".join(f"; {x}" for x in parts if x)


def profile_table():
  """Where a train step's time goes, by kind of op (profile_step_*.json)."""
  out = []
  for path in sorted(glob.glob(os.path.join(RESULTS, "profile_step_*.json"))):
    name = os.path.basename(path)
    d = _load(name)
    if d.get("command_buffers"):
      # A GPU trace with command buffers on names no kernel: nothing to
      # share out (the file keeps the default program's untraced steps).
      continue
    kinds = []
    for m in d["models"]:
      for k in m["by_kind_ms_per_step"]:
        if k not in kinds:
          kinds.append(k)
    when = _when(
        d, f"the stack's contractions: {d['contractions']} (rns_stack)"
        if d.get("contractions", "dot") != "dot" else "",
        "the stack's updates as Pallas kernels (rns_stack.UPDATE_KERNELS)"
        if d.get("update_kernels", "xla") != "xla" else "",
        f"the batch split over {d['cpu_devices']} CPU devices "
        "(`--cpu_devices`; time summed over the devices' threads)"
        if d.get("cpu_devices", 1) > 1 else "")
    out += [f"Where the train step's time goes (`benchmarks/profile_step.py`, "
            f"`{name}`, {_device(d)}{when}; batch {d['batch']}, n = "
            f"{d['length']}; "
            "exclusive time of each traced XLA op, summed over the runtime's "
            "threads, as a share of that total; matmuls with an operand of "
            f"≥ {d['table_elements']:,} elements count as table-sized):", "",
            "| model | step (untraced) | " + " | ".join(kinds) + " | "
            "largest op |", "|---|---|" + "---|" * len(kinds) + "---|"]
    for m in d["models"]:
      busy = m["busy_ms_per_step"] or 1.0
      shares = " | ".join(
          f"{100 * m['by_kind_ms_per_step'].get(k, 0.0) / busy:.0f}%"
          for k in kinds)
      top = m["top_ops"][0] if m["top_ops"] else None
      largest = (f"{top['kind']} {top['shape'].split('{')[0]}, "
                 f"{top['us_per_call']:.0f} µs × {top['calls_per_step']:.0f} "
                 "per step" if top else "no traced op (trace lines: "
                 f"{', '.join(m['trace_lines']) or 'none'})")
      out.append(f"| {MODEL_LABELS.get(m['model'], m['model'])} | "
                 f"{_ms(m['step_ms_untraced_best'] / 1e3)} | {shares} | "
                 f"{largest} |")
    out.append("")
  return out[:-1]


def dispatch_floor_table():
  """Train steps against their dispatch floor (train_step_*.json rows with
  `dispatch_floor_s`: `benchmarks/train_step.py --dispatch_floor`)."""
  out = []
  for path in sorted(glob.glob(os.path.join(RESULTS, "train_step_*.json"))):
    name = os.path.basename(path)
    d = _load(name)
    rows = [r for r in d.get("steps", []) if "dispatch_floor_s" in r]
    if not rows:
      continue
    when = _when(d)
    out += [f"Each step against its dispatch floor (`benchmarks/train_step.py "
            f"--dispatch_floor`, `{name}`, {_device(d)}{when}): the ops its "
            "compiled program runs one after another (loops counted per "
            "trip; on two devices, per device) times the time of one tiny "
            "op measured in the same run (a chain of ops on 10 × 4 arrays). "
            "A step many times its floor spends its time in the ops' work, "
            "not in running many of them:", "",
            "| model | variant | best step | ops per step | per op | "
            "dispatch floor | step / floor | step / FLOP limit |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
      flop = (f"{r['limit_ratio']:.1f}×" if "limit_ratio" in r else "")
      variant = "plain" if r["variant"] == "current" else r["variant"]
      out.append(
          f"| {MODEL_LABELS.get(_model_key(r), _model_key(r))} | {variant} | "
          f"{_ms(r['min_step_s'])} | {r['sequential_ops']:,} | "
          f"{r['op_dispatch_us'] * 1e3:.0f} ns | "
          f"{_ms(r['dispatch_floor_s'])} | "
          f"{r['dispatch_floor_ratio']:.1f}× | {flop} |")
    out.append("")
  return out[:-1]


def kernel_resources_table():
  """The Pallas stack kernels compiled for a GPU (kernel_resources.json)."""
  d = _load("kernel_resources.json")
  if d is None:
    return []
  names = ("forward_update", "backward_table_update", "local_bwd")
  out = [f"The Pallas stack kernels compiled for {d['target']} on a CPU "
         "machine, without a GPU (`benchmarks/kernel_resources.py`, "
         f"`kernel_resources.json`; triton {d['triton']}, jax {d['jax']}; "
         f"batch {d['batch']}, n = {d['length']}, float32; "
         + (f"code at {_commit(d)}; " if _commit(d) else "")
         + "registers per thread, spilled bytes, compile time of the three; "
         "static, no timing):", "",
         "| code | Q=S | tiles (rows/chunk/warps; grid: a program per row "
         "tile) | "
         + " | ".join(f"`{n}` registers" for n in names)
         + " | spilled | compile |", "|---|---|---|" + "---|" * len(names)
         + "---|---|"]
  groups = {}
  for r in d["kernels"]:
    key = (r.get("code", "current"), r["q"], r["row_tile"], r["kt_chunk"],
           r["num_warps"], r.get("row_grid", False))
    groups.setdefault(key, {})[r["kernel"]] = r
  for (code, q, rows, chunk, warps, grid), by in groups.items():
    ok = [by[n] for n in names if n in by and "error" not in by[n]]
    regs = " | ".join(str(by[n]["reg"]) if n in by and "error" not in by[n]
                      else "failed" for n in names)
    out.append(f"| {code} | {q} | {rows}/{chunk}/{warps}"
               f"{' grid' if grid else ''} | {regs} | "
               f"{max((r['local'] for r in ok), default=0)} B | "
               f"{sum(r['compile_s'] for r in ok):.1f} s |")
  return out


# The CPU run whose table docs/benchmarks.md's prose cites ("the first
# table"; the default step against `baseline 7608b8b`, jax 0.10.2).
EARLIER_CPU_RUN = "train_step_cpu_vs_7608b8b.json"


def headline_block():
  """README's train-step table: the latest CPU run beside the GPU's."""
  return "\n".join(train_step_table()) + "\n"


def benchmarks_block():
  out = []
  for part in (train_step_table(EARLIER_CPU_RUN), cpu_comparison_table(),
               dispatch_floor_table(), profile_table(),
               kernel_resources_table(),
               cpu_suite_line(), suite_compile_line(),
               gpu_suite_line(),
               gpu_variants_table(),
               gpu_budget_table(), stack_table(),
               scale_table(), data_table()):
    if part:
      out += part + [""]
  return "\n".join(out).rstrip() + "\n"


def compile_block():
  name = "compile_study_cpu.json"
  d = _load(name)
  studies = (d or {}).get("compile_study", [])
  if not studies:
    return f"No compile study in `{name}` yet.\n"
  clock = studies[0].get("clock", "wall clock")
  lines = ["Measured with `benchmarks/train_step.py --compile_study` "
           f"(`{name}`, {_device(d)}, load average "
           f"{d['machine']['load_average_1_5_15'][0]:.0f}; {clock}; marked "
           "reversal, 20 training lengths 41-79, "
           f"{studies[0]['steps_per_epoch']} steps per epoch, step times "
           "interpolated between the measured lengths "
           f"{', '.join(studies[0]['measured'])}):", "",
           "| model | strategy | compiles | compile total | steps per epoch "
           "| 100 epochs |", "|---|---|---|---|---|---|"]
  for st in studies:
    for key in ("per_length", "bucket"):
      r = st[key]
      lines.append(f"| {MODEL_LABELS.get(st['model'], st['model'])} | {key} "
                   f"| {r['compiles']} | {_s(r['compile_total_s'])} | "
                   f"{_s(r['epoch_steps_s'])} | {_s(r['100_epochs_s'])} |")
  return "\n".join(lines) + "\n"


def _g3(x):
  """Three significant digits (ms / µs figures of the stack benchmarks)."""
  return "—" if x is None else f"{x:.3g}"


def _int(x):
  return "—" if x is None else f"{x:.0f}"


def limited_stack_block():
  name = "rns_stack.json"
  d = _load(name)
  if d is None:
    return f"No `{name}` yet.\n"
  c = d["config"]
  lines = [f"`benchmarks/rns_stack.py` (`{name}`; {c['device']}, B = {c['B']}, "
           f"Q = {c['Q']}, S = {c['S']}, D = {c['D']}, {c['dtype']}; per-symbol "
           "figures; \"temp\" = XLA's static buffer plan):", "",
           "| n | eval µs/symbol | eval temp B/symbol | train (L = "
           f"{c['truncation_length']}) µs/symbol | train temp B/symbol | "
           "unlimited eval µs/symbol |", "|---|---|---|---|---|---|"]
  for r in d["rows"]:
    lines.append(
        f"| {r['n']} | {r['eval_us_per_symbol']:.0f} | "
        f"{r['eval_temp_bytes_per_symbol']:.0f} | "
        f"{r['train_us_per_symbol']:.0f} | "
        f"{r['train_temp_bytes_per_symbol']:.0f} | "
        f"{_int(r.get('unlimited_eval_us_per_symbol'))} |")
  return "\n".join(lines) + "\n"


def rns_vs_ns_block():
  """The RNS DP against ns_stack and its own earlier revision.

  rns_vs_ns_n80.json (more calls, quieter machine) supersedes the n = 80
  rows of rns_vs_ns.json, which ran beside the test suite.
  """
  base, n80 = _load("rns_vs_ns.json"), _load("rns_vs_ns_n80.json")
  if base is None:
    return "No `rns_vs_ns.json` yet.\n"
  rows = {(r["n"], r["Q"], r["S"]): (r, base["config"]) for r in base["rows"]}
  for r in (n80 or {}).get("rows", []):
    rows[(r["n"], r["Q"], r["S"])] = (r, n80["config"])
  c = base["config"]
  lines = ["`benchmarks/rns_stack.py --vs-ns --baseline "
           f"{c['baseline_revision']}` ({c['device']}, B = {c['B']}, "
           f"{c['dtype']}; ms per symbol, min of interleaved calls in one "
           "process on the same inputs; \"before\" = rns_stack.py of "
           f"{c['baseline_revision']} loaded into the same process; calls per "
           "row in the last column):", "",
           "| n | Q = S | ns_stack fwd | RNS fwd (before) | ns_stack fwd+bwd | "
           "RNS fwd+bwd (before) | RNS / ns fwd, fwd+bwd | before / after "
           "fwd, fwd+bwd | calls |", "|---|---|---|---|---|---|---|---|---|"]
  for key in sorted(rows):
    r, cfg = rows[key]
    lines.append(
        f"| {r['n']} | {r['Q']} | {_g3(r['ns_stack_fwd_ms_per_symbol'])} | "
        f"{_g3(r['rns_fwd_ms_per_symbol'])} "
        f"({_g3(r['rns_baseline_fwd_ms_per_symbol'])}) | "
        f"{_g3(r['ns_stack_fwd_bwd_ms_per_symbol'])} | "
        f"{_g3(r['rns_fwd_bwd_ms_per_symbol'])} "
        f"({_g3(r['rns_baseline_fwd_bwd_ms_per_symbol'])}) | "
        f"{r['rns_over_ns_fwd']:.2f}, {r['rns_over_ns_fwd_bwd']:.2f} | "
        f"{r['baseline_over_rns_fwd']:.1f}, "
        f"{r['baseline_over_rns_fwd_bwd']:.1f} | {cfg['repeats']} |")
  return "\n".join(lines) + "\n"


def vrns_block():
  quick, speed = _load("vrns_stack_quick.json"), _load("vrns_stack_speed.json")
  out = []
  if quick:
    out += ["`benchmarks/vrns_stack.py --quick` (`vrns_stack_quick.json`, "
            f"{quick['device']}, {quick['dtype']}, batch "
            f"{quick['rows'][0]['batch']}, Q-S = {quick['rows'][0]['Q']}-"
            f"{quick['rows'][0]['S']}; {quick['note']}"
            # Files without "machine" predate the blocked log-space layout.
            + ("" if "machine" in quick
               else "; before the blocked layout below") + "):", "",
            "| n | stack | fwd | fwd+bwd | XLA gradient temp |",
            "|---|---|---|---|---|"]
    for r in quick["rows"]:
      label = {"vrns": f"VRNS m={r['m']}", "vrns_m1": "VRNS m=1",
               "vrns_log_space": f"VRNS m={r['m']}, log space",
               "ns": "NS"}[r["variant"]]
      out.append(f"| {r['n']} | {label} | {_ms(r['fwd_ms'] / 1e3)} | "
                 f"{_ms(r['fwd_bwd_ms'] / 1e3)} | "
                 f"{r['grad_temp_mib']:.1f} MiB |")
    out.append("")
  if speed:
    med = {(r["variant"], r["pass"]): r["median_ms"] for r in speed["rows"]}
    ra = speed["ratios"]
    out += [f"`benchmarks/vrns_stack.py --compare --before={speed['before']}` "
            f"(`vrns_stack_speed.json`, {speed['device']}, n = {speed['n']}, "
            f"B = {speed['batch']}, Q-S-m = {speed['Q']}-{speed['S']}-"
            f"{speed['m']}, median of {speed['reps']} interleaved calls in one "
            f"process, load {speed['load_average_1min']:.0f}):", "",
            "| pass | VRNS before | VRNS | speed-up | RNS | NS | VRNS / RNS "
            "| VRNS / NS |", "|---|---|---|---|---|---|---|---|"]
    for p, label in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
      out.append(
          f"| {label} | {_ms(med[('vrns_before', p)] / 1e3)} | "
          f"{_ms(med[('vrns', p)] / 1e3)} | "
          f"{ra['before_over_after_' + p]:.1f}× | "
          f"{_ms(med[('rns', p)] / 1e3)} | {_ms(med[('ns', p)] / 1e3)} | "
          f"{ra['vrns_over_rns_' + p]:.3g}× | "
          f"{ra['vrns_over_ns_' + p]:.3g}× |")
  if not out:
    return "No VRNS benchmark results yet.\n"
  return "\n".join(out).rstrip() + "\n"


def limited_vrns_block():
  """The windowed vector stack's time per update by length (one table)."""
  name = "limited_vrns.json"
  d = _load(name)
  if d is None:
    return f"No `{name}` yet.\n"
  cell = {(r["variant"], r["n"], r["pass"]): r for r in d["rows"]}
  variants = list(dict.fromkeys(r["variant"] for r in d["rows"]))
  lengths = sorted({r["n"] for r in d["rows"]})
  lines = [f"`benchmarks/limited_vrns.py` (`{name}`, {_device(d)}, B = "
           f"{d['batch']}, Q-S-m = {d['Q']}-{d['S']}-{d['m']}, {d['dtype']}; "
           f"median of {d['reps']} calls, {d['note']}; time per update, "
           "forward / forward+backward"
           + ("" if any(r["variant"] == "unlimited, log space"
                        for r in d["rows"])
              else "; the unlimited stack only at the shorter lengths")
           + "):", "",
           "| n | " + " | ".join(variants) + " |",
           "|---" * (len(variants) + 1) + "|"]
  for n in lengths:
    row = []
    for v in variants:
      f, b = cell.get((v, n, "fwd")), cell.get((v, n, "fwd_bwd"))
      row.append("—" if f is None else
                 f"{f['per_update_ms']:.3g} / {b['per_update_ms']:.3g} ms")
    lines.append(f"| {n} | " + " | ".join(row) + " |")
  return "\n".join(lines) + "\n"


def _against_lookup(d, key, speedup_key, intro, variant, default,
                    memory=False):
  """Lines of a table of the corpus step's `key` variant against the
  default lookup step, from the rows that have it ([] if none)."""
  rows = [r for r in d["rows"] if f"{key}_ms" in r]
  if not rows:
    return []
  head, sep = f"| model | {variant} | {default} | speed-up |", "|---" * 4
  if memory:
    head += f" temporary memory, {variant} / {default} |"
    sep += "|---"
  lines = ["", intro, "", head, sep + "|"]
  for r in rows:
    line = (f"| {r['label']} | {_ms(r[key + '_ms'] / 1e3)} | "
            f"{_ms(r['lookup_ms'] / 1e3)} | {r[speedup_key]:.2f}× |")
    if memory:
      mem = r["temp_mib"]
      line += (f" {mem[key] / 1024:.1f} / {mem['lookup'] / 1024:.1f} GiB |")
    lines.append(line)
  return lines


def corpus_step_block():
  """Corpus train step at PTB size, one-hot input vs lookup (one table)."""
  name = "corpus_step.json"
  d = _load(name)
  if d is None:
    return f"No `{name}` yet.\n"
  r0 = d["rows"][0]
  lines = [f"`benchmarks/corpus_step.py` (`{name}`, {_device(d)}, V = "
           f"{r0['vocab']:,}, H = {r0['hidden']}, B = {r0['batch']}, T = "
           f"{r0['bptt']}, {d['dtype']}; {d['note']}; median of {d['reps']}):",
           "", "| model | one-hot input | `input_lookup` | speed-up | "
           "PTB epoch (≈ 830 chunks), lookup | step's temporary memory |",
           "|---|---|---|---|---|---|"]
  for r in d["rows"]:
    epoch_s = 830 * r["lookup_ms"] / 1e3
    epoch = (f"{epoch_s / 60:.0f} min" if epoch_s >= 120
             else f"{epoch_s:.0f} s")
    temp = r.get("temp_mib", {}).get("lookup")
    temp = "—" if temp is None else (f"{temp / 1024:.1f} GiB" if temp >= 1024
                                     else f"{temp:.0f} MiB")
    lines.append(f"| {r['label']} | {_ms(r['one_hot_ms'] / 1e3)} | "
                 f"{_ms(r['lookup_ms'] / 1e3)} | {r['speedup']:.2f}× | "
                 f"{epoch} | {temp} |")
  lines += _against_lookup(
      d, "sliced", "split_speedup", "The input matrix split before the "
      "time loop (`models.split_input_matrix`), measured in the same run "
      "(input by lookup):", "sliced in the loop", "split")
  lines += _against_lookup(
      d, "log_space", "shares_speedup", "The window's representation, "
      "measured in the same run (input by lookup; `limited_vrns`: shares, "
      "the default, against log space):", "log space", "shares",
      memory=True)
  return "\n".join(lines) + "\n"


REPRODUCE_WORKERS_FILES = ("reproduce_workers_5epochs.json",
                           "reproduce_workers_1epoch.json",
                           "reproduce_workers_pinning.json",
                           "reproduce_workers_hardest_cfl_ns.json")


def _table_over_files(files, header, rows_of):
  """A Markdown table's lines: `header`, then `rows_of(name, data)` for each
  of `files` committed (in that order); [] when none is."""
  out = []
  for name in files:
    d = _load(name)
    if d is not None:
      out += (header if not out else []) + rows_of(name, d)
  return out


def reproduce_workers_block():
  """How `reproduce` spends a CPU's cores (benchmarks/reproduce_workers.py)."""

  def rows_of(name, d):
    rows = []
    for r in d["rows"]:
      # Files written before --modes call the speed-up after its baseline.
      speedup = r.get("speedup", r.get("speedup_vs_sequential"))
      mode = r["mode"]
      if mode == "workers" and "speedup_against" not in d:
        mode += " (unpinned: measured before workers were pinned)"
      rows.append(f"| `{name}` | {d['runs']} × {d['max_epochs']} epoch(s) "
                  f"of {d['model']} on {d['task']}, lr "
                  f"{d['learning_rate']:g} | "
                  f"{mode} | `{r['flags']}` | {r['wall_s']:.1f} | "
                  f"{r['runs_per_hour']:.1f} | {speedup:.2f}× |")
    return rows

  out = _table_over_files(
      REPRODUCE_WORKERS_FILES,
      ["| file | runs | mode | flags | wall s | runs / hour | "
       "vs the file's first row |", "|---|---|---|---|---|---|---|"], rows_of)
  if not out:
    return "No reproduce_workers results yet.\n"
  devices = sorted({_load(n)["device"] for n in REPRODUCE_WORKERS_FILES
                    if _load(n) is not None})
  out += ["", f"{', '.join(devices)}; each file one run "
          "(`benchmarks/results/reproduce_workers_*.json`)."]
  return "\n".join(out) + "\n"


CONCURRENT_STEPS_FILES = ("concurrent_steps.json", "concurrent_steps_ns33.json")


def concurrent_steps_block():
  """Concurrent processes pinned or not (benchmarks/concurrent_steps.py)."""

  def rows_of(name, d):
    rows = []
    for model, summ in d["summary"].items():
      runs = [r for r in d["rows"] if r["model"] == model]
      per = lambda mode: ", ".join(  # pylint: disable=cell-var-from-loop
          "/".join(str(x) for x in r["steps"]) for r in runs
          if r["mode"] == mode)
      rows.append(f"| `{name}` | {MODEL_LABELS.get(model, model)} | "
                  f"{len({r['round'] for r in runs})} | {summ['free_steps']} | "
                  f"{summ['pinned_steps']} | {summ['pinned_over_free']:.2f}× | "
                  f"{per('free')}; {per('pinned')} |")
    return rows

  out = _table_over_files(
      CONCURRENT_STEPS_FILES,
      ["| file | model | rounds | steps, free | steps, pinned | "
       "pinned / free | steps per process and round (free; pinned) |",
       "|---|---|---|---|---|---|---|"], rows_of)
  if not out:
    return "No concurrent_steps results yet.\n"
  d = _load(CONCURRENT_STEPS_FILES[0]) or _load(CONCURRENT_STEPS_FILES[1])
  out += ["", f"{d['processes']} processes at once, each timing its train step "
          f"(batch {d['batch']}, n = {d['length']}) back to back for "
          f"{d['window_s']:g} s, {d['device']}; each file one run."]
  notes = {_load(n).get("note") for n in CONCURRENT_STEPS_FILES
           if _load(n) is not None} - {None}
  out += [f"Note: {n}." for n in sorted(notes)]
  return "\n".join(out) + "\n"


def concurrent_chunks_block():
  """The NS-RNN's stack chunks with two pinned workers sharing the caches
  (concurrent_steps.py --batch_chunk)."""
  name = "concurrent_steps_chunks.json"
  d = _load(name)
  if d is None:
    return f"No `{name}` yet.\n"
  lines = ["| model | stack chunk (strings) | steps, both processes | "
           "/ automatic | steps per process and round |",
           "|---|---|---|---|---|"]
  for model in dict.fromkeys(r["model"] for r in d["rows"]):
    runs = [r for r in d["rows"] if r["model"] == model]
    total = lambda c: sum(r["total_steps"] for r in runs  # pylint: disable=cell-var-from-loop
                          if r["batch_chunk"] == c)
    for chunk in sorted({r["batch_chunk"] for r in runs}):
      per = ", ".join("/".join(map(str, r["steps"])) for r in runs
                      if r["batch_chunk"] == chunk)
      lines.append(f"| {MODEL_LABELS.get(model, model)} | "
                   f"{chunk or 'automatic'} | {total(chunk)} | "
                   f"{total(chunk) / total(0):.2f}× | {per} |")
  rounds = len({r["round"] for r in d["rows"]})
  return ("\n".join(lines) + f"\n\n`{name}`: {d['processes']} pinned "
          f"processes at once, each timing its train step (batch "
          f"{d['batch']}, n = {d['length']}) for {d['window_s']:g} s, "
          f"{rounds} rounds, {d['device']}; {d['note']}.\n")


def huge_pages_block():
  """Train steps with and without transparent huge pages (one table)."""
  name = "huge_pages.json"
  d = _load(name)
  if d is None:
    return f"No `{name}` yet.\n"
  lines = [f"`benchmarks/huge_pages.py` (`{name}`, {_device(d)}, "
           f"transparent huge pages `{d['thp_enabled']}`, {d['dtype']}; "
           f"{d['pairs']} children of {d['steps']} steps per setting; "
           f"{d['note']}):", "",
           "| workload | plain | `glibc.malloc.hugetlb=1` | speed-up | minor "
           "page faults per step |", "|---|---|---|---|---|"]
  for r in d["rows"]:
    lines.append(
        f"| {r['label']} | {_ms(r['plain_ms'] / 1e3)} | "
        f"{_ms(r['huge_pages_ms'] / 1e3)} | {r['speedup']:.2f}× | "
        f"{r['plain_faults_per_step']:,.0f} → "
        f"{r['huge_pages_faults_per_step']:,.0f} |")
  return "\n".join(lines) + "\n"


def window_vjp_block():
  """The windowed stack's hand-written gradient against autodiff."""
  files = [n for n in ("window_vjp.json", "window_vjp_huge_pages.json")
           if _load(n) is not None]
  if not files:
    return "No `window_vjp.json` yet.\n"
  lines = ["`benchmarks/window_vjp.py` (limited_stack.WINDOW_VJP = \"custom\", "
           "the default, against \"autodiff\"; float32, Q-S = 2-3; each file "
           "one run):", "",
           "| file | case | hand-written | autodiff | speed-up | temporary "
           "memory, hand-written / autodiff |", "|---|---|---|---|---|---|"]
  for name in files:
    d = _load(name)
    for r in d["rows"]:
      lines.append(
          f"| `{name}` | {r['label']} | {_ms(r['custom_ms'] / 1e3)} | "
          f"{_ms(r['autodiff_ms'] / 1e3)} | {r['speedup']:.2f}× | "
          f"{r['custom_temp_mib']:.1f} / {r['autodiff_temp_mib']:.1f} MiB |")
  notes = "; ".join(f"`{n}`: {_device(_load(n))}, {_load(n)['note']}"
                    for n in files)
  text = "\n".join(lines) + f"\n\n{notes}.\n"
  d = _load("window_vjp_before_after.json")
  if d is not None:
    ref = d["baseline_ref"]
    rows = ["", f"The hand-written gradient before and after a change "
            f"(`window_vjp_before_after.json`, `--baseline_ref={ref}`; "
            f"{_device(d)}; {d['note']}; median of {d['reps']}):", "",
            f"| case | before (`{ref}`) | after | speed-up (median / best) "
            "| temporary memory, before / after |", "|---|---|---|---|---|"]
    for r in d["rows"]:
      rows.append(
          f"| {r['label']} | {_ms(r['before_ms'] / 1e3)} | "
          f"{_ms(r['after_ms'] / 1e3)} | {r['speedup']:.2f}× / "
          f"{r['speedup_best']:.2f}× | {r['before_temp_mib']:.1f} / "
          f"{r['after_temp_mib']:.1f} MiB |")
    text += "\n".join(rows) + "\n"
  return text


def _log_table_lines(d, title):
  """One log-vs-shares timing table (log_stack.py's JSON) as Markdown."""
  lines = [f"{title}; B = {d['rows'][0]['B']}, n = {d['rows'][0]['n']}, "
           "float32, unnormalised N(0, 3²) log-weights; one run):", "",
           "| Q=S | table | fwd | fwd+bwd | gradient temporaries | log / "
           "shares (fwd, fwd+bwd) | largest reading difference |",
           "|---|---|---|---|---|---|---|"]
  names = {"shares": "shares", "log": "log",
           "log_before": f"log at `{d.get('baseline')}`"}
  for r in d["rows"]:
    for name in [n for n in names if f"{n}_fwd_s" in r]:
      ratio = (f"{r['slowdown_fwd']:.0f}×, {r['slowdown_fwd_bwd']:.0f}×"
               if name == "log" else "")
      if name == "log_before":
        ratio = (f"(log is {r['speedup_fwd']:.1f}×, "
                 f"{r['speedup_fwd_bwd']:.1f}× faster)")
      diff = f"{r['max_reading_difference']:.1e}" if name == "log" else ""
      lines.append(f"| {r['Q']} | {names[name]} | {_ms(r[name + '_fwd_s'])} | "
                   f"{_ms(r[name + '_fwd_bwd_s'])} | "
                   f"{r[name + '_grad_temp_mib']:.1f} MiB | {ratio} | {diff} |")
  return "\n".join(lines) + f"\n\n{_device(d)}, {d['note']}.\n"


def _before_after(row, before, after):
  """"; the margin at REV took N× as long" where a row timed a baseline
  revision's margin beside it (--baseline), with whether they agree."""
  if "baseline" not in row:
    return ""
  same = "same margins" if row["same_margins"] else "margins DIFFER"
  return (f"; at {row['baseline']} the margin took "
          f"{row[before] / row[after]:.2f}× as long, {same}")


def share_margin_text():
  """The share margin's cost beside the forward (share_margin*.json)."""
  parts = []
  for name, what in (("share_margin.json", "`rns_stack.share_margin` beside "
                      "`rns_stack.run`"),
                     ("share_margin_window.json",
                      "`limited_stack.share_margin` beside `limited_stack.run`"
                      )):
    d = _load(name)
    if d is None:
      continue
    window = d["rows"][0]["window"]
    rows = ", ".join(f"Q = S = {r['Q']} {_ms(r['margin_s'])} vs "
                     f"{_ms(r['run_s'])} ({r['margin_over_run']:.2f}×"
                     f"{_before_after(r, 'margin_before_s', 'margin_s')})"
                     for r in d["rows"])
    parts.append(f"{what}{f' (window D = {window})' if window else ''}: "
                 f"{rows} (`{name}`)")
  if not parts:
    return ""
  d = _load("share_margin.json") or _load("share_margin_window.json")
  r = d["rows"][0]
  text = (f"\nThe share stack's {_margin_kind(d)} margin "
          "(`benchmarks/share_margin.py`; "
          f"B = {r['B']}, n = {r['n']}, float32, N(0, 3²) log-weights, "
          f"{_device(d)}, {d['note']}), a forward sweep of its own: "
          + "; ".join(parts) + ".\n")
  s = _load("stream_margin.json")
  if s is not None:
    r = s["rows"][0]
    rows = ", ".join(f"{x['label']} {x['margin_ms']:.1f} ms vs "
                     f"{x['eval_ms']:.1f} ms ({x['margin_over_eval']:.2f}×"
                     f"{_before_after(x, 'before_ms', 'margin_ms')})"
                     for x in s["rows"])
    text += ("\nA corpus run's margin (`config.valid_stack_margin`, "
             "`benchmarks/stream_margin.py`) is computed in the evaluation's "
             "own stream, one pass: `corpus_train.eval_chunk_margin` beside "
             f"`eval_chunk` per chunk of B = {r['batch']} rows × T = "
             f"{r['bptt']} tokens at PTB size (V = {r['vocab']:,}, H = "
             f"{r['hidden']}, float32, {_device(s)}, {s['note']}): {rows} "
             "(`stream_margin.json`).\n")
  return text


def certificates_text():
  """How many sweeps each margin proves exact (margin_certificates.json)."""
  d = _load("margin_certificates.json")
  if d is None:
    return ""
  r0 = d["rows"][0]
  lines = [
      f"\nWhat the margin proves (`benchmarks/margin_certificates.py`; "
      f"unnormalised N(0, scale²) log-weights, B = {r0['B']} per scale, "
      f"n = {r0['n']}, Q = S = {r0['Q']}, float32, {_device(d)}"
      + (f", {d['note']}" if d["note"] else "") + "): elements proven exact "
      "by the product margin and by the factor margin it replaced "
      f"(`rns_stack.share_margin` as of {d['baseline']}), and elements whose "
      "float32 readings and log Σα are exact (within 2e-5 and 1e-5 of the "
      "float64 sweep, itself proven by its float64 margin; elements where it "
      "is not are left out). No certificate may prove an inexact element.",
      "", "| scale | elements | exact | proven (product) | proven (factor) "
      "| proven but not exact (product / factor) |",
      "|---|---|---|---|---|---|"]
  lines += [f"| {r['scale']} | {r['elements']} | {r['exact']} | "
            f"{r['proven_product']} | {r['proven_factor']} | "
            f"{r['proven_not_exact_product']} / "
            f"{r['proven_not_exact_factor']} |" for r in d["rows"]]
  return "\n".join(lines) + "\n"


def _margin_kind(result):
  """Which stack margin a result measured: "product", or "factor" (the
  certificate before `rns_stack.MARGIN_KIND`, which results then did not
  name)."""
  return result.get("margin_kind", "factor")


def _proven_error(row):
  """' (proven: E)' for a log_stack.py --workdir row that has it."""
  e = row.get("max_log_prob_error_shares_proven")
  return "" if e is None else f" ({e:.1e})"


def log_stack_block():
  """The exact log-space table against the share table (log_stack.json),
  unlimited and with a window (log_stack_window.json)."""
  d = _load("log_stack.json")
  if d is None:
    return "No `log_stack.json` yet.\n"
  text = _log_table_lines(d, "`benchmarks/log_stack.py` (`config.stack_table"
                          " = \"log\"` against \"shares\"")
  w = _load("log_stack_window.json")
  if w is not None:
    text += "\n" + _log_table_lines(
        w, f"The memory-limited stacks, `benchmarks/log_stack.py --window "
        f"{w['window']}` (`limited_log_stack` against `limited_stack`, "
        f"window D = {w['window']}")
  text += share_margin_text()
  text += certificates_text()
  for path in sorted(glob.glob(os.path.join(RESULTS,
                                            "log_stack_trained*.json"))):
    name = os.path.basename(path)
    t = _load(name)
    margin = "min_log_share" in t["rows"][0]
    proof = "min_stack_margin" in t["rows"][0]
    err = "max_log_prob_error_shares" in t["rows"][0]
    factor = "min_factor_margin" in t["rows"][0]
    text += (f"\nA trained {t['model'].upper()}-RNN on both tables (`{name}`, "
             f"`log_stack.py --workdir`; {t['task']}, {t['note']}; float32, "
             f"{_device(t)}): largest differences per batch of strings"
             + ("; and the smallest log share of the exact table (the "
                "shares table flushes a share below ~−87 nats, and a "
                "product of two below −43)" if margin else "")
             + (f"; the share sweep's smallest {_margin_kind(t)} margin "
                "(`model.stack_margin`) and the strings it proves exact "
                "(margin above −40.2 nats)" if proof else "")
             + ("; the same for the factor margin it replaced "
                "(`rns_stack.share_margin` as of 4ee2779)" if factor else "")
             + ("; and each float32 table's largest ln p(w) error against "
                "the same parameters in float64 (share table, proven exact "
                "by its float64 margin; in brackets the shares' on the "
                "strings the float32 margin proves flush-free, i.e. float32 "
                "rounding alone)" if err else "")
             + ".\n\n| n | strings | ln p(w) | readings |"
             + (" smallest log share |" if margin else "")
             + (" smallest margin | proven exact |" if proof else "")
             + (" factor margin | proven (factor) |" if factor else "")
             + (" shares error | log error |" if err else "")
             + "\n|---|---|---|---|"
             + "---|" * (margin + 2 * proof + 2 * factor + 2 * err) + "\n")
    text += "".join(f"| {r['n']} | {r['strings']} ({r['count']}) | "
                    f"{r['max_log_prob_difference']:.1e} | "
                    f"{r['max_reading_difference']:.1e} |"
                    + (f" {r['min_log_share']:.1f} |" if margin else "")
                    + (f" {r['min_stack_margin']:.1f} | "
                       f"{r['fraction_proven_exact']:.0%} |" if proof else "")
                    + (f" {r['min_factor_margin']:.1f} | "
                       f"{r['fraction_proven_factor']:.0%} |" if factor else "")
                    + (f" {r['max_log_prob_error_shares']:.1e}"
                       + _proven_error(r)
                       + f" | {r['max_log_prob_error_log']:.1e} |"
                       if err else "")
                    + "\n" for r in t["rows"])
    if "forward_s" in t:
      f = t["forward_s"]
      text += (f"\nForward (trace) on {t['rows'][0]['count']} of its "
               f"language's strings of length {t['timed_length']}: shares "
               f"{_ms(f['shares'])}, log {_ms(f['log'])} "
               f"({f['log'] / f['shares']:.0f}×), log with every pop term "
               f"by logsumexp {_ms(f['log_logsumexp'])} (the matmul path, "
               "which falls back to the logsumexp on an update whose "
               "exponentials would underflow, "
               f"{f['log_logsumexp'] / f['log']:.1f}× faster).\n")
  return text


RERUN_RECORDS_FILES = ("rerun_records_marked_reversal_ns.json",
                       "rerun_records_marked_reversal_ns_float64.json",
                       "rerun_records_marked_reversal_ns_xavier.json")


def _paper_mean_at(task, model, epoch):
  """The paper's Figure 3 mean at `epoch` (results/paper_figures.json)."""
  sys.path.insert(0, REPO)
  from nsrnn_jax import paper_figures  # pylint: disable=g-import-not-at-top
  curve = paper_figures.curve(paper_figures.load(), "train", task, model)
  if not curve or epoch not in curve["x"]:
    return None
  return curve["mean"][curve["x"].index(epoch)]


def _rerun_means_table(files):
  """Mean validation CE difference per epoch: the paper's Figure 3 beside
  each rerun_records file's runs (per learning rate, over its restarts)."""
  columns, task, model, epochs = [], None, None, 0
  for name, d in files:
    task, model = d["task"], d["model"]
    epochs = max(epochs, d["epochs"])
    for lr in d["summary"]:
      curves = [r["rerun_curve"] for r in d["rows"]
                if f"{r['learning_rate']:g}" == lr]
      columns.append((f"`{name}` lr {lr} ({len(curves)} runs)",
                      [sum(c[e] for c in curves) / len(curves)
                       for e in range(d["epochs"])]))
  if not columns:
    return []
  paper = [_paper_mean_at(task, model, e) for e in range(1, epochs + 1)]
  cell = lambda x: "" if x is None else f"{x:.3f}"
  lines = [f"Mean validation CE difference by epoch ({model} on {task}): the "
           "paper's Figure 3 (its 5 selected runs) beside each file's "
           "reruns:", "",
           "| epoch | paper | " + " | ".join(c for c, _ in columns) + " |",
           "|---" * (len(columns) + 2) + "|"]
  for e in range(epochs):
    lines.append(f"| {e + 1} | {cell(paper[e])} | " + " | ".join(
        cell(v[e] if e < len(v) else None) for _, v in columns) + " |")
  return lines + [""]


def _codes(d):
  """The code that made a rerun_records file's runs, in words."""
  codes = d.get("rerun_code") or []
  if not codes or any(not c or not c.get("commit") for c in codes):
    return f"the checkout at {d['source_revision']}"
  return " and ".join(f"the code at {c['commit'][:7]}"
                      + (" with uncommitted changes" if c["modified"] else "")
                      for c in codes)


def rerun_records_block():
  """Committed records rerun under today's code
  (benchmarks/rerun_records.py): when does a run learn its task?"""
  first = lambda x: "–" if x is None else str(x)
  rows, captions, papers, loaded = [], [], {}, []
  for name in RERUN_RECORDS_FILES:
    d = _load(name)
    if d is None:
      continue
    loaded.append((name, d))
    e, thr = d["epochs"], d["threshold"]
    for lr, summ in d["summary"].items():
      runs = [r for r in d["rows"] if f"{r['learning_rate']:g}" == lr]
      moves = ", ".join(
          f"r{r['restart']} {first(r['recorded_first'])} → "
          f"{first(r['rerun_first'])}" for r in runs if r["committed"])
      rows.append(
          f"| `{name}` | {lr} | {e} | {summ['recorded_learned']}/"
          f"{summ['committed_runs']} | {summ['rerun_learned_on_committed']}/"
          f"{summ['committed_runs']} | {summ['outcome_changed']} | "
          f"{summ['rerun_learned']}/{summ['runs']} | {moves} |")
    paper = _paper_mean_at(d["task"], d["model"], e)
    if paper is not None:
      papers[(d["model"], d["task"], e)] = paper
    note = ""
    a = d.get("against")
    if a:
      same = lambda ok: "equal" if ok else "**differ**"
      note += (f" `--against={a['revision']}`: that code retrains the first "
               f"{a['retrained_epochs']} epochs of `{a['record']}` "
               + ("exactly as recorded" if a["retrained_equals_record"]
                  else "**not** as recorded")
               + f"; at initialisation, on its first {a['batches']} batches,"
               f" it and the rerun's code give parameters "
               f"{same(a['params_equal'])}, batches "
               f"{same(a['batches_equal'])}, loss max relative difference "
               f"{a['loss_max_rel_diff']:.1e}, gradient "
               f"{a['grad_max_rel_diff']:.1e}.")
    if d.get("note"):
      note += f" Note: {d['note']}."
    captions.append(
        f"`{name}`: {d['model']} on {d['task']}, the first {e} epochs of "
        f"restarts 0–{d['restarts'] - 1} (seeds 1 + r; committed records "
        f"for those in `results/`), learned = validation CE difference "
        f"below {thr:g} nats/symbol; rerun"
        + "".join(f" with `--set={x}`" for x in d.get("overrides", []))
        + f" by {_codes(d)}, {d['device']}"
        + (f"; {d['conditions']}" if d.get("conditions") else "")
        + f"; one run.{note}")
  if not rows:
    return "No rerun_records results yet.\n"
  lines = ["| file | lr | epochs | learned: committed records | the same "
           "restarts rerun | outcome changed | all reruns | first epoch "
           "below the threshold, restart by restart (record → rerun) |",
           "|---|---|---|---|---|---|---|---|"] + rows + [""]
  lines += [c + "\n" for c in captions]
  lines += [f"The paper's Figure 3 mean (its 5 selected runs) for {model} on "
            f"{task} at epoch {e}: {v:.4f}."
            for (model, task, e), v in sorted(papers.items())]
  lines += [""] + _rerun_means_table(loaded)
  return "\n".join(lines).rstrip() + "\n"


def suite_block():
  """README's line on the test suite's time (cpu_suite.json)."""
  line = cpu_suite_line(modules=3, tests=0)
  if not line:
    return f"No `{CPU_SUITE}` yet: run benchmarks/suite_record.py.\n"
  return " ".join(line + suite_compile_line()
                  + ["(docs/benchmarks.md names the slowest tests.)\n"])


BLOCKS = {"headline": headline_block, "compile": compile_block,
          "suite": suite_block,
          "reproduce_workers": reproduce_workers_block,
          "concurrent_steps": concurrent_steps_block,
          "concurrent_chunks": concurrent_chunks_block,
          "rerun_records": rerun_records_block}
BENCHMARKS = os.path.join(REPO, "docs", "benchmarks.md")
BENCHMARKS_BLOCKS = {"benchmarks": benchmarks_block, "vrns": vrns_block,
                     "limited_vrns": limited_vrns_block,
                     "corpus_step": corpus_step_block,
                     "huge_pages": huge_pages_block,
                     "window_vjp": window_vjp_block,
                     "log_stack": log_stack_block}
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")
ARCHITECTURE_BLOCKS = {"limited_stack": limited_stack_block,
                       "rns_vs_ns": rns_vs_ns_block}
# Every generated document and its blocks.
DOCUMENTS = {README: BLOCKS, BENCHMARKS: BENCHMARKS_BLOCKS,
             ARCHITECTURE: ARCHITECTURE_BLOCKS}


def render(readme_text, blocks=None):
  """README text (or another document's, given its blocks) regenerated."""
  global _last_loaded
  for name, fn in (BLOCKS if blocks is None else blocks).items():
    pattern = re.compile(
        rf"(<!-- report:{name}:begin -->\n).*?(<!-- report:{name}:end -->)",
        re.S)
    if not pattern.search(readme_text):
      raise ValueError(f"the document has no report:{name} markers")
    _last_loaded = None
    try:
      block = fn()
    except (KeyError, IndexError, TypeError, AttributeError) as e:
      read = f" (last read: {_last_loaded})" if _last_loaded else ""
      raise ValueError(f"report:{name}: a results file lacks what the block "
                       f"reads{read}: {type(e).__name__} {e}") from e
    readme_text = pattern.sub(lambda m, b=block: m.group(1) + b + m.group(2),
                              readme_text)
  return readme_text


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true")
  args = parser.parse_args()
  for path, blocks in DOCUMENTS.items():
    rel = os.path.relpath(path, REPO)
    try:
      with open(path) as f:
        text = f.read()
      new = render(text, blocks)
    except (OSError, ValueError) as e:
      cli.fail(f"{rel}: {e}")
    if args.check:
      if new != text:
        print(f"{rel}'s benchmark tables are out of date: run "
              "python benchmarks/report.py", file=sys.stderr)
        sys.exit(1)
      continue
    with open(path, "w") as f:
      f.write(new)
    print(f"rewrote {rel}")

if __name__ == "__main__":
  main()
